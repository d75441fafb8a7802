"""Time to the first answer: `specdecode generate` of 16 tokens against llama-cpp-python doing
the same, each a fresh process on a warm cache (weights, tokenizer, prices and the 2 MiB pages
verdict already kept), interleaved A B A B after one untimed run of each, and the stages of
ours as `generate --timings` says them in each run (arguments, imports, model files, tokenizer,
weights, corpus, prices, decoding); what the stages leave of the wall time is the interpreter's
start, the command line's own imports and the exit.

    python benchmarks/studies/first-answer/first_answer.py --out benchmarks/results/first-answer
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "def f(x):"
TOKENS = 16

OURS = [sys.executable, "-m", "specdecode.cli", "generate", "--prompt", PROMPT,
        "--max-new-tokens", str(TOKENS), "--timings"]  # fmt: skip

PEER = f"""
import llama_cpp
from specdecode.models.store import gguf_file
llm = llama_cpp.Llama(str(gguf_file("qwen2.5-coder-1.5b", progress=False)), n_ctx=4096,
                      n_threads=2, verbose=False)
print(llm({PROMPT!r}, max_tokens={TOKENS}, temperature=0.0)["choices"][0]["text"])
"""


def wall(command: list[str], stages: list[dict[str, float]] | None = None) -> float:
    """Seconds of `command` in a fresh process; where `stages` is given, the stages its
    `[timings]` line says are appended to it."""
    start = time.perf_counter()
    run = subprocess.run(command, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if stages is not None:
        line = next(x for x in run.stderr.splitlines() if x.startswith("[timings] "))
        parts = line.removeprefix("[timings] ").split(";")[0].split(", ")
        stages.append({p.rsplit(" ", 2)[0]: float(p.rsplit(" ", 2)[1]) for p in parts})
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    peer = [sys.executable, "-c", PEER]
    wall(OURS), wall(peer)  # warm: the page cache, the kept prices and verdicts
    ours_s, peer_s, runs = [], [], []
    for _ in range(args.repeats):
        ours_s.append(wall(OURS, runs))
        peer_s.append(wall(peer))
    stages = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratio = statistics.median(ours_s) / statistics.median(peer_s)
    record = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": sys.version},
        "prompt": PROMPT,
        "max_new_tokens": TOKENS,
        "ours_wall_s": ours_s,
        "llama_cpp_python_wall_s": peer_s,
        "ratio_median": ratio,
        "ours_stages_median_s": stages,
        "ours_stages_s": runs,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    said = ", ".join(f"{k} {v:.2f} s" for k, v in stages.items())
    rest = statistics.median(ours_s) - sum(stages.values())
    table = (
        f"# Time to the first answer ({record['date']})\n\n"
        f"`specdecode generate --prompt {PROMPT!r} --max-new-tokens {TOKENS}` against "
        "llama-cpp-python generating the same, each a fresh process on a warm cache, "
        f"interleaved, {args.repeats} runs each.\n\n"
        "| | median wall s | runs |\n|---|---|---|\n"
        f"| specdecode generate | {statistics.median(ours_s):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in ours_s)} |\n"
        f"| llama-cpp-python | {statistics.median(peer_s):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in peer_s)} |\n\n"
        f"Ratio {ratio:.2f}x. Ours by stage (`--timings`, medians of the runs): {said}; the "
        f"interpreter's start, the command line's imports and the exit {rest:.2f} s.\n"
    )
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
