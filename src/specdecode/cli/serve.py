"""`specdecode serve`: an OpenAI-compatible server over the engine's decoding loop."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdecode.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.core.config import HEAD_POLICIES, POLICIES, PROMPT_LOOKUP


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from specdecode.serve.server import ServeConfig, serve
    except ImportError as error:
        raise RuntimeError(
            f"the server needs the serve extra ({error.name} is missing): "
            "pip install 'specdecode[serve]'"
        ) from None
    if args.length_policy in HEAD_POLICIES:
        raise ValueError(
            f"--length-policy {args.length_policy} reads a head trained for one verification "
            "rule, and a server's requests mix greedy and sampled ones: use priced or constant"
        )
    draft = None if args.no_draft else args.draft
    config = ServeConfig(
        model_name=args.model_name or Path(args.target).name.removesuffix(".gguf"),
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        context=args.context,
        api_key=args.api_key or os.environ.get("SPECDECODE_API_KEY") or None,
        drain_seconds=args.drain_seconds,
        prefill_chunk=args.prefill_chunk,
        log_level=args.log_level,
        loop_options=(
            ("use_drafter", draft is not None),
            ("length_policy", args.length_policy),
            ("num_draft_tokens", args.num_draft_tokens),
        ),
    )

    def load():
        from specdecode.api import SpeculativeDecoder, default_backend

        backend = args.backend or default_backend(args.target, "cpu")
        print(
            f"[serve] loading {args.target}"
            + (f" with drafter {draft}" if draft else "")
            + f" on {backend}; /health answers 503 until ready",
            file=sys.stderr,
            flush=True,
        )
        decoder = SpeculativeDecoder.from_pretrained(
            args.target, draft, backend=backend, threads=args.threads
        )
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
    p.add_argument("--target", default=DEFAULT_TARGET, help="model directory or known name")
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"drafter directory or known name, or {PROMPT_LOOKUP} (n-gram lookup, no model)",
    )
    p.add_argument("--no-draft", action="store_true", help="plain decoding of the target")
    p.add_argument(
        "--backend",
        choices=("torch", "torch-static", "llama.cpp"),
        default=None,
        help="llama.cpp for known models and GGUF files (the default on the CPU), else torch",
    )
    p.add_argument(
        "--length-policy",
        choices=[p for p in POLICIES if p not in HEAD_POLICIES],
        default="priced",
        help="how many tokens to draft per round; priced (default): as far as this machine's "
        "prices, timed at load, say drafting pays for the batch running, a plain step otherwise",
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
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (or set SPECDECODE_API_KEY)",
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
