"""The `specdecode` command line: one console script, one subcommand per job.

Each subcommand lives next to the code it drives and registers itself through an
`add_subcommands(subparsers)` function; this module only gathers them.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specdecode.config import (
    DEFAULT_BOUND,
    HEAD_POLICIES,
    LOOKUP_FIRST,
    POLICIES,
    PROMPT_LOOKUP,
    max_draft_batch_option,
)
from specdecode.kernels import DRAFT_PRECISIONS, int8_draft_wanted

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by every command that decodes (generate, bench)."""
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 disables nucleus sampling")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="k of the constant policy")
    parser.add_argument(
        "--length-policy",
        choices=POLICIES,
        default="constant",
        help="how many tokens to draft per round (head: SpecDec++; head-u: the head also "
        "reads each token's acceptance number, sampling only; the default pair's heads ship)",
    )
    parser.add_argument(
        "--stop-threshold",
        type=float,
        default=None,
        help="confidence: least drafter top probability (0.4); head, head-u: stop once "
        "P(some drafted token rejected) exceeds it (0.7, 0.8)",
    )
    parser.add_argument(
        "--bound",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="tokens per round of the adaptive policies (default 1 8)",
    )
    parser.add_argument("--head", default=None, help="acceptance head directory (head policy)")
    parser.add_argument(
        "--priced",
        action="store_true",
        help="head policies weigh each further token against this machine's round prices "
        "(a verify pass's cost grows with its length): generate times them at load, bench runs "
        "every head method twice, flat and priced by its calibration",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--coupled",
        action="store_true",
        help="sampling: key random numbers to positions and draw bonus tokens via the drafter, "
        "so every length policy commits the same text for a seed (paired comparisons; one "
        "extra drafter pass after a fully accepted round, timed apart)",
    )
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")


def set_threads(threads: int | None) -> None:
    import os

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    from specdecode.prompts import load_prompts

    return [p.text for p in load_prompts(args.prompts, limit=args.limit)]


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.api import SpeculativeDecoder

    set_threads(args.threads)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    prompts = read_prompts(args)
    draft = None if args.no_draft else args.draft
    dtype = DTYPES[args.dtype]
    decoder = SpeculativeDecoder.from_pretrained(
        args.target,
        draft,
        dtype,
        args.device,
        prepack=False if args.no_prepack else None,
        drafter_int8=draft not in (None, PROMPT_LOOKUP)
        and int8_draft_wanted(args.draft_precision, args.device, dtype),
    )
    if args.head is not None:
        decoder.load_head(args.head)
    prices = None
    if args.priced:
        if args.length_policy not in HEAD_POLICIES:
            raise ValueError("--priced prices the head policies' rounds: use --length-policy head")
        if draft is None:
            raise ValueError("--priced prices drafted tokens; it needs a drafter (no --no-draft)")
        prices = decoder.measure_round_prices(args.bound[1] if args.bound else DEFAULT_BOUND[1])
        print(f"[round prices] {prices.describe()}", file=sys.stderr)
    settings = dict(
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
        round_prices=prices,
    )
    if args.lookup_first:
        if draft in (None, PROMPT_LOOKUP):
            raise ValueError("--lookup-first looks up before a drafter model; give one (--draft)")
        settings["lookup_first"] = LOOKUP_FIRST
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


def add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("--target", default=DEFAULT_TARGET, help="model directory or known name")
    p.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"drafter directory or known name, or {PROMPT_LOOKUP} (n-gram lookup in the text "
        "itself, no drafter model)",
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
    p.add_argument(
        "--lookup-first",
        action="store_true",
        help="where a row's last 3 or 4 tokens occurred before, draft what followed them (prompt "
        "lookup) instead of running the drafter that round (the bench's sd-int8-lookup)",
    )
    p.add_argument("--json", action="store_true", help="print completions and stats as JSON")
    add_decoding_arguments(p)
    p.set_defaults(func=cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    from specdecode import head_cli, model_store
    from specdecode.bench import cli as bench_cli
    from specdecode.seq2seq import cli as seq2seq_cli
    from specdecode.seq2seq import data_cli

    parser = argparse.ArgumentParser(
        prog="specdecode", description="Speculative decoding for Hugging Face models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate(subparsers)
    model_store.add_subcommands(subparsers)
    bench_cli.add_subcommands(subparsers)
    head_cli.add_subcommands(subparsers)
    data_cli.add_subcommands(subparsers)
    seq2seq_cli.add_subcommands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        print(f"specdecode {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
