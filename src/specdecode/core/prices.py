"""What a pass costs on a backend, measured through the model interface at load.

Drafting `auto` (`drafting.planners`) plans rounds from these prices rather than from a
rule of thumb, because they differ by an order of magnitude between machines and backends: on
a 2-core CPU a 4-bit target on llama.cpp pays about half a step per extra token in a pass, an
fp32 target on prepacked PyTorch kernels almost nothing up to 4-5 tokens, a GPU nothing up to
a tile. Timing goes through `ModelBackend` only, so every backend is priced the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdecode.backends.base import ModelBackend
from specdecode.backends.kernels import median_times
from specdecode.core.config import PassPrices

PRICE_CONTEXT_TOKENS = 256  # a prompt's length in the recorded benchmarks
PRICED_PASS_TOKENS = 12  # passes timed: 1..12 tokens; longer ones extrapolate the last slope


def pass_seconds(
    jobs: Sequence[tuple[ModelBackend, list[int]]], context: list[int], reps: int
) -> list[dict[int, float]]:
    """Median seconds of one pass of n tokens (one row) after `context`, for each backend and
    each n of its counts. Every round times every pass of every backend, interleaved, so a
    stall of the machine (a neighbour's burst; on two cores llama.cpp's spinning threads lose
    whole time slices to any other process) lands on one sample of each rather than on every
    sample of the one timed while it lasted: timed apart (three steps, 0.1 s), a drafter step
    read 17.9 target steps in one bench run (0.64 on a quiet machine). Each pass is rolled
    back after it, so every one sees the same cache."""
    device = jobs[0][0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def clock() -> float:
        sync()
        return time.perf_counter()

    prefix = torch.tensor([context], device=device)  # [1, context]

    def timed(backend: ModelBackend, start: torch.Tensor, held: torch.Tensor, n: int):
        tokens = start[:, -n:] if len(context) >= n else start[:, -1:].repeat(1, n)
        valid = torch.ones_like(tokens, dtype=torch.bool)

        def run() -> None:
            backend.forward(tokens, valid, logits_to_keep=n)
            backend.truncate(held)

        return run

    candidates = {}
    for j, (backend, counts) in enumerate(jobs):
        start = prefix.to(backend.device)  # [1, context], on the backend's device
        backend.reset(1)
        backend.forward(start, torch.ones_like(start, dtype=torch.bool))
        held = backend.lengths.clone()
        candidates.update({(j, n): timed(backend, start, held, n) for n in counts})
    try:
        seconds = median_times(candidates, reps, clock)
    finally:
        for backend, _ in jobs:
            backend.reset(0)
    return [{n: seconds[j, n] for n in counts} for j, (_, counts) in enumerate(jobs)]


def measure_pass_prices(
    target: ModelBackend,
    drafter: ModelBackend | None,
    vocab_size: int,
    context_length: int | None,
    *,
    max_tokens: int = PRICED_PASS_TOKENS,
    reps: int = 3,
) -> PassPrices:
    """Target passes of 1..max_tokens tokens and a drafter step, in target steps (seconds)."""
    room = (context_length or 1 << 30) - max_tokens - 1
    if room < 1:
        raise ValueError(f"passes of {max_tokens} tokens do not fit the context")
    context = [(1000 + i) % vocab_size for i in range(min(PRICE_CONTEXT_TOKENS, room))]
    jobs = [(target, list(range(1, max_tokens + 1)))]
    if drafter is not None:
        jobs.append((drafter, [1]))
    seconds = pass_seconds(jobs, context, reps)
    step = seconds[0][1]
    draft = seconds[1][1] / step if drafter is not None else None
    return PassPrices(tuple(seconds[0][n] / step for n in range(1, max_tokens + 1)), draft)
