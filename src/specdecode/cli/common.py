"""What every command family shares: default models, dtypes, decoding arguments, threads, and
the checks of those arguments that need no model.

The bottom of the `cli` package: the other modules import it, it imports none of them. It
imports neither torch nor transformers: a command checks its arguments here first, so a bad
setting fails in a fraction of a second instead of after the models load.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from specdecode.backend_names import BACKENDS, LLAMA_CPP, TORCH
from specdecode.core.config import (
    DEFAULT_CORPUS,
    DEFAULT_DRAFTING,
    DEFAULT_MAX_NEW_TOKENS,
    DRAFTINGS,
    NO_CORPUS,
    POLICIES,
    PROMPT_LOOKUP,
    SamplingConfig,
)

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DTYPES = ("bfloat16", "float16", "float32")  # torch dtypes by name (`torch_dtype`)
# the choices of `loading.int8_draft_wanted`, here so that listing them imports no torch
# (a test keeps the two equal)
DRAFT_PRECISIONS = ("auto", "int8", "fp32")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The pair, as `generate` and `serve` both take it."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="model directory or known name")
    parser.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        help=f"drafter directory or known name, or {PROMPT_LOOKUP} (no drafter model: drafting "
        "auto then prices lookup alone; --drafting lookup drafts k every round)",
    )
    parser.add_argument("--no-draft", action="store_true", help="plain decoding of the target")


def add_drafting_arguments(parser: argparse.ArgumentParser) -> None:
    """How tokens are drafted (`config.DRAFTINGS`), for the commands that decode one way."""
    parser.add_argument(
        "--drafting",
        choices=tuple(DRAFTINGS),
        default=DEFAULT_DRAFTING,
        help="; ".join(f"{name}: {what}" for name, what in DRAFTINGS.items())
        + f" (default: {DEFAULT_DRAFTING})",
    )
    parser.add_argument(
        "--lookup-first",
        dest="drafting",
        action="store_const",
        const="lookup-first",
        help="the same as --drafting lookup-first",
    )

    parser.add_argument(
        "--corpus",
        default=None,
        help="drafting auto also drafts from a corpus where a row's own text has no match: "
        "stdlib (this Python's standard library sources), a text file or a folder of them "
        f"(indexed once, then cached), or {NO_CORPUS} (default: {DEFAULT_CORPUS} under "
        f"drafting auto, {NO_CORPUS} otherwise; a row asks the corpus only while it pays)",
    )


def checked_corpus(args: argparse.Namespace) -> str | None:
    """The corpus drafting auto reads (None: none), its files found before any model loads."""
    from specdecode.corpora import corpus_files

    no_draft = getattr(args, "no_draft", False)
    drafts_auto = args.drafting == "auto" and not no_draft
    if args.corpus is None:  # the default: the standard library where drafting auto reads it
        if not drafts_auto:
            return None
        try:
            corpus_files(DEFAULT_CORPUS)
        except ValueError as error:  # a Python installed without its sources
            print(f"[corpus] drafting without a corpus: {error}", file=sys.stderr)
            return None
        return DEFAULT_CORPUS
    if args.corpus == NO_CORPUS:
        return None
    if not drafts_auto:
        how = "--no-draft" if no_draft else f"--drafting {args.drafting}"
        raise ValueError(
            f"--corpus drafts under drafting auto (the default) only, and {how} does not read "
            "it: leave --corpus out, or use drafting auto"
        )
    corpus_files(args.corpus)
    return args.corpus


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
        help="how many tokens the drafter model or lookup drafts per round (drafting auto plans "
        "its own: use the others with --drafting model, lookup or lookup-first); head: "
        "SpecDec++; head-u: the head also reads each token's acceptance number, sampling only; "
        "the default pair's heads ship",
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
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads (default: torch all cores, llama.cpp the physical cores)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="llama.cpp runs known models' GGUF files as shipped (the default on the CPU); "
        "torch runs transformers models (known models converted to fp32 once); torch-static "
        "runs them over a static per-row cache in fixed shapes (CUDA graphs on a GPU)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch-static: torch.compile the decoding passes instead of capturing them by hand "
        "(on a GPU the passes are captured as CUDA graphs at first use, a fraction of a second "
        "each; compiling takes tens of seconds a shape, a minute on a CPU)",
    )


def torch_dtype(name: str) -> Any:
    """The torch dtype of a `--dtype` choice (imports torch: call it after the checks)."""
    import torch

    return getattr(torch, name)


def set_threads(threads: int | None) -> None:
    import torch

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    from specdecode.prompts import require_prompts

    return [p.text for p in require_prompts(args.prompts, limit=args.limit)]


# --------------------------------------------------------------------------- checks, no model


def decoding_backend(target: str, device: str, backend: str | None) -> str:
    """The backend a run will use: `--backend`, else `loading.default_backend`'s rule (llama.cpp
    for a known model or a .gguf file on the CPU, torch otherwise), decided without importing
    the loading module, nor torch with it (a test keeps the two equal)."""
    if backend is not None:
        return backend
    from specdecode.models.catalogue import MODELS

    is_gguf = target in MODELS or str(target).endswith(".gguf")
    return LLAMA_CPP if is_gguf and str(device) == "cpu" else TORCH


def check_decoding_arguments(args: argparse.Namespace, backend: str | None) -> None:
    """What `add_decoding_arguments` parsed, checked before any model or torch loads: the
    sampling settings, the token budget, threads, seed, and (where the backend is known) the
    dtype and device it takes. The errors name the setting and what to give instead."""
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1 (or left out: all cores), got {args.threads}")
    if args.seed is not None and not -(2**63) <= args.seed < 2**64:  # a torch generator's range
        raise ValueError(f"--seed must be a 64-bit integer, got {args.seed}")
    if backend == LLAMA_CPP and (args.device != "cpu" or args.dtype != "float32"):
        raise ValueError(
            "the llama.cpp backend runs a GGUF's own weights on the CPU: --dtype and --device "
            "are options of the torch backends (--backend torch)"
        )


def check_device(device: str) -> None:
    """The device names one that this torch build and machine have (imports torch: after the
    other checks, before any model loads)."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as error:
        raise ValueError(
            f"--device {device!r} is not a device name (cpu, cuda, cuda:1, ...): {error}"
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch finds no CUDA device here (a CPU-only build or no GPU); "
            "use --device cpu"
        )
