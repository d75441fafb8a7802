"""Plain decoding of the default target with one-row products on MKL (the engine's switch at 2
rows) or on the packed copy (switch at 1 row), in place: the same model object, its
`PrepackedLinear` switches flipped between runs, prompt by prompt, alternating the order, the
fastest of the repeats kept. The seq2seq pair's plain decoding ran 1.21x faster packed from one
row (`specdec_kernel_rows.py`); this checks the causal engine's baseline the same way.

    python benchmarks/kernel_rows_causal.py [N_PROMPTS] [NEW_TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.kernels import PrepackedLinear
from specdecode.prompts import load_prompts

REPEATS = 2


def main(n: int, new_tokens: int) -> None:
    torch.set_num_threads(2)
    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", prepack=True)
    packed = [m for m in decoder.target.modules() if isinstance(m, PrepackedLinear)]
    prompts = [p.text for p in load_prompts("humaneval", limit=n)]

    def run(rows: int, prompt: str) -> tuple[float, list[int]]:
        for module in packed:
            module.min_rows = rows
        start = time.perf_counter()
        out = decoder.generate([prompt], max_new_tokens=new_tokens, use_drafter=False)
        return time.perf_counter() - start, out.new_tokens[0]

    run(2, prompts[0][:200])  # warm-up
    run(1, prompts[0][:200])
    best = {rows: [float("inf")] * n for rows in (2, 1)}
    tokens = {rows: [None] * n for rows in (2, 1)}
    for i, prompt in enumerate(prompts):
        for r in range(REPEATS):
            for rows in (2, 1) if (i + r) % 2 == 0 else (1, 2):
                seconds, ids = run(rows, prompt)
                best[rows][i] = min(best[rows][i], seconds)
                tokens[rows][i] = ids
    count = sum(len(t) for t in tokens[2])
    same = sum(a == b for a, b in zip(tokens[2], tokens[1], strict=True))
    ratio = statistics.geometric_mean([a / b for a, b in zip(best[2], best[1], strict=True)])
    print(
        f"qwen2.5-coder-1.5b, plain greedy decoding, {n} HumanEval prompts, {new_tokens} new "
        f"tokens, fastest of {REPEATS} interleaved repeats; same tokens on {same}/{n} prompts"
    )
    for rows in (2, 1):
        print(f"packed from {rows} rows: {1000 * sum(best[rows]) / count:.1f} ms per token")
    print(f"packed from 1 row against 2: {ratio:.3f}x the speed (geometric mean over prompts)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3])) if len(sys.argv) > 1 else main(4, 48)
