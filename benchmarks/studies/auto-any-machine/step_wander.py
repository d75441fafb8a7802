"""How a plain step's time wanders on this machine: one process decodes MT-Bench 81-88 at one
row, 64 tokens each, `--passes` times over, drafting off, and prints the mean step of each
second (prefill rounds left out), then the autocorrelation of those means at lags of 1 to 20
seconds and their spread. Why: a comparison of two modes run a pass apart (about 20 s) is only
as good as the machine is steady over that time; where it wanders for tens of seconds, modes
must take turns far more finely (`in_process.py` runs them round by round).

    python benchmarks/studies/auto-any-machine/step_wander.py [--passes 3]
"""

import argparse
import statistics
import time

import numpy as np

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--passes", type=int, default=3)
args = parser.parse_args()
decoder = SpeculativeDecoder.from_pretrained(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="llama.cpp", threads=2
)
decoder.settle()
ids = [decoder.encode(p.text)[0] for p in load_prompts("mtbench", limit=8)]
steps: list[tuple[float, float]] = []  # (seconds since the start, the step's seconds)
zero = time.perf_counter()
for _ in range(args.passes):
    loop = decoder.loop(max_rows=1, prefill_chunk=256, use_drafter=False)
    for p in ids:
        loop.add(RowRequest(p, 64, stop_token_ids=()))
    while len(loop):
        start = time.perf_counter()
        loop.step()
        if loop.decoding:  # the round fed no prompt
            steps.append((start - zero, time.perf_counter() - start))
seconds: dict[int, list[float]] = {}
for at, took in steps:
    seconds.setdefault(int(at), []).append(took)
means = np.array([1e3 * statistics.fmean(v) for _, v in sorted(seconds.items())])
print("mean step of each second, ms:", " ".join(f"{m:.0f}" for m in means))
centred = means - means.mean()
for lag in (1, 2, 5, 10, 20):
    if lag < len(means) - 2:
        r = float(np.corrcoef(centred[:-lag], centred[lag:])[0, 1])
        print(f"autocorrelation at {lag} s: {r:.2f}")
print(f"spread of the means: {100 * means.std() / means.mean():.1f}% of {means.mean():.1f} ms")
