"""What turning a row's tokens into text costs the server per round, at the start of a
4,000-token answer and at its end: decoding the whole row every round (the server's way before
`serve/text.py` decoded a window) against the incremental `RowText`.

The answer is 4,000 tokens of Qwen2.5-Coder's tokenizer (read from the model store) over Python
source with some non-ASCII text, committed 4 tokens a round (3 drafted and accepted plus the
target's), with one stop string that never appears, as a request with `stop` has. Both ways
must give the same text. Prints microseconds per round: the median of the first and of the last
100 rounds over the best of a few passes, and each way's total.

    python benchmarks/studies/detokenize/bench_detokenize.py [--tokens 4000] [--round 4]
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import statistics
import time

from specdecode.models.cache import ModelCache
from specdecode.models.tokenizer import SavedTokenizer
from specdecode.serve.text import REPLACEMENT, RowText, longest_partial_stop

STOPS = ("\n\n\n\n\n",)
EDGE = 100  # rounds measured at each end


class WholeRowText:
    """The way before: each round decodes the row's every token and sends the new suffix,
    holding back a trailing U+FFFD and a stop string's possible start."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.emitted = ""

    def feed(self, tokens: list[int], final: bool = False) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(
            self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        start = max(0, len(self.emitted) - max(len(s) for s in self.stops))
        if any(text.find(s, start) >= 0 for s in self.stops):
            raise AssertionError("the stop string is not in this answer")
        if not final:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - longest_partial_stop(text, self.stops)]
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece


def answer(tokenizer, count: int) -> list[int]:
    """`count` tokens of this machine's standard library source, with other scripts mixed in."""
    source = inspect.getsource(inspect) + inspect.getsource(argparse)
    lines = source.splitlines(keepends=True)
    for i in range(0, len(lines), 25):  # a comment in other scripts every 25 lines
        lines[i] += "    # naïve café — 日本語のコメント 😀 Ελληνικά\n"
    ids = tokenizer("".join(lines), add_special_tokens=False).input_ids
    assert len(ids) >= count, f"the text is only {len(ids)} tokens"
    return ids[:count]


def run(make, ids: list[int], size: int) -> tuple[list[float], str]:
    """Microseconds of each round, and the text."""
    row = make()
    times, pieces = [], []
    for i in range(0, len(ids), size):
        start = time.perf_counter()
        pieces.append(row.feed(ids[i : i + size], final=i + size >= len(ids)))
        times.append((time.perf_counter() - start) * 1e6)
    return times, "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--round", type=int, default=4, help="tokens committed per round")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    folder = ModelCache.of("qwen2.5-coder-1.5b").directory / "model.tokenizer"
    tokenizer = SavedTokenizer.read(folder)
    if tokenizer is None:
        raise SystemExit(f"no saved tokenizer in {folder}: `specdecode models fetch` it first")
    ids = answer(tokenizer, args.tokens)
    ways = {
        "whole row each round (before)": lambda: WholeRowText(tokenizer, STOPS),
        "incremental RowText (now)": lambda: RowText(tokenizer, STOPS),
    }
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()[0]
    print(f"{cpu}, {os.cpu_count()} cores (load {load:.1f}), Python {platform.python_version()}")
    print(
        f"Qwen2.5-Coder tokenizer, {len(ids)} tokens in rounds of {args.round} "
        f"({-(-len(ids) // args.round)} rounds), best of {args.passes} passes\n"
    )
    print(f"{'':32}{'first 100 rounds':>18}{'last 100 rounds':>18}{'all rounds':>14}")
    print(f"{'':32}{'µs/round':>18}{'µs/round':>18}{'ms':>14}")
    texts = set()
    for name, make in ways.items():
        passes = [run(make, ids, args.round) for _ in range(args.passes)]
        texts.update(text for _, text in passes)
        first = min(statistics.median(t[:EDGE]) for t, _ in passes)
        last = min(statistics.median(t[-EDGE:]) for t, _ in passes)
        total = min(sum(t) for t, _ in passes) / 1000
        print(f"{name:32}{first:>18.1f}{last:>18.1f}{total:>14.1f}")
    assert len(texts) == 1, "the two ways gave different texts"
    print("\nthe same text both ways:", len(texts.pop()), "characters")


if __name__ == "__main__":
    main()
