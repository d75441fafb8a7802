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

from test_plan_simulated import GRID, gpu_cell, grid_cell, step_cell

STEPS = [("xeon", "full-step"), ("full-step", "xeon")]  # dearer, cheaper


def work(job: tuple[str, object, int]) -> tuple[str, object, int, tuple[float, float]]:
    """One cell at one seed: the grid's (over plain, over the bar), a step change's share of
    the new best (twice), the GPU cell's (share of the best plan known, share drafted)."""
    kind, cell, seed = job
    if kind == "grid":
        return kind, cell, seed, grid_cell(cell, seed)
    if kind == "step":
        share = step_cell(cell, seed)
        return kind, cell, seed, (share, share)
    return kind, cell, seed, gpu_cell(seed)


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
