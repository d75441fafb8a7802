"""Timing the passes a round is made of, on this machine: the prices a priced head policy
reads (`config.RoundPrices`) and the bench's calibration."""

from __future__ import annotations

import time

import torch

from specdecode.backends.kernels import median_times
from specdecode.backends.torch_eager import cache_kwargs, context_length, model_device
from specdecode.core.config import RoundPrices

PRICE_CONTEXT_TOKENS = 256  # a prompt's length in the recorded benchmarks


def step_seconds(
    model: torch.nn.Module, context: list[int], counts: list[int], reps: int = 7
) -> dict[int, float]:
    """Median time of one forward over n new tokens after a cached context, for each n.

    The counts are timed interleaved, round by round, so that a drift of the machine's speed
    (frequency, a neighbour's load) lands on all of them alike rather than on the one timed
    while it lasted: timed one after another, a 2-position pass once read 1.27 steps here
    against 1.01 measured in the same run's rounds. The rounds are `kernels.median_times`'s
    (the first one warms up); rolling the cache back after each pass is timed with it: a view
    of each layer's keys and values, far under 1% of a pass.
    """
    from transformers import DynamicCache

    device = model_device(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def clock() -> float:  # a GPU runs ahead of the host: time the kernels, not their launches
        sync()
        return time.perf_counter()

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        prefix = torch.tensor([context], device=device)
        passed = cache_kwargs(model, cache)
        model(prefix, use_cache=True, logits_to_keep=1, **passed)

        def forward(n: int):
            new = prefix[:, -n:] if len(context) >= n else prefix[:, -1:].repeat(1, n)

            def run() -> None:
                model(new, use_cache=True, logits_to_keep=n, **passed)
                cache.crop(-n)

            return run

        return median_times({n: forward(n) for n in counts}, reps, clock)


def measure_round_prices(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    max_tokens: int,
    context: list[int] | None = None,
    reps: int = 5,
) -> RoundPrices:
    """A drafter pass and the target's verify passes over 2..max_tokens + 1 positions, in
    target steps, after `context` (default: up to 256 tokens of fixed ids; a pass's time
    depends on its shapes, not on the ids)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if context is None:
        vocab = target.get_input_embeddings().num_embeddings
        room = (context_length(target) or 1 << 30) - max_tokens - 1
        if room < 1:
            raise ValueError(f"rounds of {max_tokens} drafted tokens do not fit the context")
        context = [(1000 + i) % vocab for i in range(min(PRICE_CONTEXT_TOKENS, room))]
    seconds = step_seconds(target, context, list(range(1, max_tokens + 2)), reps)
    draft = step_seconds(drafter, context, [1], reps)[1]
    step = seconds[1]
    return RoundPrices(draft / step, tuple(seconds[m + 1] / step for m in range(1, max_tokens + 1)))
