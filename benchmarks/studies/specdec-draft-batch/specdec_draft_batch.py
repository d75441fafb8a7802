"""Throughput of `translate` on the whole test split at batch 32: plain decoding, SpecDec
drafting every round, and SpecDec drafting only while at most N rows of a batch are running
(`max_draft_batch`, the plain steps of a full batch being cheaper than verify passes there).

Also the batch-size sweep behind the command's default: exact SpecDec against plain decoding
at batch 1 to 32 on the first 128 test verses. Shipped pair, packed kernels, int8 drafter (the
command's defaults); methods interleaved, fastest of two repeats; outputs checked identical.

Last, the same batch-32 run with the batches formed from sources of similar length (the
default of `translate` since): plain decoding and SpecDec's default against plain decoding of
unsorted batches. The first two parts run unsorted, as they were recorded.

    python benchmarks/studies/specdec-draft-batch/specdec_draft_batch.py [--verses N]
        [--parts sweep batch32 sorted]
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.cli.seq2seq import SHIPPED_PAIR
from specdecode.seq2seq.api import TranslationPair
from specdecode.seq2seq.corpus import read_split


def fastest(pair, sources, repeats, methods) -> dict[str, tuple[float, list[list[int]]]]:
    """Sentences per second of each method (fastest repeat) and its token ids."""
    best: dict[str, tuple[float, list[list[int]]]] = {}
    for _ in range(repeats):
        for name, kwargs in methods.items():
            t0 = time.perf_counter()
            out = pair.translate(sources, max_new_tokens=200, **kwargs)
            rate = len(sources) / (time.perf_counter() - t0)
            if name not in best or rate > best[name][0]:
                best[name] = (rate, out.token_ids)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verses", type=int, default=None, help="default: all test verses")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--parts", nargs="+", choices=("sweep", "batch32", "sorted"),
        default=["sweep", "batch32", "sorted"],
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = TranslationPair.from_dir(SHIPPED_PAIR, prepack=True, drafter_int8=True)
    verses = read_split("test")
    pair.translate([v.src for v in verses[:16]], batch_size=8)  # warm-up
    pair.translate([v.src for v in verses[:16]], batch_size=8, use_drafter=False)

    sweep = [v.src for v in verses[:128]]
    if "sweep" in args.parts:
        print(f"exact SpecDec against plain decoding by batch size, first {len(sweep)} verses:")
    for batch in (1, 2, 4, 8, 16, 32) if "sweep" in args.parts else ():
        methods = {"ar": dict(use_drafter=False, batch_size=batch, sort_by_length=False)}
        methods |= {
            f"k={k}": dict(block_size=k, batch_size=batch, max_draft_batch=None,
                           sort_by_length=False)
            for k in (2, 3, 4)
        }  # fmt: skip
        best = fastest(pair, sweep if batch > 1 else sweep[:32], args.repeats, methods)
        ar = best["ar"][0]
        ratios = "  ".join(f"{n} {rate / ar:.2f}x" for n, (rate, _) in best.items() if n != "ar")
        same = all(ids == best["ar"][1] for _, ids in best.values())
        print(f"  batch {batch:2d}: ar {ar:6.1f} sent/s  {ratios}  identical {same}")

    sources = [v.src for v in verses[: args.verses]]
    if "batch32" in args.parts:
        methods = {"ar": dict(use_drafter=False)}
        for k in (2, 4):
            methods[f"specdec k={k}, every round"] = dict(block_size=k, max_draft_batch=None)
            for n in (2, 4, 8):
                methods[f"specdec k={k}, max_draft_batch={n}"] = dict(
                    block_size=k, max_draft_batch=n
                )
        for kwargs in methods.values():
            kwargs.update(batch_size=32, sort_by_length=False)
        report(f"batch 32, {len(sources)} test verses", fastest(pair, sources, args.repeats,
                                                                 methods))  # fmt: skip
    if "sorted" in args.parts:
        methods = {
            "ar, unsorted batches": dict(use_drafter=False, sort_by_length=False),
            "ar, sorted batches": dict(use_drafter=False),
            "specdec default (k=4, auto), sorted": {},
            "specdec default (k=4, auto), unsorted": dict(sort_by_length=False),
        }
        for kwargs in methods.values():
            kwargs.update(batch_size=32)
        report(f"batch 32, {len(sources)} test verses, batches by source length",
               fastest(pair, sources, args.repeats, methods))  # fmt: skip


def report(title: str, best: dict[str, tuple[float, list[list[int]]]]) -> None:
    """Each method against the first, with how many outputs equal the first's."""
    ar_rate, ar_ids = next(iter(best.values()))
    print(f"\n{title}:")
    for name, (rate, ids) in best.items():
        same = sum(a == b for a, b in zip(ids, ar_ids, strict=True))
        print(f"  {name:34s} {rate:6.1f} sent/s  {rate / ar_rate:.2f}x ar  identical "
              f"{same}/{len(ids)}")  # fmt: skip


if __name__ == "__main__":
    main()
