"""The captured path's batch curve on one GPU, from the bench's two records (batch 1; 4, 16, 64).

Reads benchmarks/results/gpu-captured-b1 and gpu-captured-curve (`benchmarks/run_captured_gpu.sh`
steps b1 and curve), writes batch_curve.txt (tokens/s of plain decoding and of speculative
decoding at each k, sd over ar, what drafting auto planned there and the gain its prices
promised) and batch_curve.png beside this file.

    python benchmarks/studies/captured-gpu/batch_curve.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
RESULTS = HERE.parents[1] / "results"
RECORDS = ("gpu-captured-b1", "gpu-captured-curve")


def rows() -> tuple[dict, dict, dict]:
    """(tokens/s by (method, batch), sd over ar by (k, batch), auto's plan by batch)."""
    speed, over, plans = {}, {}, {}
    for name in RECORDS:
        record = json.loads((RESULTS / name / "record.json").read_text())
        for row in record["methods"]:
            key = (row["method"], row["batch_size"])
            speed[key] = row["tokens_per_s"]
            if "k" in row:
                over[(row["k"], row["batch_size"])] = row["speedup"]["geomean"]
        for plan in record["auto_plans"]:
            plans[plan["batch_size"]] = plan
    return speed, over, plans


def main() -> None:
    speed, over, plans = rows()
    batches = sorted({b for _, b in speed})
    ks = sorted({k for k, _ in over})
    lines = ["| rows | ar tok/s | " + " | ".join(f"sd k={k} / ar" for k in ks)
             + " | auto plans k | its prices' promise |",
             "|---|---|" + "---|" * len(ks) + "---|---|"]  # fmt: skip
    for b in batches:
        cells = [f"{over[(k, b)]:.2f}" if (k, b) in over else "-" for k in ks]
        plan = plans[b]
        lines.append(f"| {b} | {speed[('ar', b)]:.1f} | " + " | ".join(cells)
                     + f" | {'/'.join(map(str, plan['k']))} | {plan['gain']:.2f}x |")  # fmt: skip
    (HERE / "batch_curve.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(batches, [speed[("ar", b)] for b in batches], "o-", label="ar (captured)")
    for k in ks:
        pts = [(b, speed[(f"sd[k={k},a=0.8]", b)]) for b in batches
               if (f"sd[k={k},a=0.8]", b) in speed]  # fmt: skip
        left.plot(*zip(*pts, strict=True), "s--", color=f"C{k}", label=f"sd k={k}")
    left.set(xscale="log", yscale="log", xlabel="rows", ylabel="tokens/s",
             title="Qwen3-4B / 0.6B shapes, H100, bf16")  # fmt: skip
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend()
    for k in ks:
        pts = [(b, over[(k, b)]) for b in batches if (k, b) in over]
        right.plot(*zip(*pts, strict=True), "s--", color=f"C{k}", label=f"sd k={k}, measured")
    right.plot(batches, [plans[b]["gain"] for b in batches], "k^-", label="auto's promise")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="rows", ylabel="over plain decoding",
              title="acceptance 0.8: speculative over plain")  # fmt: skip
    right.set_xticks(batches, [str(b) for b in batches])
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "batch_curve.png", dpi=110)


if __name__ == "__main__":
    main()
