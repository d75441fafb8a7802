"""How much of a plain token's time outside `llama_decode` a leaner path could save: the engine's
plain loop (one row, the general speculative step) against the floor of any Python loop around
`llama_decode` (the batch's one entry written, the pass, an argmax over llama.cpp's own logits
row, no tensors), interleaved prompt by prompt on the default target (llama.cpp, 2 threads).
Both must write the same tokens. Prints milliseconds per token, in and outside the pass.

    python benchmarks/studies/plain-path/plain_floor.py [--tokens 128] [--rounds 2]
"""

import argparse
import ctypes
import time

import numpy as np
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=128)
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
    logits, _ = target.forward(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool))
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
        row = (ctypes.c_float * vocab).from_address(
            ctypes.addressof(lib.llama_get_logits(ctx).contents)
        )
        token, pos = int(np.frombuffer(row, dtype=np.float32).argmax()), pos + 1
        tokens.append(token)
    return tokens, time.perf_counter() - start, inside[0]


engine(prompts[0])  # warm-up
floor(prompts[0])
sums = {"engine": [0.0, 0.0, 0], "floor": [0.0, 0.0, 0]}
for _ in range(args.rounds):
    for prompt in prompts:
        texts = {}
        for name, run in (("engine", engine), ("floor", floor)):
            tokens, wall, passes = run(prompt)
            texts[name] = tokens
            sums[name][0] += wall
            sums[name][1] += passes
            sums[name][2] += len(tokens) - 1
        assert texts["engine"] == texts["floor"], "the two loops wrote different tokens"
for name, (wall, passes, steps) in sums.items():
    print(
        f"{name}: per token {1e3 * wall / steps:.2f} ms, in llama_decode {1e3 * passes / steps:.2f}"
        f" ms, outside {1e3 * (wall - passes) / steps:.3f} ms ({steps} tokens)"
    )
