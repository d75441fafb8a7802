"""Drafting `auto` on simulated machines: throughput over plain decoding and over the best fixed
draft length, by machine curve, text, noise and rows, for the plan judged by its prices alone
(the old watch: its rescales never changed a plan's ranking at a timed row count) and for the
plan judged by measured outcomes (`outcomes.Outcomes`).

    python benchmarks/studies/plan-simulator/grid.py [--rounds 1200] [--out grid.json]

Runs the project's loop, planner and judge over `tests/simulated_machine.py`, on one core, in
virtual time (a few minutes in all)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import simulated_machine as sm

FIXED = (1, 2, 4)  # the fixed draft lengths, with and without the drafter model
MACHINES = {
    **sm.CURVES,
    "xeon, drafter 0.05": sm.XEON.with_drafter(0.05),
    "xeon, drafter 0.8": sm.XEON.with_drafter(0.8),
    "gpu, drafter 0.7": sm.GPU.with_drafter(0.7),
}


def cell(curve, text, noise, rows, rounds, seed):
    weather = sm.Weather(noise=noise, drift=0.05 if noise else 0.0, stall_every=500 if noise else 0)
    common = dict(rows=rows, rounds=rounds, weather=weather, seed=seed)
    new = sm.run(curve, text, "auto", **common)
    old = sm.run(curve, text, "auto", judge=False, **common)
    plain = sm.run(curve, text, "plain", **common).throughput
    best = plain
    for with_model, k in itertools.product((True, False), FIXED):
        best = max(best, sm.run(curve, text, k, with_model=with_model, **common).throughput)
    return {
        "new": new.throughput / plain,
        "old": old.throughput / plain,
        "best_fixed": best / plain,
        "corrections": [
            (c.round, round(c.old, 3), round(c.new, 3)) for c in new.outcomes.corrections
        ],
        "explored": new.outcomes.explored,
        "drafted": new.drafted_rounds / new.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1200)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.3])
    parser.add_argument("--machines", nargs="+", default=list(MACHINES))
    parser.add_argument("--texts", nargs="+", default=list(sm.TEXTS))
    parser.add_argument("--out", default=str(Path(__file__).with_name("grid.json")))
    args = parser.parse_args()
    records = []
    start = time.time()
    for name, text, noise, rows in itertools.product(
        args.machines, args.texts, args.noise, args.rows
    ):
        r = cell(MACHINES[name], sm.TEXTS[text], noise, rows, args.rounds, seed=1)
        r.update(machine=name, text=text, noise=noise, rows=rows)
        records.append(r)
        print(
            f"{name:20s} {text:8s} noise {noise:.2f} rows {rows}: new {r['new']:.3f} "
            f"old {r['old']:.3f} best fixed {r['best_fixed']:.3f} "
            f"corrections {len(r['corrections'])} ({time.time() - start:.0f} s)",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
