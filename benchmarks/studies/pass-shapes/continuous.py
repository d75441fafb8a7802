"""16 HumanEval prompts through 8 rows in process (rows join as others end, 64 tokens each, no
end token), drafting `auto` and off, each with and without the rows' move to the lowest
sequences (`LlamaCppModel._compact`), interleaved, two passes each. Prints decoding seconds
(after the first round), rounds, and the drafting figures.

    python benchmarks/studies/pass-shapes/continuous.py
"""

import collections
import time

from specdecode import SpeculativeDecoder
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", backend="llama.cpp", threads=2)
prompts = [decoder.encode(p.text)[0] for p in load_prompts("humaneval", limit=16)]
moving = LlamaCppModel._compact
total: dict[str, float] = collections.defaultdict(float)
order = ["off", "auto", "off, no move", "auto, no move"]
for rep in range(2):
    for mode in order if rep == 0 else order[::-1]:
        LlamaCppModel._compact = (lambda self: None) if "no move" in mode else moving
        kw = {"use_drafter": False} if mode.startswith("off") else {"drafting": "auto"}
        loop = decoder.loop(max_rows=8, prefill_chunk=256, **kw)
        for p in prompts:
            loop.add(RowRequest(p, 64, stop_token_ids=()))
        loop.step()
        start, rounds = time.perf_counter(), 0
        while len(loop):
            loop.step()
            rounds += 1
        wall = time.perf_counter() - start
        total[mode] += wall
        figures = loop.stats.summary().split(";")[3].strip()
        print(f"{rep} {mode}: {wall:.2f} s, {rounds} rounds, {figures}", flush=True)
print({k: round(v, 2) for k, v in total.items()})
