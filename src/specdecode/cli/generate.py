"""`specdecode generate`: decode prompts with the engine and stream the text to the terminal.

The arguments are checked in two stages before anything heavy happens: what needs no model at
once, before torch is imported (`checked_arguments`); what needs the target's tokenizer and
context right after the tokenizer loads and before its weights are read
(`loading.fitted_tokenizer`). The target is resolved once (`loading.resolve`) and its files
passed along to the load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from specdecode.backend_names import LLAMA_CPP, TORCH_BACKENDS, TORCH_STATIC
from specdecode.cli.common import (
    DRAFT_PRECISIONS,
    add_decoding_arguments,
    add_drafting_arguments,
    add_model_arguments,
    check_decoding_arguments,
    check_device,
    checked_corpus,
    decoding_backend,
    read_prompts,
    set_threads,
    torch_dtype,
)
from specdecode.core.config import (
    DEFAULT_BOUND,
    HEAD_POLICIES,
    PROMPT_LOOKUP,
    DecodeConfig,
    SamplingConfig,
    max_draft_batch_option,
)


def checked_arguments(args: argparse.Namespace) -> tuple[str, list[str], dict[str, Any]]:
    """The backend, the prompts and the decoding settings (`SpeculativeDecoder.generate`'s
    keywords), checked without a model: everything here fails in a fraction of a second."""
    draft = None if args.no_draft else args.draft
    backend = decoding_backend(args.target, args.device, args.backend)
    check_decoding_arguments(args, backend)
    if args.compile is not None and backend != TORCH_STATIC:
        raise ValueError(
            "--compile is an option of the torch-static backend (--backend torch-static)"
        )
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit takes the first N >= 1 prompts of --prompts, got {args.limit}")
    if args.priced:
        if args.length_policy not in HEAD_POLICIES:
            raise ValueError("--priced prices the head policies' rounds: use --length-policy head")
        if draft is None:
            raise ValueError("--priced prices drafted tokens; it needs a drafter (no --no-draft)")
    if args.head is not None and not Path(args.head).is_dir():
        raise FileNotFoundError(
            f"no acceptance head at {args.head} (not a directory); give one written by "
            "`specdecode head train`, or leave --head out for the shipped heads"
        )
    if args.drafting == "lookup-first" and draft in (None, PROMPT_LOOKUP):
        raise ValueError(
            "drafting lookup-first looks up before a drafter model; give one (--draft) and "
            "leave --no-draft out, or use --drafting lookup"
        )
    if args.length_policy in HEAD_POLICIES and backend == LLAMA_CPP:
        raise ValueError(
            f"length policy {args.length_policy!r} decodes with an acceptance head on the "
            "PyTorch backends only; use drafting auto (the default), or --backend torch"
        )
    settings: dict[str, Any] = dict(
        drafting=args.drafting,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_draft_tokens=args.num_draft_tokens,
        seed=args.seed,
        length_policy=args.length_policy,
        stop_threshold=args.stop_threshold,
        bound=tuple(args.bound) if args.bound else None,
        coupled=args.coupled,
        max_draft_batch=max_draft_batch_option(args.max_draft_batch),
    )
    DecodeConfig(  # what the API builds from these settings, refused here if it would be
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
        **{k: v for k, v in settings.items() if k not in ("temperature", "top_k", "top_p")},
    )
    settings["use_drafter"] = not args.no_draft
    prompts = read_prompts(args)
    for i, prompt in enumerate(prompts):
        if not prompt and not args.chat:  # a chat template gives an empty turn its tokens
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    return backend, prompts, settings


class Stages:
    """Seconds of each stage of a command, said on stderr at its end (`--timings`): where the
    time to a first answer goes on this machine."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.last
        self.last = now

    def describe(self) -> str:
        parts = [f"{stage} {seconds:.2f} s" for stage, seconds in self.seconds.items()]
        return f"{', '.join(parts)}; in all {sum(self.seconds.values()):.2f} s"


def cmd_generate(args: argparse.Namespace) -> int:
    stages = Stages()
    backend, prompts, settings = checked_arguments(args)
    check_device(args.device)
    set_threads(args.threads)
    corpus = checked_corpus(args)
    stages.done("arguments")
    from specdecode import loading
    from specdecode.api import SpeculativeDecoder

    stages.done("imports")
    source = loading.resolve(args.target, backend)  # the one time the target is looked up
    stages.done("model files")
    tokenizer = loading.fitted_tokenizer(source, prompts, args.chat, args.max_new_tokens)
    stages.done("tokenizer")
    # lookup drafts with no model: none is loaded for it
    draft = None if args.no_draft or args.drafting == "lookup" else args.draft
    dtype = torch_dtype(args.dtype)
    torch_only = backend in TORCH_BACKENDS
    decoder = SpeculativeDecoder.from_pretrained(
        source,
        draft,
        dtype=dtype,
        device=args.device,
        prepack=False if args.no_prepack else None,
        drafter_int8=torch_only
        and draft not in (None, PROMPT_LOOKUP)
        and loading.int8_draft_wanted(args.draft_precision, args.device, dtype),
        backend=backend,
        threads=args.threads,
        compile=args.compile,
        tokenizer=tokenizer if backend == LLAMA_CPP else None,
        # each batch of prompts runs at most one target pass per new token
        passes=args.max_new_tokens * -(-len(prompts) // args.batch_size),
    )
    stages.done("weights")
    decoder.use_corpus(corpus)  # the first use of a corpus indexes it (seconds), then cached
    stages.done("corpus")
    if corpus is not None and not args.json:
        print(f"[corpus] drafting auto also drafts from {corpus}", file=sys.stderr)
    if args.retime_prices or (args.drafting == "auto" and not args.no_draft):
        known = decoder.prices(retime=args.retime_prices)  # cached, or timed and kept
        if not args.json:
            print(f"[{decoder.backend} prices] {known.describe()}", file=sys.stderr)
    stages.done("prices")
    if args.head is not None:
        decoder.load_head(args.head)
    if args.priced:
        if decoder.drafter is None:
            raise ValueError("--priced prices drafted tokens; it needs a drafter model (--draft)")
        prices = decoder.prices()
        most = args.bound[1] if args.bound else DEFAULT_BOUND[1]
        print(f"[round prices] {prices.rounds(1).describe(most)}", file=sys.stderr)
        settings["prices"] = prices
    records = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        out = stream_to_terminal(decoder, chunk, args.chat, settings, quiet=args.json)
        for i, text in enumerate(out.texts or []):
            records.append({"prompt": chunk[i], "completion": text, "tokens": out.new_tokens[i]})
        if not args.json:
            print(f"\n[stats] {out.stats.summary()}", file=sys.stderr)
        else:
            records[-1]["batch_stats"] = out.stats.as_dict()
    stages.done("decoding")
    if args.timings:
        print(f"[timings] {stages.describe()}", file=sys.stderr)
    if args.json:
        print(json.dumps(records, indent=1))
    return 0


def stream_to_terminal(decoder, prompts: list[str], chat: bool, settings: dict, quiet: bool):
    """Stream one row's text as it is committed; with several rows, print each when it ends."""
    shown = [""] * len(prompts)

    def show(event, tokens: list[list[int]]) -> None:
        for row, done in zip(event.rows, event.finished, strict=True):
            if quiet or (len(prompts) > 1 and not done):
                continue
            text = decoder.tokenizer.decode(tokens[row], skip_special_tokens=True)
            if len(prompts) == 1:
                print(text[len(shown[row]) :], end="", flush=True)
                shown[row] = text
            else:
                print(f"--- [{row}] {prompts[row]!r}\n{text}\n", flush=True)

    return decoder.generate(prompts, chat=chat, on_step=show, **settings)


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with speculative decoding")
    add_model_arguments(p)
    p.add_argument(
        "--draft-precision",
        choices=DRAFT_PRECISIONS,
        default="auto",
        help="int8: draft with an int8 copy of the drafter (the bench's sd-int8; cheaper drafts, "
        "the same output law); auto (default): int8 for float32 on the CPU, else as loaded",
    )
    p.add_argument(
        "--no-prepack",
        action="store_true",
        help="default PyTorch kernels for the target (saves a copy of its linear weights; "
        "verify passes then cost more on many CPUs)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts", help="a prompt file (.jsonl/.txt) or set (humaneval, mtbench)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of --prompts")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--max-draft-batch",
        type=int,
        default=None,
        help="draft only while at most N rows of a batch are running, plain steps above "
        "(default: always draft; greedy output is the same either way)",
    )
    add_drafting_arguments(p)
    p.add_argument("--json", action="store_true", help="print completions and stats as JSON")
    p.add_argument(
        "--retime-prices",
        action="store_true",
        help="time this machine's pass prices afresh rather than read them from the cache "
        "(after a change the cache key does not see, or a timing a busy machine skewed)",
    )
    p.add_argument(
        "--timings",
        action="store_true",
        help="say on stderr the seconds of each stage: arguments, imports, model files, "
        "tokenizer, weights, corpus, prices, decoding",
    )
    add_decoding_arguments(p)
    p.set_defaults(func=cmd_generate)
