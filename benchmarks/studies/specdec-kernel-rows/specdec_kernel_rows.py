"""Is plain decoding's one-row product faster on MKL or on the packed copy, in place? And what
is SpecDec's speedup against the faster plain decoding?

`TranslationPair.prepack(min_rows)` packs the verifier's linears for products of `min_rows` rows
or more; one-row products (every step of plain decoding) stay on MKL with the engine's default
of 2. Isolated timings of single products favoured MKL for the 256-wide projections, so that
default was kept. This measures the whole decode instead: the shipped pair at batch 1 on the
first N test verses, plain greedy decoding and exact SpecDec (int8 drafter, k = 4), each with the
verifier packed from 2 rows and from 1 row, interleaved verse by verse, the fastest of 2 repeats.

    python benchmarks/studies/specdec-kernel-rows/specdec_kernel_rows.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specdecode.cli.seq2seq import SHIPPED_PAIR
from specdecode.seq2seq.api import TranslationPair
from specdecode.seq2seq.corpus import read_split

K, REPEATS, CAP = 4, 2, 100


def main(n: int) -> None:
    torch.set_num_threads(2)
    sources = [v.src for v in read_split("test")[:n]]
    int8 = TranslationPair.from_dir(SHIPPED_PAIR).drafter.int8()
    pairs = {
        rows: TranslationPair.from_dir(SHIPPED_PAIR).with_drafter(int8).prepack(rows)
        for rows in (2, 1)
    }
    methods = {  # label: (pair, use_drafter)
        f"{kind}, packed from {rows} rows": (pairs[rows], kind == "specdec")
        for rows in (2, 1)
        for kind in ("ar", "specdec")
    }

    def run(label: str, source: str) -> tuple[float, list[int], int]:
        pair, drafting = methods[label]
        start = time.perf_counter()
        out = pair.translate([source], block_size=K, use_drafter=drafting, batch_size=1,
                             max_new_tokens=CAP)  # fmt: skip
        return time.perf_counter() - start, out.token_ids[0], out.stats.total.target_calls

    for label in methods:  # warm-up
        run(label, sources[0])
    best = {label: [float("inf")] * n for label in methods}
    ids: dict[str, list] = {label: [None] * n for label in methods}
    calls = dict.fromkeys(methods, 0)
    for i, source in enumerate(sources):
        for r in range(REPEATS):
            order = list(methods)[i % len(methods) :] + list(methods)[: i % len(methods)]
            for label in order if r % 2 == 0 else order[::-1]:
                seconds, tokens, forwards = run(label, source)
                best[label][i] = min(best[label][i], seconds)
                ids[label][i] = tokens
                calls[label] += forwards if r == 0 else 0
    tokens = sum(len(t) + 1 for t in ids["ar, packed from 2 rows"])
    print(f"{n} test verses, batch 1, fastest of {REPEATS} interleaved repeats, {tokens} tokens")
    for label in methods:
        same = sum(a == b for a, b in zip(ids[label], ids["ar, packed from 2 rows"], strict=True))
        against = {
            base: statistics.geometric_mean(
                [b / t for b, t in zip(best[base], best[label], strict=True)]
            )
            for base in ("ar, packed from 2 rows", "ar, packed from 1 rows")
        }
        print(
            f"{label:26s} {1000 * sum(best[label]) / tokens:5.2f} ms per token, "
            f"{tokens / calls[label]:.2f} tokens per verifier call; speed vs ar packed from 2 "
            f"rows {against['ar, packed from 2 rows']:.3f}x, vs ar packed from 1 row "
            f"{against['ar, packed from 1 rows']:.3f}x; identical to ar: {same}/{n}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
