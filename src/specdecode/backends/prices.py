"""What a pass costs on a backend, measured through the model interface at load.

The priced policy (`priced.PricedDrafter`) plans rounds from these prices rather than from a
rule of thumb, because they differ by an order of magnitude between machines and backends: on
a 2-core CPU a 4-bit target on llama.cpp pays about half a step per extra token in a pass, an
fp32 target on prepacked PyTorch kernels almost nothing up to 4-5 tokens, a GPU nothing up to
a tile. Timing goes through `ModelBackend` only, so every backend is priced the same way.
"""

from __future__ import annotations

import time

import torch

from specdecode.backends.base import ModelBackend
from specdecode.backends.kernels import median_times
from specdecode.config import PassPrices

PRICE_CONTEXT_TOKENS = 256  # a prompt's length in the recorded benchmarks
PRICED_PASS_TOKENS = 12  # passes timed: 1..12 tokens; longer ones extrapolate the last slope


def pass_seconds(
    backend: ModelBackend, context: list[int], counts: list[int], reps: int
) -> dict[int, float]:
    """Median seconds of one pass of n tokens (one row) after `context`, for each n in counts,
    timed interleaved (a drift of the machine lands on all of them alike); each pass is rolled
    back after it, so every one sees the same cache."""
    device = backend.device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def clock() -> float:
        sync()
        return time.perf_counter()

    prefix = torch.tensor([context], device=device)  # [1, context]
    backend.reset(1)
    backend.forward(prefix, torch.ones_like(prefix, dtype=torch.bool))
    held = backend.lengths.clone()

    def timed(n: int):
        tokens = prefix[:, -n:] if len(context) >= n else prefix[:, -1:].repeat(1, n)
        valid = torch.ones_like(tokens, dtype=torch.bool)

        def run() -> None:
            backend.forward(tokens, valid, logits_to_keep=n)
            backend.truncate(held)

        return run

    try:
        return median_times({n: timed(n) for n in counts}, reps, clock)
    finally:
        backend.reset(0)


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
    seconds = pass_seconds(target, context, list(range(1, max_tokens + 1)), reps)
    step = seconds[1]
    draft = None
    if drafter is not None:
        draft = pass_seconds(drafter, context, [1], reps)[1] / step
    return PassPrices(tuple(seconds[n] / step for n in range(1, max_tokens + 1)), draft)
