"""Row plans read off median times, each row count padded to the cheapest count at or above it,
against the earlier rule (one padding count per weight, read off the best of five; before
2026-11-24).

1. Every distinct packed weight of the target is timed at 1..13 rows, interleaved, twelve
   rounds. How stable each rule's plan is: both rules applied to 2,000 random draws of the
   samples they read (5 for the old rule, 7 for the new), the share of draws that leave a
   weight's one-row product unpadded.
2. The new plans and the plans two of the last three recorded runs got from the old rule (the
   MLP's weights unpadded, the output layer padded to 4:
   `results/specdecpp-humaneval-t07-priced-mlp-unpadded/record.json`) are
   installed in turn on the same model objects, and a forward pass over 1..13 new positions
   after 256 cached tokens is timed under each, alternating (the bench's calibration timer): a
   plain step, and a verify pass of k drafted tokens in plain steps.
3. Plain greedy decoding of a few HumanEval prompts under each, rotating the order, fastest of
   two: the baseline of every speedup; the tokens must not change.

    python benchmarks/studies/kernel-row-counts/kernel_row_counts.py [N_PROMPTS] [NEW_TOKENS]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.kernels import (
    PAD_TOLERANCE,
    PackedTiedOutput,
    PrepackedLinear,
    calls_per_sample,
    padding_up_to,
    plan_from_times,
    product_candidates,
    timed_samples,
)
from specdecode.backends.torch_eager import CachedModel
from specdecode.core.prices import pass_seconds
from specdecode.prompts import load_prompts

ROWS = list(range(1, 14))
ROUNDS = 12
OLD_REPEATS = 5  # the earlier rule: the best of five after a warm-up
NEW_REPEATS = 7  # `kernels.row_plan`: the median of seven after a warm-up
DRAWS = 2000
PACKED = (PrepackedLinear, PackedTiedOutput)
LAST_RUNS = {"151936x1536": (4, 4, 4), "1536x8960": (), "8960x1536": (), "1536x1536": (2,)}


def shape_name(module: torch.nn.Module) -> str:
    """A packed weight's shape as `kernels.kernel_summary` names it in a record: "OUTxIN"."""
    return "x".join(str(n) for n in module.weight.shape)


def product_samples(module: torch.nn.Module) -> dict[int, list[float]]:
    """Seconds of the packed product at each row count, one sample per round (interleaved)."""
    calls = calls_per_sample(module.weight)
    with torch.inference_mode():
        samples = timed_samples(product_candidates(module, ROWS), ROUNDS)
    return {
        rows: [t / calls for t in seen]
        for (kind, rows), seen in samples.items()
        if kind == "packed"
    }


def old_padding(samples: dict[int, list[float]], draw) -> tuple[int, ...]:
    """One count for every shorter product: the fewest rows within tolerance of the fastest,
    by the best of the drawn samples."""
    best = {rows: min(s[i] for i in draw) for rows, s in samples.items() if rows <= 8}
    fastest = min(best.values())
    return padding_up_to(min(rows for rows, t in best.items() if t <= PAD_TOLERANCE * fastest))


def new_padding(samples: dict[int, list[float]], draw) -> tuple[int, ...]:
    """`kernels.plan_from_times` on the median of the drawn samples."""
    times = {
        ("packed", rows): statistics.median(s[i] for i in draw)
        for rows, s in samples.items()
        if rows <= 8
    }
    return plan_from_times(times | {("dense", 1): float("inf")})[1]


def share_unpadded(rule, samples: dict[int, list[float]], repeats: int) -> float:
    """The share of random draws of `repeats` rounds for which `rule` leaves one row unpadded."""
    draws = [random.Random(i).sample(range(ROUNDS), repeats) for i in range(DRAWS)]
    return sum(not rule(samples, draw) for draw in draws) / DRAWS


def main(n_prompts: int, new_tokens: int) -> None:
    torch.set_num_threads(2)
    decoder = SpeculativeDecoder.from_pretrained(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", prepack=True, drafter_int8=True, backend="torch"
    )
    packed = [m for m in decoder.target.modules() if isinstance(m, PACKED)]
    shapes = {shape_name(m): m for m in reversed(packed)}
    plans: dict[str, dict[str, tuple[int, ...]]] = {
        "median, per count": {},
        "last runs' plans": LAST_RUNS | {"256x1536": ()},
    }
    print(f"packed products, ms at {ROWS[0]}..{ROWS[-1]} rows: median (best) of {ROUNDS}")
    unpadded = {}
    for name, module in shapes.items():
        samples = product_samples(module)
        median = {rows: statistics.median(s) for rows, s in samples.items()}
        plans["median, per count"][name] = new_padding(samples, range(ROUNDS))
        cells = " ".join(f"{1e3 * median[r]:.3f}({1e3 * min(samples[r]):.3f})" for r in ROWS)
        print(f"  {name:12s} {cells}")
        unpadded[name] = [
            share_unpadded(old_padding, samples, OLD_REPEATS),
            share_unpadded(new_padding, samples, NEW_REPEATS),
        ]
    print(f"share of {DRAWS} draws leaving one row unpadded, best of 5 / median of 7:")
    print("  " + "; ".join(f"{n} {a:.0%} / {b:.0%}" for n, (a, b) in unpadded.items()))
    for label, plan in plans.items():
        print(f"pad_to by weight shape, {label}: {plan}")

    def install(label: str) -> None:
        for module in packed:
            module.pad_to = plans[label][shape_name(module)]

    context = [(1000 + i) % 151936 for i in range(256)]
    curves: dict[str, list[dict[int, float]]] = {label: [] for label in plans}
    for _ in range(3):
        for label in plans:
            install(label)
            backend = CachedModel(decoder.target)
            curves[label].append(pass_seconds([(backend, ROWS)], context, reps=5)[0])
    print("forward after 256 cached tokens (median of 3 alternating runs of 5 each):")
    for label, runs in curves.items():
        seconds = {n: statistics.median(run[n] for run in runs) for n in ROWS}
        ratios = " ".join(f"{seconds[n] / seconds[1]:.2f}" for n in ROWS[1:])
        print(f"  {label:18s} step {1e3 * seconds[1]:6.1f} ms; verify of 1..12 drafted: {ratios}")

    prompts = [p.text for p in load_prompts("humaneval", limit=n_prompts)]
    seconds = {label: [float("inf")] * n_prompts for label in plans}
    tokens = {label: [None] * n_prompts for label in plans}
    labels = list(plans)
    for i, prompt in enumerate(prompts):
        for repeat in range(2):
            for label in labels[(i + repeat) % 2 :] + labels[: (i + repeat) % 2]:
                install(label)
                start = time.perf_counter()
                out = decoder.generate([prompt], max_new_tokens=new_tokens, use_drafter=False)
                seconds[label][i] = min(seconds[label][i], time.perf_counter() - start)
                tokens[label][i] = out.new_tokens[0]
    old, new = seconds["last runs' plans"], seconds["median, per count"]
    ratio = statistics.geometric_mean([a / b for a, b in zip(old, new, strict=True)])
    same = sum(a == b for a, b in zip(*tokens.values(), strict=True))
    print(
        f"plain greedy decoding, {n_prompts} HumanEval prompts x {new_tokens} tokens: median "
        f"plans {ratio:.3f}x the speed of the last runs' plans; same tokens on {same}/{n_prompts}"
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3])) if len(sys.argv) > 1 else main(4, 32)
