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
import re
import statistics
import sys
from pathlib import Path

CELLS = ("code", "chat")


def figures(record: dict) -> dict[str, dict]:
    """bench-serve's own figures of the record's one cell, by server label: its completion
    tokens and wall seconds over the measured passes, and each pass's tokens/s."""
    return {cell["server"]: cell for cell in record["cells"]}


def in_order(dirs: list[Path]) -> list[Path]:
    """The start folders by their number (a shell's glob puts start-10 before start-2)."""
    return sorted(
        dirs, key=lambda d: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", d.name)]
    )


def main(dirs: list[Path]) -> None:
    dirs = in_order(dirs)
    print("# Plain decoding served: ours --no-draft over llama-server, one request, pooled\n")
    print("Ratio of output tokens/s, ours over the peer: by start (its passes pooled; pass by")
    print("pass in the last column) and over all starts. A start's time is its cell's first pass")
    print("(UTC).\n")
    print("| cell | start | ours tok/s | peer tok/s | ratio | passes |")
    print("|---|---|---|---|---|---|")
    for cell in CELLS:
        tokens = {"ours": 0, "peer": 0}
        seconds = {"ours": 0.0, "peer": 0.0}
        by_start, passes = [], 0
        for d in dirs:
            file = d / cell / "record.json"
            if not file.is_file():
                continue
            record = json.loads(file.read_text())
            cells = figures(record)
            ours, peer = (cells[s["label"]] for s in record["servers"][:2])
            for side, figure in (("ours", ours), ("peer", peer)):
                tokens[side] += figure["completion_tokens"]
                seconds[side] += figure["wall_s"]
            a, b = ours["output_tok_per_s"], peer["output_tok_per_s"]
            pairs = zip(ours["pass_tok_per_s"], peer["pass_tok_per_s"], strict=True)
            each = [x / y for x, y in pairs]
            by_start.append(a / b)
            passes += len(each)
            print(
                f"| {cell} | {d.name}, {record['started'][11:16]} | {a:.2f} | {b:.2f} | "
                f"**{a / b:.3f}x** | {', '.join(f'{x:.3f}' for x in each)} |"
            )
        if not by_start:
            continue
        a, b = (tokens[side] / seconds[side] for side in ("ours", "peer"))
        spread = f"{min(by_start):.3f}-{max(by_start):.3f}"
        print(
            f"| {cell} | all ({len(by_start)} starts, {passes} passes) | {a:.2f} | {b:.2f} | "
            f"**{a / b:.3f}x** | starts {spread}, mean {statistics.mean(by_start):.3f} |"
        )


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
