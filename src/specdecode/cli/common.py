"""What every command family shares: default models, dtypes, decoding arguments, threads.

The bottom of the `cli` package: the other modules import it, it imports none of them.
"""

from __future__ import annotations

import argparse

import torch

from specdecode.core.config import DEFAULT_MAX_NEW_TOKENS, POLICIES

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by every command that decodes (generate, bench)."""
    parser.add_argument(
        "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="the budget of a row"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 disables nucleus sampling")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="k of the constant policy")
    parser.add_argument(
        "--length-policy",
        choices=POLICIES,
        default="constant",
        help="how many tokens to draft per round (priced, generate's default: as far as this "
        "machine's measured prices say drafting pays, lookup first, a plain step when nothing "
        "does; head: SpecDec++; head-u: the head also "
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
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads (default: torch all cores, llama.cpp the physical cores)",
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "torch-static", "llama.cpp"),
        default=None,
        help="llama.cpp runs known models' GGUF files as shipped (the default on the CPU); "
        "torch runs transformers models (known models converted to fp32 once); torch-static "
        "runs them over a static per-row cache in fixed shapes, compiled with --compile",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch-static: torch.compile the decoding passes (CUDA graphs on a GPU; default: "
        "on for CUDA, off on the CPU, where the first pass of each shape compiles for a minute)",
    )


def set_threads(threads: int | None) -> None:
    import os

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    from specdecode.bench.prompts import require_prompts

    return [p.text for p in require_prompts(args.prompts, limit=args.limit)]
