"""Drafting `auto` with and without the standard library corpus, and drafting off, in one
process on the default pair (llama.cpp, 2 threads), interleaved, two passes each, every request
run to 64 tokens (no end id): HumanEval 0-15 through 8 rows (rows join as others end), HumanEval
0-7 and MT-Bench 81-84 one at a time. Prints decoding seconds (after each run's first round),
rounds and the drafting figures.

    python benchmarks/studies/corpus-drafts/in_process.py
"""

import collections
import time

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

decoder = SpeculativeDecoder.from_pretrained(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="llama.cpp", threads=2
)
decoder.use_corpus("stdlib")
stdlib = decoder.corpus
cells = {
    "humaneval, 8 rows": (load_prompts("humaneval", limit=16), 8),
    "humaneval, 1 row": (load_prompts("humaneval", limit=8), 1),
    "mtbench, 1 row": (load_prompts("mtbench", limit=4), 1),
}
modes = ["off", "auto", "auto + stdlib"]
for cell, (prompts, rows) in cells.items():
    ids = [decoder.encode(p.text)[0] for p in prompts]
    total: dict[str, float] = collections.defaultdict(float)
    for rep in range(2):
        for mode in modes if rep == 0 else modes[::-1]:
            decoder.use_corpus(stdlib if mode.endswith("stdlib") else None)
            kw = {"use_drafter": False} if mode == "off" else {"drafting": "auto"}
            loop = decoder.loop(max_rows=rows, prefill_chunk=256, **kw)
            for p in ids:
                loop.add(RowRequest(p, 64, stop_token_ids=()))
            loop.step()
            start, rounds = time.perf_counter(), 0
            while len(loop):
                loop.step()
                rounds += 1
            wall = time.perf_counter() - start
            total[mode] += wall
            figures = loop.stats.summary().split(";")[3].strip()
            print(f"{cell} | {rep} {mode}: {wall:.2f} s, {rounds} rounds, {figures}", flush=True)
    off = total["off"]
    ratios = ", ".join(f"{m} {off / total[m]:.3f}x" for m in modes[1:])
    print(f"{cell}: seconds {dict((k, round(v, 2)) for k, v in total.items())}; over off: {ratios}")
