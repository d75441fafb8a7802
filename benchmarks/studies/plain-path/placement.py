"""Where a process's weights land moves its step: several copies of the default target's
weights, each read into its own 2 MiB pages (as our server holds them), beside one in
llama.cpp's file mapping (4 KiB pages, as llama-server holds them, the same page-cache pages
every time), one process. They take turns in a shuffled order, a prompt of 120 random ids then
30 one-token steps each, after a warm-up turn; what a copy gains over the file mapping, with
its standard error over the turns, says how far the page gain is a property of the pages a
load gets rather than of the machine. Run it several times: each process is a fresh draw of
pages.

    python benchmarks/studies/plain-path/placement.py [COPIES] [TURNS]
"""

from __future__ import annotations

import random
import statistics
import sys

import llama_cpp
from overhead import bare  # this script's folder is on the path when it runs

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.models.store import gguf_file

PROMPT, STEPS = 120, 30


def main() -> None:
    copies = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    turns = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    path = gguf_file("qwen2.5-coder-1.5b", progress=False)
    shape = {"context": 2048, "threads": 2, "max_rows": 8}
    models = {}
    for i in range(copies):
        models[f"2 MiB pages, copy {i + 1}"] = model = LlamaCppModel(
            path, role=f"copy{i + 1}", huge_pages=True, **shape
        )
        model.settle()
    models["file mapping"] = LlamaCppModel(path, role="file", huge_pages=False, **shape)
    batch = llama_cpp.llama_batch_init(PROMPT, 0, 1)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for turn in range(turns + 1):
        for name in random.sample(list(models), len(models)):
            value = bare(models[name], batch, PROMPT, STEPS)[1]
            if turn:
                seconds[name].append(value)
    base = seconds["file mapping"]
    for name, values in seconds.items():
        gains = [b / v for v, b in zip(values, base, strict=True)]
        error = statistics.stdev(gains) / len(gains) ** 0.5
        print(
            f"  {name:22s} {1e3 * statistics.mean(values):6.2f} ms a step, "
            f"{statistics.mean(gains):.4f}x the file mapping (+- {error:.4f})"
        )


if __name__ == "__main__":
    main()
