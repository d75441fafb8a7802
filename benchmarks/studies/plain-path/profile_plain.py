"""Where a plain decoding step's time goes on the default pair (llama.cpp, 2 threads, one row):
inside `llama_decode`, and outside it (the logits' copy, the checks, the argmax, the round's
bookkeeping), then the top functions outside by cProfile. Prints milliseconds per token.

With `--floor`, instead: the engine's plain loop against the floor of any Python loop around
`llama_decode` (the batch's one entry written, the pass, an argmax over llama.cpp's own logits
row, no tensors), interleaved prompt by prompt, `--rounds` times over the prompts; both must
write the same tokens. What a leaner plain path could save outside the pass.

    python benchmarks/studies/plain-path/profile_plain.py [--tokens 128] [--floor [--rounds 2]]
"""

import argparse
import cProfile
import ctypes
import pstats
import time

import numpy as np
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--floor", action="store_true")
parser.add_argument("--rounds", type=int, default=2)
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


def engine(prompt: list[int]) -> tuple[list[int], float, float]:
    """The engine's plain loop: its tokens, seconds after the prompt, seconds in the passes."""
    loop = decoder.loop(max_rows=1, use_drafter=False)
    loop.add(RowRequest(prompt, args.tokens, stop_token_ids=()))
    tokens = list(next(u.tokens for u in loop.step()))  # the prompt, and the first token
    inside[0] = 0.0
    start = time.perf_counter()
    while len(loop):
        for update in loop.step():
            tokens += update.tokens
    return tokens, time.perf_counter() - start, inside[0]


def floor(prompt: list[int]) -> tuple[list[int], float, float]:
    """The least a Python loop does around each pass."""
    target.reset(1)
    ones = torch.ones(1, len(prompt), dtype=torch.bool)
    logits, _ = target.forward(torch.tensor([prompt]), ones)
    token, pos = int(logits[0, -1].argmax()), len(prompt)
    tokens = [token]
    lib, ctx, batch, seq = target.lib, target.ctx, target.batch, target.seq_ids[0]
    vocab = target.vocab_size
    inside[0] = 0.0
    start = time.perf_counter()
    while len(tokens) < args.tokens:
        batch.token[0], batch.pos[0], batch.n_seq_id[0] = token, pos, 1
        batch.seq_id[0][0], batch.logits[0] = seq, 1
        target._decode(1)
        address = ctypes.addressof(lib.llama_get_logits(ctx).contents)
        row = (ctypes.c_float * vocab).from_address(address)
        token, pos = int(np.frombuffer(row, dtype=np.float32).argmax()), pos + 1
        tokens.append(token)
    return tokens, time.perf_counter() - start, inside[0]


def report(name: str, wall: float, passes: float, steps: int) -> None:
    print(
        f"{name}per token {1e3 * wall / steps:.2f} ms, in llama_decode {1e3 * passes / steps:.2f}"
        f" ms, outside {1e3 * (wall - passes) / steps:.3f} ms ({steps} tokens)"
    )


loops = {"engine": engine, "floor": floor} if args.floor else {"engine": engine}
for run in loops.values():
    run(prompts[0])  # warm-up
sums = {name: [0.0, 0.0, 0] for name in loops}
for _ in range(args.rounds if args.floor else 1):
    for prompt in prompts:
        texts = []
        for name, run in loops.items():
            tokens, wall, passes = run(prompt)
            texts.append(tokens)
            sums[name][0] += wall
            sums[name][1] += passes
            sums[name][2] += len(tokens) - 1
        assert all(t == texts[0] for t in texts), "the loops wrote different tokens"
if args.floor:
    for name, (wall, passes, steps) in sums.items():
        report(f"{name}: ", wall, passes, steps)
else:
    report("", *sums["engine"])
    profile = cProfile.Profile()
    profile.enable()
    engine(prompts[1])
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
