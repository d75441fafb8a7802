"""Pool per-prompt speed ratios of two methods over several bench records, with a paired interval.

Used for the pooled SpecDec++ figures in `docs/findings.md` (runs on disjoint prompts, same
settings): the ratio is the geometric mean of per-prompt time ratios, and the 95% interval
resamples prompts (bootstrap, 4,000 draws, seed 0).

    python benchmarks/studies/pooled-runs/pool_runs.py BASE METHOD RECORD_DIR [RECORD_DIR ...]
    python benchmarks/studies/pooled-runs/pool_runs.py "sd-int8[k=3]" \\
        "sd-int8[head-u t=0.9 1..12 priced]" \\
        benchmarks/results/specdecpp-mtbench-t07 benchmarks/results/specdecpp-mtbench-t07-97-112
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def per_prompt_seconds(record_dir: str, method: str) -> list[float]:
    record = json.loads((Path(record_dir) / "record.json").read_text())
    rows = {m["method"]: m for m in record["methods"]}
    if method not in rows:
        raise SystemExit(f"{record_dir} has no method {method!r}; it has {sorted(rows)}")
    return rows[method]["per_batch_seconds"]


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    base, method, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
    ratios = [
        b / m
        for d in dirs
        for b, m in zip(per_prompt_seconds(d, base), per_prompt_seconds(d, method), strict=True)
    ]
    logs = torch.tensor(ratios, dtype=torch.float64).log()
    pick = torch.randint(len(logs), (4000, len(logs)), generator=torch.Generator().manual_seed(0))
    low, high = torch.quantile(logs[pick].mean(1).exp(), torch.tensor([0.025, 0.975]).double())
    won = sum(r > 1 for r in ratios)
    print(
        f"{method} against {base} over {len(ratios)} prompts: {logs.mean().exp():.4f} "
        f"[{low:.4f}, {high:.4f}], faster on {won}"
    )


if __name__ == "__main__":
    main()
