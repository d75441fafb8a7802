"""`specdecode serve`: an OpenAI-compatible server over the engine's decoding loop."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdecode.backend_names import BACKENDS, LLAMA_CPP
from specdecode.cli.common import (
    add_drafting_arguments,
    add_model_arguments,
    checked_corpus,
)
from specdecode.core.config import HEAD_POLICIES, POLICIES
from specdecode.serve.protocol import DEFAULT_MAX_BODY_MIB  # needs no serve extra

# host memory per model for earlier prompts' cells: 18k tokens of the default 1.5B target
DEFAULT_PREFIX_CACHE_MIB = 512
# the API key from the environment: a command line's arguments are visible to every user in `ps`
API_KEY_VARIABLE = "SPECDECODE_API_KEY"


def cmd_serve(args: argparse.Namespace) -> int:
    if args.prefix_cache_mib < 0:
        raise ValueError(
            f"--prefix-cache-mib must be >= 0 (0: no host memory), not {args.prefix_cache_mib}"
        )
    try:
        from specdecode.serve.server import ServeConfig, serve
    except ImportError as error:
        raise RuntimeError(
            f"the server needs the serve extra ({error.name} is missing): "
            "pip install 'specdecode[serve]'"
        ) from None
    corpus = checked_corpus(args)
    # lookup drafts with no model: none is loaded for it
    draft = None if args.no_draft or args.drafting == "lookup" else args.draft
    config = ServeConfig(
        model_name=args.model_name or Path(args.target).name.removesuffix(".gguf"),
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        context=args.context,
        api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
        max_body_mib=args.max_body_mib,
        drain_seconds=args.drain_seconds,
        prefill_chunk=args.prefill_chunk,
        log_level=args.log_level,
        loop_options=(
            ("use_drafter", not args.no_draft),
            ("drafting", args.drafting),
            ("length_policy", args.length_policy),
            ("num_draft_tokens", args.num_draft_tokens),
        ),
    )

    def load():
        from specdecode.api import SpeculativeDecoder
        from specdecode.loading import default_backend

        backend = args.backend or default_backend(args.target, "cpu")
        print(
            f"[serve] loading {args.target}"
            + (f" with drafter {draft}" if draft else "")
            + (f" and corpus {corpus}" if corpus else "")
            + f" on {backend}; /health answers 503 until ready",
            file=sys.stderr,
            flush=True,
        )
        # llama.cpp sizes its cache rows x context up front: to what is served, not 4096
        on_llamacpp = backend == LLAMA_CPP
        decoder = SpeculativeDecoder.from_pretrained(
            args.target,
            draft,
            backend=backend,
            threads=args.threads,
            context=config.context if on_llamacpp else None,
            prefix_cache_mib=args.prefix_cache_mib if on_llamacpp else 0,
        )
        decoder.use_corpus(corpus)
        if config.context and config.context > decoder.context:
            print(
                f"[serve] --context {config.context} is over the model's {decoder.context} "
                f"tokens per row; serving {decoder.context}",
                file=sys.stderr,
            )
        return decoder

    return serve(load, config)


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible server (completions, chat, metrics) over the engine"
    )
    add_model_arguments(p)
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="llama.cpp for known models and GGUF files (the default on the CPU), else torch",
    )
    add_drafting_arguments(p)
    p.add_argument(
        "--length-policy",
        choices=[name for name in POLICIES if name not in HEAD_POLICIES],
        default="constant",
        help="how many tokens drafting model, lookup or lookup-first drafts per round (drafting "
        "auto plans its own from this machine's prices); the head policies are refused: a head "
        "is trained for one verification rule and a server's rows mix greedy and sampled ones",
    )
    p.add_argument("--num-draft-tokens", type=int, default=4, help="k of the constant policy")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting for a row; beyond them the server answers 429 with Retry-After",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per request, prompt plus new tokens (default: the model's row context)",
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=DEFAULT_PREFIX_CACHE_MIB,
        help="llama.cpp: host memory per model for the cache cells of earlier prompts, restored "
        "when a prompt sharing their prefix comes back (0: only what the rows' sequences hold)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics; better set in the "
        f"environment variable {API_KEY_VARIABLE}, which other users cannot read in `ps` as "
        "they can a command line",
    )
    p.add_argument(
        "--max-body-mib",
        type=float,
        default=DEFAULT_MAX_BODY_MIB,
        help="largest request body in MiB, refused with 413 before it is read in full",
    )
    p.add_argument("--model-name", default=None, help="the model id served (default: --target)")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests may take to finish before the server exits",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per round per row"
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(func=cmd_serve)
