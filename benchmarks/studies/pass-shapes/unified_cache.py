"""What a llama.cpp pass of 8 rows costs with one cache stream per row (as `LlamaCppModel` runs
several rows) against one unified cache for all rows, each with flash attention off and on,
at a given context a row: even passes, and ragged ones (some rows drafting, the others not).
The 1.5B default target, 2 threads; every row holds CONTEXT tokens before the timed passes.

    python benchmarks/studies/pass-shapes/unified_cache.py 256
    python benchmarks/studies/pass-shapes/unified_cache.py 1024
"""

import sys
import time

import torch

from specdecode.backends.kernels import median_times
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.models.store import gguf_file

CONTEXT = int(sys.argv[1])


class Settings:
    """llama.cpp's functions, with a context made unified or not, flash attention on or off."""

    def __init__(self, lib, unified: bool, flash: int) -> None:
        self.lib, self.unified, self.flash = lib, unified, flash

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def llama_init_from_model(self, model, params):
        params.kv_unified, params.flash_attn_type = self.unified, self.flash
        return self.lib.llama_init_from_model(model, params)


def make(unified: bool, flash: int) -> LlamaCppModel:
    model = LlamaCppModel(gguf_file("qwen2.5-coder-1.5b"), context=2048, threads=2, max_rows=8)
    model.lib = Settings(model.lib, unified, flash)
    model._new_context(8)
    return model


context = [(1000 + i) % 150000 for i in range(CONTEXT)]
start = torch.tensor([context] * 8)  # [8, CONTEXT]
settings = {
    "streams, flash auto": (False, -1),
    "streams, flash off": (False, 0),
    "unified, flash off": (True, 0),
    "unified, flash on": (True, 1),
}
models = {name: make(*s) for name, s in settings.items()}
held = {}
for name, model in models.items():
    model.reset(8)
    for i in range(0, CONTEXT, 256):
        piece = start[:, i : i + 256]
        model.forward(piece, torch.ones_like(piece, dtype=torch.bool))
    held[name] = model.lengths.clone()


def job(name: str, per_row: list[int]):
    """A pass where row b holds per_row[b] tokens."""
    model, n = models[name], max(per_row)
    tokens = start[:, -n:]  # [8, n]
    valid = torch.zeros_like(tokens, dtype=torch.bool)  # [8, n] right-aligned
    for b, k in enumerate(per_row):
        valid[b, n - k :] = True

    def run() -> None:
        model.forward(tokens, valid, logits_to_keep=n)
        model.truncate(held[name])

    return run


shapes = {
    "8 rows x 1": [1] * 8,
    "8 rows x 2": [2] * 8,
    "1 row 4, 7 rows 1": [4] + [1] * 7,
    "4 rows 3, 4 rows 1": [3] * 4 + [1] * 4,
}
seconds = median_times(
    {(s, name): job(name, v) for s, v in shapes.items() for name in models}, 5, time.perf_counter
)
print(f"{CONTEXT} tokens a row; ms (x the same cache's 8 rows x 1)\n")
print("| pass | " + " | ".join(models) + " |")
print("|---" * (len(models) + 1) + "|")
for s in shapes:
    cells = [
        f"{seconds[s, n] * 1000:.0f} ({seconds[s, n] / seconds['8 rows x 1', n]:.2f})"
        for n in models
    ]
    print(f"| {s} | " + " | ".join(cells) + " |")
