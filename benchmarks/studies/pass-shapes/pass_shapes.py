"""What a llama.cpp pass of 8 rows costs by its shape: even passes (every row t tokens), ragged
ones (some rows one more), and 4 rows on scattered sequences of an 8-row context, with the
rows' move to sequences 0..n-1 (`LlamaCppModel._compact`) turned off so that llama.cpp's own
behaviour shows. The 1.5B default target, 2 threads, 256 tokens of context a row.

    python benchmarks/studies/pass-shapes/pass_shapes.py
"""

import time

import torch

from specdecode.backends.kernels import median_times
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.models.store import gguf_file

model = LlamaCppModel(gguf_file("qwen2.5-coder-1.5b"), context=2048, threads=2, max_rows=8)
model._compact = lambda: None  # the scattered shapes as llama.cpp runs them
context = [(1000 + i) % 150000 for i in range(256)]
start = torch.tensor([context] * 8)  # [8, 256]
model.reset(8)
model.forward(start, torch.ones_like(start, dtype=torch.bool))
held = model.lengths.clone()


def job(per_row: list[int]):
    """A pass where row b holds per_row[b] tokens (0: not in the pass)."""
    n = max(per_row)
    tokens = start[:, -n:]  # [8, n]
    valid = torch.zeros_like(tokens, dtype=torch.bool)  # [8, n] right-aligned
    for b, k in enumerate(per_row):
        if k:
            valid[b, n - k :] = True

    def run() -> None:
        model.forward(tokens, valid, logits_to_keep=n)
        model.truncate(held)

    return run


shapes = {
    "8 rows x 1": [1] * 8,
    "8 rows x 2": [2] * 8,
    "8 rows x 3": [3] * 8,
    "8 rows x 4": [4] * 8,
    "1 row 2, 7 rows 1": [2] + [1] * 7,
    "4 rows 2, 4 rows 1": [2] * 4 + [1] * 4,
    "6 rows 2, 2 rows 1": [2] * 6 + [1] * 2,
    "1 row 4, 7 rows 1": [4] + [1] * 7,
    "4 rows 3, 4 rows 2": [3] * 4 + [2] * 4,
    "4 rows x 1 on sequences 0-3": [1] * 4 + [0] * 4,
    "4 rows x 1 on sequences 4-7": [0] * 4 + [1] * 4,
    "4 rows x 1 on sequences 0, 2, 4, 6": [1, 0] * 4,
    "4 rows x 2 on sequences 0, 2, 4, 6": [2, 0] * 4,
    "4 rows x 2 on sequences 0-3": [2] * 4 + [0] * 4,
}
seconds = median_times({k: job(v) for k, v in shapes.items()}, 7, time.perf_counter)
base = seconds["8 rows x 1"]
print("| pass | ms | x 8 rows of 1 |\n|---|---|---|")
for name, s in seconds.items():
    print(f"| {name} | {s * 1e3:.1f} | {s / base:.2f} |")
