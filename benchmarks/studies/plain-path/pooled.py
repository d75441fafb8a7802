"""Plain decoding served, pooled over several starts of both servers: each start's records
(`SERVING_PLAN=plain-check benchmarks/run_serving_cpu.sh`, start-N/{code,chat}/record.json)
give a ratio of our server's tokens/s over the peer's, pass by pass (the two take turns wave by
wave, so a pass of one and the same pass of the other met the same machine); the pooled ratio
is every pass's tokens over every pass's time. A start is a draw of where each process's
weights land, which moves a step by a per cent or more, so the starts' spread, not the passes',
says how far one start's figure generalises.

    python benchmarks/studies/plain-path/pooled.py START_DIR...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CELLS = ("code", "chat")


def passes(record: dict) -> dict[str, dict[int, tuple[int, float]]]:
    """(tokens, seconds) by server label and pass."""
    out: dict[str, dict[int, tuple[int, float]]] = {}
    for p in record["passes"]:
        tokens = sum(r["completion_tokens"] for r in p["requests"] if "error" not in r)
        out.setdefault(p["server"], {})[p["repeat"]] = (tokens, p["wall_s"])
    return out


def rate(values: list[tuple[int, float]]) -> float:
    return sum(t for t, _ in values) / sum(s for _, s in values)


def main(dirs: list[Path]) -> None:
    print("# Plain decoding served: ours --no-draft over llama-server, one request, pooled\n")
    print("Ratio of output tokens/s, ours over the peer: by start (its passes pooled; pass by")
    print("pass in the last column) and over all starts. A start's time is its cell's first pass")
    print("(UTC).\n")
    print("| cell | start | ours tok/s | peer tok/s | ratio | passes |")
    print("|---|---|---|---|---|---|")
    for cell in CELLS:
        pooled: dict[str, list[tuple[int, float]]] = {}
        by_start = []
        for d in dirs:
            file = d / cell / "record.json"
            if not file.is_file():
                continue
            record = json.loads(file.read_text())
            ours, peer = (s["label"] for s in record["servers"][:2])
            runs = passes(record)
            pairs = sorted(set(runs[ours]) & set(runs[peer]))
            each = [rate([runs[ours][i]]) / rate([runs[peer][i]]) for i in pairs]
            a, b = rate([runs[ours][i] for i in pairs]), rate([runs[peer][i] for i in pairs])
            by_start.append(a / b)
            pooled.setdefault("ours", []).extend(runs[ours][i] for i in pairs)
            pooled.setdefault("peer", []).extend(runs[peer][i] for i in pairs)
            print(
                f"| {cell} | {d.name}, {record['started'][11:16]} | {a:.2f} | {b:.2f} | "
                f"**{a / b:.3f}x** | "
                f"{', '.join(f'{x:.3f}' for x in each)} |"
            )
        if not by_start:
            continue
        a, b = rate(pooled["ours"]), rate(pooled["peer"])
        spread = f"{min(by_start):.3f}-{max(by_start):.3f}"
        print(
            f"| {cell} | all ({len(by_start)} starts, {len(pooled['ours'])} passes) | {a:.2f} | "
            f"{b:.2f} | **{a / b:.3f}x** | starts {spread}, "
            f"mean {statistics.mean(by_start):.3f} |"
        )


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
