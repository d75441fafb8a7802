"""Where a plain decoding step's time goes on the default pair (llama.cpp, 2 threads, one row):
inside `llama_decode`, and outside it (the logits' copy, the checks, the argmax, the round's
bookkeeping), then the top functions outside by cProfile. Prints milliseconds per token.

    python benchmarks/studies/plain-path/profile_plain.py [--tokens 128]
"""

import argparse
import cProfile
import pstats
import time

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=128)
args = parser.parse_args()
decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", backend="llama.cpp", threads=2)
target = decoder.target_backend
inside = [0.0]
real = target._decode


def timed(count: int) -> None:
    start = time.perf_counter()
    real(count)
    inside[0] += time.perf_counter() - start


target._decode = timed
prompts = [decoder.encode(p.text)[0] for p in load_prompts("humaneval", limit=4)]


def run(prompt: list[int]) -> tuple[float, int]:
    loop = decoder.loop(max_rows=1, use_drafter=False)
    loop.add(RowRequest(prompt, args.tokens, stop_token_ids=()))
    loop.step()  # the prompt
    inside[0] = 0.0
    start, steps = time.perf_counter(), 0
    while len(loop):
        loop.step()
        steps += 1
    return time.perf_counter() - start, steps


run(prompts[0])  # warm-up
total = decode = 0.0
steps = 0
for p in prompts:
    wall, n = run(p)
    total, decode, steps = total + wall, decode + inside[0], steps + n
print(
    f"per token: {1e3 * total / steps:.2f} ms, of it in llama_decode {1e3 * decode / steps:.2f} "
    f"ms, outside {1e3 * (total - decode) / steps:.3f} ms ({steps} tokens)"
)
profile = cProfile.Profile()
profile.enable()
run(prompts[1])
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(14)
