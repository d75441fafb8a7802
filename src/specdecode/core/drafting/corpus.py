"""Drafting from a corpus: what a body of text most often puts after the row's last tokens.

Lookup in the row's own text finds nothing for about a quarter of the tokens of a code answer,
and only a one- or two-token match for another third. A corpus in the answer's language often
knows more: after `for i in range(len(` it gives `numbers` no better than a guess, but after
`    return ` `result`, after `if __name__` ` ==`. The index keeps, for every context of one to
`ORDERS` tokens seen at least `MIN_COUNT` times in the corpus, the token that most often
followed it and the share of the context's occurrences that it was (He et al., 2023, REST,
draft from a datastore the same way with a suffix array over The Stack). A draft chains the
longest known context's most frequent next token while each is the choice of at least
`CHAIN_SHARE` of its context's occurrences; the share of the first says how far to trust it
(the planner learns each share band's acceptance, `planners.PricedPlanner`).

The index is numpy arrays (a sorted 64-bit hash of each context, its next token and share), a
few megabytes for the Python standard library; a lookup is a binary search per order. The
shipped corpus is the standard library of the Python that runs this (`stdlib_sources`): code
that every machine with the package already holds, tokenized once per tokenizer and cached.
A cached index that cannot be read is built again, and one that cannot be written is used from
memory (`models.atomic`): the cache saves seconds at a start, and never stops one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from specdecode.models.atomic import say_unreadable, write_or_keep

logger = logging.getLogger(__name__)

ORDERS = 6  # the longest context looked up, in tokens
MIN_COUNT = 2  # contexts seen fewer times are left out: a single occurrence is no law
CHAIN_SHARE = 0.5  # a draft's later tokens: only while their context's choice is this clear
SHARE_BANDS = (0.8, 0.6)  # a draft's band by its first token's share: >= 0.8, >= 0.6, below
# how often each band's first token is taken to be right before any is judged: its floor share
# (the last band's choices are a third of their contexts' on the standard library)
BAND_PRIORS = (0.8, 0.6, 0.3)
EVIDENCE_TOKENS = 1024  # a row's text scored by `CorpusIndex.evidence`: its last this many
MULTIPLIER = 0x9E3779B97F4A7C15  # of the polynomial hash over a context's tokens
MASK = (1 << 64) - 1
# what `CorpusIndex.load` raises on a file that is no whole index
LOAD_ERRORS = (zipfile.BadZipFile, ValueError, KeyError, EOFError, OSError)


def share_band(share: float) -> int:
    """0 for the clearest choices, len(SHARE_BANDS) for the least clear."""
    return next((i for i, floor in enumerate(SHARE_BANDS) if share >= floor), len(SHARE_BANDS))


def _context_keys(tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [length] (-1 between documents) -> the hash of every n-token context and the
    token after it, for contexts and next tokens that stay inside one document."""
    length = tokens.shape[0] - n
    if length <= 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    keys = np.zeros(length, np.uint64)  # [length]
    crossing = tokens[n:] < 0  # [length]
    with np.errstate(over="ignore"):  # the hash wraps at 64 bits, as `_suffix_keys` masks
        for j in range(n):
            window = tokens[j : j + length]
            keys = keys * np.uint64(MULTIPLIER) + (window + 1).astype(np.uint64)
            crossing |= window < 0
    return keys[~crossing], tokens[n:][~crossing]


def _suffix_keys(context: Sequence[int]) -> list[int]:
    """[n - 1] the hash of the context's last n tokens, for n = 1..ORDERS: the hash weighs the
    token i places from the end by MULTIPLIER**i (`_context_keys` builds it left to right), so
    each suffix's hash is the shorter one's plus one term."""
    keys, key, power = [], 0, 1
    for token in reversed(context[-ORDERS:]):
        key = (key + (token + 1) * power) & MASK
        power = (power * MULTIPLIER) & MASK
        keys.append(key)
    return keys


class CorpusIndex:
    """Per context length n (1..ORDERS): sorted context hashes [m_n], the most frequent next
    token [m_n] and its share of the context's occurrences [m_n]."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        self.tables = tables
        self.orders = sorted(tables, reverse=True)  # longest context first

    @classmethod
    def build(
        cls, documents: Iterable[Sequence[int]], orders: int = ORDERS, min_count: int = MIN_COUNT
    ) -> CorpusIndex:
        """The index of token ids `documents` (no context spans two of them)."""
        parts = [np.append(np.asarray(d, np.int64), -1) for d in documents]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)  # [total]
        if tokens.size and tokens.min() < -1:
            raise ValueError("a corpus holds token ids >= 0")
        tables = {}
        for n in range(1, orders + 1):
            keys, after = _context_keys(tokens, n)
            order = np.lexsort((after, keys))  # by context, then by next token
            keys, after = keys[order], after[order]
            # runs of one (context, next token) pair, then of one context
            new_pair = np.ones(keys.size, bool)
            new_pair[1:] = (keys[1:] != keys[:-1]) | (after[1:] != after[:-1])
            pair_start = np.flatnonzero(new_pair)
            pair_count = np.diff(np.append(pair_start, keys.size))
            pair_key, pair_next = keys[pair_start], after[pair_start]
            new_key = np.ones(pair_key.size, bool)
            new_key[1:] = pair_key[1:] != pair_key[:-1]
            key_start = np.flatnonzero(new_key)
            if key_start.size == 0:
                continue
            total = np.add.reduceat(pair_count, key_start)
            most = np.maximum.reduceat(pair_count, key_start)
            group = np.cumsum(new_key) - 1  # each pair's context
            # the first pair of each context whose count is the context's most
            top = np.flatnonzero(pair_count == most[group])
            top = top[np.r_[True, group[top][1:] != group[top][:-1]]]
            keep = total >= min_count
            tables[n] = (
                pair_key[key_start][keep],
                pair_next[top][keep].astype(np.int32),
                (most / total)[keep].astype(np.float32),
            )
        return cls(tables)

    def next_token(self, context: Sequence[int]) -> tuple[int, float] | None:
        """The most frequent next token after the longest known context that ends `context`,
        with its share; None where not even its last token is known."""
        suffixes = _suffix_keys(context)
        for n in self.orders:
            if n > len(suffixes):
                continue
            keys, after, share = self.tables[n]
            key = np.uint64(suffixes[n - 1])
            i = int(np.searchsorted(keys, key))
            if i < keys.size and keys[i] == key:
                return int(after[i]), float(share[i])
        return None

    def continuation(self, text: Sequence[int], limit: int) -> tuple[list[int], int]:
        """[<= limit] the draft after `text`, and the share band of its first token (`share_band`;
        -1: nothing found)."""
        context, drafted, band = list(text[-ORDERS:]), [], -1
        while len(drafted) < limit:
            found = self.next_token(context)
            if found is None or (drafted and found[1] < CHAIN_SHARE):
                break
            token, share = found
            if not drafted:
                band = share_band(share)
            drafted.append(token)
            context = context[1:] + [token] if len(context) >= ORDERS else context + [token]
        return drafted, band

    def evidence(self, text: Sequence[int]) -> list[tuple[int, int]]:
        """Per share band (`share_band`): at how many positions of `text` the index had a choice
        for the next token, and how many of those choices were the token that came. What the
        corpus would have got right in a row's prompt is the first evidence of what it will get
        right in the answer: a code corpus knows a code prompt's next tokens about three times
        as often as a chat prompt's. One binary search per order over every position at once."""
        tokens = np.asarray(text[-EVIDENCE_TOKENS:], np.int64)  # [length]
        choice = np.full(tokens.shape, -1, np.int64)  # [length] the choice for position p
        share = np.zeros(tokens.shape, np.float32)  # [length]
        for n in sorted(self.tables):  # a longer known context overrides a shorter one
            keys, _ = _context_keys(tokens, n)  # [length - n] the context before p = i + n
            table_keys, after, shares = self.tables[n]
            if not keys.size or not table_keys.size:
                continue
            at = np.searchsorted(table_keys, keys).clip(max=table_keys.size - 1)  # [length - n]
            hit = table_keys[at] == keys
            positions = np.flatnonzero(hit) + n
            choice[positions], share[positions] = after[at[hit]], shares[at[hit]]
        known = choice >= 0
        band = sum((share < floor).astype(np.int64) for floor in SHARE_BANDS)  # [length]
        right = known & (choice == tokens)
        return [
            (int((known & (band == b)).sum()), int((right & (band == b)).sum()))
            for b in range(len(SHARE_BANDS) + 1)
        ]

    def save(self, path: Path) -> bool:
        """Keep the index at `path`, whole or not at all (`models.atomic`), so that a process
        reading it while another writes it, or after a writer was killed, never reads half of
        one. False where it cannot be written (said once): the index in memory serves."""
        arrays = {
            f"{name}{n}": a
            for n, t in self.tables.items()
            for name, a in zip("kns", t, strict=True)
        }
        return write_or_keep(
            path, lambda out: np.savez(out, **arrays), "corpus index", logger, "wb"
        )

    @classmethod
    def load(cls, path: Path) -> CorpusIndex:
        """The index saved at `path`. A file that is no index (cut short, damaged, another
        format) raises `LOAD_ERRORS`, not a half-built index: every array is read (and its
        checksum checked) and the three of each order must agree in length."""
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):  # a single array: no index either
            raise ValueError("not an .npz archive of arrays")
        with data:
            orders = sorted({int(name[1:]) for name in data.files})
            tables = {n: (data[f"k{n}"], data[f"n{n}"], data[f"s{n}"]) for n in orders}
        for n, arrays in tables.items():
            if any(a.ndim != 1 or a.shape != arrays[0].shape for a in arrays):
                raise ValueError(f"the arrays of order {n} differ in shape")
        return cls(tables)


STDLIB = "stdlib"  # the corpus of this Python's standard library sources


def stdlib_sources() -> list[Path]:
    """The Python files of this interpreter's standard library, less its tests and tools. The
    walk does not enter the skipped folders: site-packages, under the standard library's root,
    holds far more files than the library itself."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    found = []
    for folder, folders, files in os.walk(root):
        folders[:] = [f for f in folders if f not in skipped]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def corpus_files(spec: str) -> list[Path]:
    """The files a corpus setting names: `STDLIB`, a file, or a folder (its files, hidden ones
    left out). Refused at once where there are none, before any model loads."""
    if spec == STDLIB:
        if sources := stdlib_sources():
            return sources
        raise ValueError(
            "this Python's standard library has no .py sources to index (a zipped or stripped "
            "install): give a corpus file or folder with --corpus PATH"
        )
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if files:
            return files
        raise ValueError(f"the corpus folder {spec} holds no files")
    raise ValueError(
        f"no corpus {spec!r}: give {STDLIB!r} (this Python's standard library), a text file or "
        "a folder of them"
    )


def corpus_index(
    spec: str, encode: Callable[[list[str]], list[list[int]]], tokenizer_id: str, folder: Path
) -> CorpusIndex:
    """The index of the corpus `spec` names (`corpus_files`) as `encode` tokenizes it, built
    once and kept in `folder` under the files' and the tokenizer's identity. Files that are
    not UTF-8 text are left out. A kept index that cannot be read is built again (and said,
    once); one that cannot be kept is used from memory."""
    files = corpus_files(spec)
    stats = [(p, p.stat()) for p in files]
    identity = hashlib.sha256(
        "\n".join(
            [tokenizer_id, *(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats)]
        ).encode()
    ).hexdigest()[:20]
    path = folder / f"corpus-{identity}.npz"
    if path.is_file():
        try:
            return CorpusIndex.load(path)
        except LOAD_ERRORS as error:
            say_unreadable(logger, "corpus index", path, error, "building it again")
    texts = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    index = CorpusIndex.build(encode(texts))
    index.save(path)
    return index
