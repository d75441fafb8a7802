"""The plan on simulated machines, as a figure: throughput over plain decoding per machine curve
and text, the plan judged by its prices alone (old) and by measured outcomes (new), with the
best fixed draft length beside them. Reads grid.json (grid.py), writes grid.png.

    python benchmarks/studies/plan-simulator/plot.py"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
records = json.loads((here / "grid.json").read_text())
rows_seen = sorted({r["rows"] for r in records})
fig, axes = plt.subplots(len(rows_seen), 1, figsize=(14, 4.2 * len(rows_seen)), squeeze=False)
for ax, rows in zip(axes[:, 0], rows_seen, strict=True):
    cells = [r for r in records if r["rows"] == rows]
    labels = [f"{r['machine']}\n{r['text']}".replace(", ", "\n") for r in cells]
    x = range(len(cells))
    ax.bar([i - 0.2 for i in x], [r["old"] for r in cells], 0.4, label="prices alone (old)")
    ax.bar([i + 0.2 for i in x], [r["new"] for r in cells], 0.4, label="measured outcomes (new)")
    ax.scatter(x, [r["best_fixed"] for r in cells], color="black", marker="_", s=200, zorder=3,
               label="best of plain and fixed lengths")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.98, color="grey", lw=0.8, ls=":")
    ax.set_ylim(0.8, max(1.3, max(r["new"] for r in cells) + 0.1))
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("throughput / plain decoding")
    ax.set_title(f"{rows} row(s), noise +-30%, drift, stalls; rounds 200-1000")
    ax.legend(fontsize=8, loc="upper right")
fig.tight_layout()
fig.savefig(here / "grid.png", dpi=90)
