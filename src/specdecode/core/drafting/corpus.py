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
core receives an index built from token ids; which files a corpus holds, and the index's cache
file, are `specdecode.corpora`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

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
