"""Benchmark arithmetic: the Leviathan et al. (2023) bound, per-prompt ratios, summaries."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens committed per target call at acceptance alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), if a verify costs one step."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_tokens_per_call(alpha, k) / (k * c + 1)


def alpha_from_tokens_per_call(tokens: float, k: int) -> float:
    """Invert `expected_tokens_per_call`: the per-token acceptance that explains a measured tau.

    Counting accepted / drafted under-counts (tokens after a rejection are never judged), so the
    bound is computed from the acceptance that reproduces the measured tokens per call.
    """
    if k < 1 or not 1.0 <= tokens <= k + 1:
        raise ValueError(f"tokens per call must lie in [1, k + 1] = [1, {k + 1}], got {tokens}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_call(mid, k) < tokens else (low, mid)
    return (low + high) / 2


def modelled_speedup(
    target_calls_per_token: float,
    drafter_passes_per_token: float,
    drafted_per_round: float,
    verify_cost_in_steps: dict[int, float],
    c: float,
    policy_steps_per_drafted_token: float = 0.0,
) -> float:
    """Speed against plain decoding predicted from the counted calls and calibrated costs.

    Time per token, in target steps: target calls x verify cost + drafter passes x (c + policy).
    The verify cost of a round is read off a line fitted through the calibrated costs of k + 1
    tokens (k = 1..MAX), at the mean drafted length: single calibrations are noisy, the line is
    not. Under greedy decoding the counts are the same on every run, so this figure does not move
    with the machine's load the way wall-clock ratios on a shared VM do; it is a cross-check of
    the measured speedups, not a replacement.
    """
    if len(verify_cost_in_steps) < 2:
        raise ValueError("need calibrated verify costs for at least two draft lengths")
    ks = [float(k) for k in verify_cost_in_steps]
    slope, intercept = statistics.linear_regression(ks, list(verify_cost_in_steps.values()))
    verify = intercept + slope * drafted_per_round
    drafting = drafter_passes_per_token * (c + policy_steps_per_drafted_token)
    return 1.0 / (target_calls_per_token * verify + drafting)


def geometric_mean(values: Sequence[float]) -> float:
    if not values or any(v <= 0 for v in values):
        raise ValueError("geometric mean needs positive values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def bootstrap_interval(
    ratios: Sequence[float], level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the geometric mean of per-prompt ratios.

    Why: on a shared machine, and under sampling where every method writes its own text, the
    per-prompt ratio of two methods spreads by tens of percent, so a geometric mean over a few
    prompts needs its uncertainty beside it before it decides anything. Prompts are resampled
    with replacement; seeded, so a record is reproduced exactly by `--rederive`.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError("a bootstrap interval needs one or more positive ratios")
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(sum(rng.choices(logs, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    low = means[round(tail * (resamples - 1))]
    high = means[round((1 - tail) * (resamples - 1))]
    return math.exp(low), math.exp(high)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, geometric mean and spread (10th-90th percentile, min, max) of positive ratios."""
    ordered = sorted(values)
    n = len(ordered)

    def quantile(q: float) -> float:
        position = q * (n - 1)
        low = math.floor(position)
        high = min(low + 1, n - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {
        "n": n,
        "median": statistics.median(ordered),
        "geomean": geometric_mean(ordered),
        "p10": quantile(0.1),
        "p90": quantile(0.9),
        "min": ordered[0],
        "max": ordered[-1],
    }
