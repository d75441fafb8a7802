"""`specdecode generate`: decode prompts with the engine and stream the text to the terminal."""

from __future__ import annotations

import argparse
import json
import sys

from specdecode.backends.kernels import DRAFT_PRECISIONS, int8_draft_wanted
from specdecode.cli.common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DTYPES,
    add_decoding_arguments,
    add_drafting_arguments,
    read_prompts,
    set_threads,
)
from specdecode.core.config import (
    DEFAULT_BOUND,
    HEAD_POLICIES,
    PROMPT_LOOKUP,
    max_draft_batch_option,
)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.api import TORCH_BACKENDS, SpeculativeDecoder, default_backend

    set_threads(args.threads)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    prompts = read_prompts(args)
    # lookup drafts with no model: none is loaded for it
    draft = None if args.no_draft or args.drafting == "lookup" else args.draft
    dtype = DTYPES[args.dtype]
    backend = args.backend or default_backend(args.target, args.device)
    torch_only = backend in TORCH_BACKENDS
    decoder = SpeculativeDecoder.from_pretrained(
        args.target,
        draft,
        dtype,
        args.device,
        prepack=False if args.no_prepack else None,
        drafter_int8=torch_only
        and draft not in (None, PROMPT_LOOKUP)
        and int8_draft_wanted(args.draft_precision, args.device, dtype),
        backend=backend,
        threads=args.threads,
        compile=args.compile,
    )
    if args.retime_prices or (args.drafting == "auto" and not args.no_draft):
        known = decoder.prices(retime=args.retime_prices)  # cached, or timed and kept
        if not args.json:
            print(f"[{decoder.backend} prices] {known.describe()}", file=sys.stderr)
    if args.head is not None:
        decoder.load_head(args.head)
    prices = None
    if args.priced:
        if args.length_policy not in HEAD_POLICIES:
            raise ValueError("--priced prices the head policies' rounds: use --length-policy head")
        if decoder.drafter is None:
            raise ValueError("--priced prices drafted tokens; it needs a drafter model (--draft)")
        prices = decoder.prices()
        most = args.bound[1] if args.bound else DEFAULT_BOUND[1]
        print(f"[round prices] {prices.rounds(1).describe(most)}", file=sys.stderr)
    settings = dict(
        use_drafter=not args.no_draft,
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
        prices=prices,
    )
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
    p.add_argument("--target", default=DEFAULT_TARGET, help="model directory or known name")
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"drafter directory or known name, or {PROMPT_LOOKUP} (no drafter model: drafting "
        "auto then prices lookup alone; --drafting lookup drafts k every round)",
    )
    p.add_argument("--no-draft", action="store_true", help="plain decoding of the target")
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
    add_decoding_arguments(p)
    p.set_defaults(func=cmd_generate)
