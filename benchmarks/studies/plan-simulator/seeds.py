"""The suite's simulated properties (`tests/test_plan_simulated.py`) over more seeds than the
suite runs: per cell and seed, drafting `auto` over plain decoding and over the bar (the best
fixed length where it gains 5% over plain, else plain); the step changes' share of the new
best 400 rounds on; the GPU cell's share of the best plan known. Then, per cell, the mean over
the seeds and the cells under the suite's bounds.

    python benchmarks/studies/plan-simulator/seeds.py [--seeds 1 2 3 4 5] [--workers 2]

Each seed draws its own weather, rows and texts; two workers take about seven minutes for
five seeds."""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import simulated_machine as sm
from test_plan_simulated import GRID, NOISY, ROUNDS, WARMUP, best_fixed

STEPS = [("xeon", "full-step"), ("full-step", "xeon")]  # dearer, cheaper


def grid_cell(cell: tuple[str, str, int], seed: int) -> tuple[float, float]:
    curve, text, rows = cell
    common = dict(rows=rows, rounds=ROUNDS, warmup=WARMUP, weather=NOISY, seed=seed)
    auto = sm.run(sm.CURVES[curve], sm.TEXTS[text], "auto", **common).throughput
    plain, best = best_fixed(sm.CURVES[curve], sm.TEXTS[text], **common)
    return auto / plain, auto / (best if best >= 1.05 * plain else plain)


def step_cell(change: tuple[str, str], seed: int) -> tuple[float, float]:
    before, after = change
    text, shift, settle, rounds = sm.TEXTS["copying"], 600, 400, 1600
    changed = sm.run(
        sm.CURVES[before], text, "auto", rounds=rounds, warmup=0, seed=seed,
        after_shift=sm.CURVES[after], shift_round=shift,
    )  # fmt: skip
    late = changed.per_round[shift + settle :]
    auto = sum(t for t, _, _ in late) / sum(s for _, s, _ in late)
    common = dict(rounds=rounds - shift - settle + WARMUP, warmup=WARMUP, seed=seed)
    plain, best = best_fixed(sm.CURVES[after], text, **common)
    return auto / plain, auto / best


def gpu_cell(_: object, seed: int) -> tuple[float, float]:
    gpu, code = sm.GPU, sm.TEXTS["code"]
    common = dict(rounds=ROUNDS, warmup=WARMUP, weather=NOISY, seed=seed)
    auto = sm.run(gpu, code, "auto", **common)
    oracle = sm.run(gpu, code, "auto", prices=gpu.prices, judge=False, **common).throughput
    _, best = best_fixed(gpu, code, **common)
    return auto.throughput / max(best, oracle), auto.drafted_rounds / auto.rounds


KINDS = {"grid": grid_cell, "step": step_cell, "gpu": gpu_cell}


def work(job: tuple[str, object, int]) -> tuple[str, object, int, tuple[float, float]]:
    kind, cell, seed = job
    return kind, cell, seed, KINDS[kind](cell, seed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    jobs = [("grid", c, s) for s in args.seeds for c in GRID]
    jobs += [("step", c, s) for s in args.seeds for c in STEPS]
    jobs += [("gpu", "gpu code 1", s) for s in args.seeds]
    with Pool(args.workers) as pool:
        done = pool.map(work, jobs, chunksize=1)
    by_cell = collections.defaultdict(list)
    for kind, cell, seed, (a, b) in done:
        by_cell[kind, cell].append((seed, a, b))
    print(f"seeds {args.seeds}; per cell: the mean over them [each seed]")
    print("\ngrid (curve, text, rows): auto over plain | auto over the bar")
    plain_means, bar_means = {}, {}
    for (kind, cell), runs in by_cell.items():
        if kind != "grid":
            continue
        plain_means[cell] = statistics.fmean(a for _, a, _ in runs)
        bar_means[cell] = statistics.fmean(b for _, _, b in runs)
        each = " ".join(f"{a:.3f}" for _, a, _ in runs)
        bars = " ".join(f"{b:.3f}" for _, _, b in runs)
        print(f"  {' '.join(map(str, cell)):20s} {plain_means[cell]:.3f} [{each}] | "
              f"{bar_means[cell]:.3f} [{bars}]")  # fmt: skip
    lowest = min(a for (k, _), runs in by_cell.items() if k == "grid" for _, a, _ in runs)
    under = sum(v < 0.98 for v in plain_means.values())
    print(f"  over plain: lowest mean {min(plain_means.values()):.3f}, lowest seed {lowest:.3f}, "
          f"cells under 0.98 on the mean {under}")  # fmt: skip
    held = sum(v >= 0.98 for v in bar_means.values())
    print(f"  over the bar: lowest mean {min(bar_means.values()):.3f}, cells >= 0.98 on the mean "
          f"{held} of {len(bar_means)}")  # fmt: skip
    print("\nstep changes, auto over the new best 400 rounds on:")
    for change in STEPS:
        runs = by_cell["step", change]
        each = " ".join(f"{b:.3f}" for _, _, b in runs)
        print(f"  {' to '.join(change):20s} {statistics.fmean(b for _, _, b in runs):.3f} [{each}]")
    runs = by_cell["gpu", "gpu code 1"]
    each = " ".join(f"{a:.3f} ({d:.2f} drafted)" for _, a, d in runs)
    mean = statistics.fmean(a for _, a, _ in runs)
    print(f"\nGPU code, auto over the best plan known: {mean:.3f} [{each}]")


if __name__ == "__main__":
    main()
