"""Rows on llama.cpp sequences: which row holds which sequence, and prefixes kept for reuse.

Why apart from the backend's passes: a server's rows join, end and leave their sequences
scattered, and what a sequence's cells still hold decides where a joining row goes, what it
need not prefill, and what goes to host memory before it is overwritten. The passes see only
`seq_ids` (and move the rows down, `_compact`, before each).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Sequences' cache cells in host memory, keyed by the tokens they hold and the partition
    of the rows that wrote them, least recently used dropped first past `budget` bytes.
    llama-server keeps such a cache of its slots (`--cache-ram`); without it a server of 8 rows
    forgets a prompt as soon as 8 others ran. A prompt matches only cells of its own partition
    (a server's client, `RowRequest.cache_partition`): a reused prefix, or the time it saves,
    would otherwise tell one client what another sent."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held: dict[tuple[str, tuple[int, ...]], ctypes.Array] = {}  # oldest first
        self.bytes = 0

    @property
    def entries(self) -> dict[tuple[int, ...], ctypes.Array]:
        """The default partition's cells by their tokens, oldest first (a server without keys
        or salts holds only these)."""
        return {tokens: cells for (part, tokens), cells in self.held.items() if not part}

    def longest(self, prompt: list[int], partition: str = "") -> tuple[list[int], int]:
        """The saved tokens of `partition` sharing the longest prefix with `prompt`, and that
        length."""
        best, n = [], 0
        for part, held in self.held:
            if part == partition and len(held) > n and (k := shared_prefix(held, prompt)) > n:
                best, n = list(held), k
        return best, n

    def put(self, tokens: list[int], cells: ctypes.Array, partition: str = "") -> None:
        key = (partition, tuple(tokens))
        if key in self.held:
            self.bytes -= len(self.held.pop(key))
        self.held[key] = cells
        self.bytes += len(cells)
        while self.bytes > self.budget and self.held:
            self.bytes -= len(self.held.pop(next(iter(self.held))))

    def take(self, tokens: list[int], partition: str = "") -> ctypes.Array:
        """The cells saved for `tokens` in `partition`, left in the cache as the most recently
        used."""
        key = (partition, tuple(tokens))
        cells = self.held.pop(key)
        self.held[key] = cells
        return cells


class LlamaCppSequences:
    """The rows of a `LlamaCppModel` on its llama.cpp sequences: which sequence each row holds,
    the tokens every sequence's cells hold (a row's, or a free sequence's for a later prompt
    that shares them), and their moves (`add_rows`, `_compact`) and host-memory copies."""

    lib: Any
    ctx: Any
    memory: Any
    role: str
    rows_capacity: int
    prefix_cache: PrefixCache
    seq_ids: list[int]  # row b is llama.cpp sequence seq_ids[b]
    row_tokens: list[list[int]]  # what each row's sequence holds
    # sequences no row uses, with the tokens their cells still hold (oldest first): a row
    # that joins takes the one sharing the longest prefix with its prompt (prefix reuse)
    kept: dict[int, list[int]]
    # the partition of the rows whose tokens each sequence's cells hold; absent for a row
    # that did not join by `add_rows` (a batch made by `reset`, a drafter made mid-run),
    # whose partition is unknown: its cells are reused by no row and not saved
    partitions: dict[int, str]

    @property
    def lengths(self) -> torch.Tensor:
        """[batch] tokens held in each row's sequence, from `row_tokens`: one account of a
        row's cells, and a plain round's pass adds its token without a tensor op."""
        return torch.tensor([len(row) for row in self.row_tokens], dtype=torch.long)

    def _start_rows(self, batch_size: int) -> None:
        """Row b on sequence b, every sequence empty: a new batch (`reset`)."""
        self.seq_ids = list(range(batch_size))
        self.row_tokens = [[] for _ in range(batch_size)]
        self.kept = {}
        self.partitions = {}

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> list[int]:
        """Append a row per prompt on the lowest free sequence, holding the longest prefix of
        its prompt found in any free sequence or in host memory, so the engine feeds only the
        rest. At least the prompt's last token is left to feed: its logits start the row.

        The lowest, because llama.cpp runs rows in one micro-batch only while their sequence
        ids rise one by one (`_forward`): rows that join on scattered sequences (wherever their
        prefix happened to be) split every later pass. A prefix held by another free sequence
        is copied over rather than joined there; that sequence keeps it.

        A prompt's prefix is looked for only among the cells of its own partition
        (`partitions[i]`), so a row reuses nothing another client's rows left."""
        reused = []
        for prompt, partition in zip(prompts, partitions or [""] * len(prompts), strict=True):
            if not self.kept:
                raise ValueError(
                    f"{self.role}: all {self.rows_capacity} sequences are in use; reserve more rows"
                )
            head = prompt[: max(len(prompt) - 1, 0)]  # the last token is fed: it starts the row
            seq = min(self.kept)
            held = self.kept.pop(seq)
            ours = self.partitions.get(seq) == partition
            n = shared_prefix(held, head) if ours else 0
            # the longest prefix elsewhere: in another free sequence of the partition (ties:
            # the one freed first, as the dict keeps them), else in host memory
            mine = [q for q in self.kept if self.partitions.get(q) == partition]
            other = max(mine, key=lambda q: shared_prefix(self.kept[q], head), default=None)
            k = 0 if other is None else shared_prefix(self.kept[other], head)
            saved, m = self.prefix_cache.longest(head, partition)
            if max(k, m) <= n:  # the row keeps its sequence's own prefix; the rest is lost
                if len(held) > n:
                    self._save(seq, held)
            else:  # taken before `held` is saved, which could push them out of host memory
                tokens, cells = (
                    (self.kept[other], self._cells(other))
                    if k >= m
                    else (saved, self.prefix_cache.take(saved, partition))
                )
                if held and (tokens != held or not ours):
                    self._save(seq, held)
                n = max(k, m) if self._put_cells(seq, cells) else 0
            self.lib.llama_memory_seq_rm(self.memory, seq, n, -1)
            self.partitions[seq] = partition
            self.seq_ids.append(seq)
            self.row_tokens.append(list(prompt[:n]))
            reused.append(n)
        return reused

    def _cells(self, seq: int, most: int | None = None) -> ctypes.Array | None:
        """A copy of a sequence's cache cells in host memory; None where llama.cpp gives none
        or they are over `most` bytes."""
        size = int(self.lib.llama_state_seq_get_size(self.ctx, seq))
        if not size or (most is not None and size > most):
            return None
        buf = (ctypes.c_uint8 * size)()
        copied = int(self.lib.llama_state_seq_get_data(self.ctx, buf, size, seq))
        return buf if copied == size else None

    def _compact(self) -> None:
        """Move the rows on the highest sequences into the free ones below them, so that the
        rows hold sequences 0..n-1. llama.cpp runs rows in one micro-batch only while their
        sequence ids rise one by one: rows that end with none joining in their place (the
        last requests of a burst, a load under the batch's rows) leave the others scattered,
        and a scattered batch runs a pass per run of sequences (docs/findings.md). Called
        before a pass, after the round's newcomers took the lowest free sequences. A move
        copies the row's cells (its own tokens', not the whole stream); the free sequence's
        prefix goes to host memory first (within its budget), and the sequence the row left
        keeps the row's tokens for a later prompt that shares them."""
        while self.kept and self.seq_ids and min(self.kept) < max(self.seq_ids):
            low, high = min(self.kept), max(self.seq_ids)
            cells = self._cells(high)
            if cells is None:
                return
            held = self.kept.pop(low)
            if held:
                self._save(low, held)
            if not self._put_cells(low, cells):
                self.kept[low] = []  # emptied and not filled: the rows stay where they are
                return
            if high in self.partitions:
                self.partitions[low] = self.partitions[high]
            else:
                self.partitions.pop(low, None)
            b = self.seq_ids.index(high)
            self.seq_ids[b] = low
            self.kept[high] = list(self.row_tokens[b])

    def _save(self, seq: int, tokens: list[int]) -> None:
        """Copy a sequence's cells to host memory, keyed by the tokens they hold and their
        partition."""
        budget, partition = self.prefix_cache.budget, self.partitions.get(seq)
        if budget and partition is not None and (buf := self._cells(seq, budget)) is not None:
            self.prefix_cache.put(tokens, buf, partition)

    def _put_cells(self, seq: int, cells: ctypes.Array | None) -> bool:
        """Fill an emptied sequence with copied cells; False (the sequence empty) where there
        are none or llama.cpp refuses them, and the row then prefills."""
        self.lib.llama_memory_seq_rm(self.memory, seq, 0, -1)
        return cells is not None and bool(
            self.lib.llama_state_seq_set_data(self.ctx, cells, len(cells), seq)
        )

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep the first `lengths[b]` tokens of each row: remove the rest from its sequence."""
        lengths = torch.minimum(self.lengths, lengths.to(self.lengths.device))
        for b, (old, new) in enumerate(zip(self.lengths.tolist(), lengths.tolist(), strict=True)):
            if new < old:
                self.lib.llama_memory_seq_rm(self.memory, self.seq_ids[b], new, -1)
                del self.row_tokens[b][new:]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows. The sequences of the others keep their cells for a row that
        joins later with the same prefix (`add_rows`); a new batch (`reset`) clears them."""
        keep = rows.tolist()
        for b in sorted(set(range(len(self.seq_ids))) - set(keep)):
            self.kept[self.seq_ids[b]] = self.row_tokens[b]
        self.seq_ids = [self.seq_ids[b] for b in keep]
        self.row_tokens = [self.row_tokens[b] for b in keep]
