"""Decoding of the default pair on three kernel plans, in place: the same model objects, their
packed modules' row numbers switched between runs, prompt by prompt, rotating the order, the
fastest of the repeats kept.

- `from 2 rows`: one-row products on MKL, every larger one packed (the first engine);
- `from 1 row`: every product packed, none padded (the one-row switch used before 2026-11-24);
- `timed plans`: what `prepack_linears` now picks per weight shape at load, the zero-row padding
  of short products included (`kernels.row_plan`).

Plain greedy decoding (the baseline of every speedup) and speculative decoding with the int8
drafter at k = 2 (verify passes of 3 positions) are both timed; the tokens must not change.

    python benchmarks/studies/kernel-rows-causal/kernel_rows_causal.py [N_PROMPTS] [NEW_TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.kernels import PrepackedLinear, kernel_summary
from specdecode.prompts import load_prompts

REPEATS = 2
METHODS = {"plain": {"use_drafter": False}, "sd-int8 k=2": {"num_draft_tokens": 2}}


def speed_ratio(slow: list[float], fast: list[float]) -> float:
    """How many times the speed of `slow` `fast` runs: geometric mean over prompts."""
    return statistics.geometric_mean([a / b for a, b in zip(slow, fast, strict=True)])


def main(n: int, new_tokens: int) -> None:
    torch.set_num_threads(2)
    decoder = SpeculativeDecoder.from_pretrained(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", prepack=True, drafter_int8=True, backend="torch"
    )
    packed = [m for m in decoder.target.modules() if isinstance(m, PrepackedLinear)]
    timed = [(m.min_rows, m.pad_to) for m in packed]
    chosen = kernel_summary(decoder.target)["row_plans"]  # before any switching
    plans = {
        "from 2 rows": [(2, ())] * len(packed),
        "from 1 row": [(1, ())] * len(packed),
        "timed plans": timed,
    }
    prompts = [p.text for p in load_prompts("humaneval", limit=n)]

    def run(plan: str, method: str, prompt: str) -> tuple[float, list[int]]:
        for module, (min_rows, pad_to) in zip(packed, plans[plan], strict=True):
            module.min_rows, module.pad_to = min_rows, pad_to
        start = time.perf_counter()
        out = decoder.generate([prompt], max_new_tokens=new_tokens, **METHODS[method])
        return time.perf_counter() - start, out.new_tokens[0]

    names = list(plans)
    for plan in names:  # warm-up
        for method in METHODS:
            run(plan, method, prompts[0][:200])
    best = {(p, m): [float("inf")] * n for p in names for m in METHODS}
    tokens = {(p, m): [None] * n for p in names for m in METHODS}
    for i, prompt in enumerate(prompts):
        for r in range(REPEATS):
            shift = (i * REPEATS + r) % len(names)
            for plan in names[shift:] + names[:shift]:
                for method in METHODS:
                    seconds, ids = run(plan, method, prompt)
                    best[plan, method][i] = min(best[plan, method][i], seconds)
                    tokens[plan, method][i] = ids
    print(
        f"qwen2.5-coder-1.5b (int8 qwen2.5-coder-0.5b drafting), greedy, {n} HumanEval prompts, "
        f"{new_tokens} new tokens, fastest of {REPEATS} interleaved repeats"
    )
    print(f"timed plans [min_rows, pad_to] by weight shape: {chosen}")
    reference = tokens["timed plans", "plain"]
    for method in METHODS:
        count = sum(len(t) for t in tokens["timed plans", method])
        for plan in names:
            same = sum(a == b for a, b in zip(tokens[plan, method], reference, strict=True))
            ratio = speed_ratio(best[plan, method], best["timed plans", method])
            print(
                f"{method:12s} {plan:12s}: {1000 * sum(best[plan, method]) / count:6.1f} ms per "
                f"token; timed plans {ratio:.3f}x its speed; tokens as timed-plan plain decoding "
                f"on {same}/{n} prompts"
            )
    ar = speed_ratio(best["timed plans", "plain"], best["timed plans", "sd-int8 k=2"])
    print(f"sd-int8 k=2 against plain decoding, both on timed plans: {ar:.3f}x")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3])) if len(sys.argv) > 1 else main(4, 48)
