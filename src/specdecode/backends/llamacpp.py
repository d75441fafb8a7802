"""GGUF models on llama.cpp, under the engine: one llama.cpp sequence per batch row.

Why a backend of its own: the GGUF files we ship are 4-bit; run through `transformers` they are
dequantized to fp32, which reads seven times the bytes per step and holds eight times the memory.
llama.cpp runs them as shipped. Through llama-cpp-python's low-level API (ctypes over `llama.h`),
this module implements the engine's `ModelBackend`:

* one context per model; row b of the batch is llama.cpp sequence `seq_ids[b]`, with its own
  positions (`lengths[b]` is the next one);
* `forward` puts every valid token of every row into one `llama_batch` (one `llama_decode`),
  asking for outputs only at the last `logits_to_keep` columns, and copies those logits once
  into a float32 torch tensor, so verification rules, samplers, drafters and length policies work
  unchanged;
* rollback is `llama_memory_seq_rm` of a row's rejected positions; a finished row's sequence is
  removed and the row mapping shrinks (no copy of any cache);
* the drafter's last hidden states are llama.cpp's embeddings output (the final norm's output,
  as `transformers`' last hidden state), for the acceptance head.

llama.cpp does not promise the same logits for a token scored in passes of different shapes
(see `docs/findings.md`); greedy decoding on this backend therefore agrees with the backend's
own plain greedy decoding except after near-ties, which the bench records.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from pathlib import Path

import torch

from specdecode.backends import hugepages
from specdecode.backends.base import PendingFromLengths
from specdecode.backends.hugepages import anonymous_regions
from specdecode.backends.hugepages_move import PageMove, plan_move, time_huge_pages
from specdecode.backends.llamacpp_lib import (
    LlamaCppLoadError,
    end_of_generation_ids,
    load_library,
    physical_cores,
)
from specdecode.backends.llamacpp_sequences import LlamaCppSequences, PrefixCache
from specdecode.models.gguf import GGUFMetadataError, trained_context

DEFAULT_CONTEXT = 4096  # tokens per row; a row's prompt plus its new tokens must fit


def gguf_context(path: str | os.PathLike[str], context: int = DEFAULT_CONTEXT) -> int:
    """The context per row `LlamaCppModel(path, context=context)` will have, read from the
    file's metadata alone (no llama.cpp, no weights): a prompt that cannot fit is refused
    before gigabytes are read. The trained context where the GGUF names none smaller."""
    try:
        trained = trained_context(Path(path))
    except GGUFMetadataError as error:
        raise LlamaCppLoadError(str(error)) from error
    return min(context, trained) if trained is not None else context


class LlamaCppModel(PendingFromLengths, LlamaCppSequences):
    """A GGUF decoder on llama.cpp with one sequence per batch row (a `ModelBackend`)."""

    # with a cache stream per row, llama_decode splits a batch into passes where every row
    # with tokens left gives the same number: a ragged round runs a pass per level
    pass_layout = "levels"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        role: str = "model",
        context: int = DEFAULT_CONTEXT,
        threads: int | None = None,
        max_rows: int = 1,
        huge_pages: bool | None = None,
        passes: int | None = None,
        prefix_cache_mib: int = 0,
    ) -> None:
        """`huge_pages`: move the weights to 2 MiB pages (True, at once), leave them in
        llama.cpp's file mapping (False), or None: as measured once on this machine for this
        file (`hugepages.decide`, a few one-token steps timed both ways on the first load), and
        only as far as the move pays: with `passes`, the most passes the caller will run, not
        at all where they cannot repay the move's recorded cost; else from the pass at which
        the passes so far would have (`hugepages.Mover`).
        `prefix_cache_mib`: host memory for the cache cells of sequences a joining row is about
        to overwrite (`add_rows`), so a prompt seen before is restored rather than prefilled
        even after its sequence served others; 0: only the cells still in the sequences."""
        lib = load_library()
        self.lib = lib
        self.path = Path(path)
        self.role = role
        self.device = torch.device("cpu")
        if not self.path.is_file():
            raise LlamaCppLoadError(f"{role}: no GGUF file at {self.path}")

        def load(role: str, huge: bool) -> LlamaCppModel:
            return LlamaCppModel(self.path, role=role, context=64, threads=threads, huge_pages=huge)

        huge_pages, mover, slower = plan_move(
            self.path, huge_pages, passes, lambda: time_huge_pages(load)
        )
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        before = anonymous_regions() if huge_pages else set()
        if huge_pages:  # weights read into memory that can be moved to 2 MiB pages (a file
            # mapping cannot, here), then moved below (`hugepages`)
            params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.model:
            raise LlamaCppLoadError(
                f"{role}: llama.cpp cannot load {self.path} (not a GGUF file, damaged, or an "
                "architecture this llama.cpp build does not know); re-fetch it with "
                "`specdecode models fetch NAME --force`, or use `--backend torch`"
            )
        # the weights' regions, named now: what is mapped later (the caches, a corpus index)
        # is no weight, and a move that took it too would run, beside the passes, far longer
        weights = anonymous_regions() - before if huge_pages else None
        if not huge_pages:  # the weights llama.cpp copied out of its file mapping
            hugepages.release_file_pages(self.path)
        vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self._stop_ids = end_of_generation_ids(lib, vocab, self.vocab_size)
        self.hidden_size = int(lib.llama_model_n_embd(self.model))
        self.context_length = min(context, int(lib.llama_model_n_ctx_train(self.model)))
        self.threads = threads or physical_cores()
        self.ctx = None
        self.rows_capacity = 0
        self.batch = None
        self.batch_capacity = 0
        self._view_key: tuple[int, int] | None = None  # `_logits_view`: where it points
        self._view = torch.empty(0)
        self._new_context(max(1, max_rows))
        self.prefix_cache = PrefixCache(prefix_cache_mib << 20)
        self.pages = PageMove(self.path, role, weights, mover, slower)
        self.reset(0)

    @property
    def moving_pages(self) -> bool:
        """Whether the weights are not yet in the 2 MiB pages this machine's verdict puts them
        in: being moved, waiting to be, or left in 4 KiB pages for a run too short to repay the
        move. Passes then run slower than priced (prices are timed on moved weights), and that
        is no reason to correct the prices."""
        return self.pages.moving

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of weights moved to 2 MiB pages (starts a waiting move, and waits for it)."""
        return self.pages.finish()

    def settle(self) -> None:
        """Move the weights to 2 MiB pages now, where this machine's verdict says they gain,
        and wait for the move: for a caller about to run for long (a server), which the move
        repays whatever it costs, and whose passes would otherwise meet it halfway."""
        self.pages.finish()

    def stop_token_ids(self) -> tuple[int, ...]:
        """Every end-of-generation id of the GGUF (`end_of_generation_ids`)."""
        return self._stop_ids

    # ---------------------------------------------------------------- set-up

    def _new_context(self, rows: int) -> None:
        """A context for `rows` sequences of `context_length` tokens each (each row gets its
        own cache stream: rows share no prefix, and separate streams attend less)."""
        lib = self.lib
        if self.ctx is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        params = lib.llama_context_default_params()
        params.n_ctx = self.context_length * rows
        params.n_batch = params.n_ubatch = max(512, 16 * rows)
        params.n_seq_max = rows
        params.n_threads = params.n_threads_batch = self.threads
        params.embeddings = False  # switched on per pass, when hidden states are read
        # one row: a unified cache, as llama-cpp-python sets it (a faster step: findings, "A
        # unified llama.cpp cache makes ragged passes cheap and attention dear"); several: a
        # cache stream per row, so a row's attention spans its own cells only
        params.kv_unified = rows == 1
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise LlamaCppLoadError(
                f"{self.role}: llama.cpp could not create a context of {rows} row(s) of "
                f"{self.context_length} tokens (out of memory?)"
            )
        self.memory = lib.llama_get_memory(self.ctx)
        self.embeddings_on = False
        self.rows_capacity = rows
        self.max_batch_tokens = int(params.n_batch)

    def _ensure_batch(self, n_tokens: int) -> None:
        if n_tokens > self.batch_capacity:
            if self.batch is not None:
                self.lib.llama_batch_free(self.batch)
            capacity = max(n_tokens, 2 * self.batch_capacity, 64)
            self.batch = self.lib.llama_batch_init(capacity, 0, 1)
            self.batch_capacity = capacity

    def close(self) -> None:
        """Free llama.cpp's memory now rather than at garbage collection."""
        if getattr(self, "pages", None) is not None:
            self.pages.join()
        lib = self.lib
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        with contextlib.suppress(Exception):
            self.close()

    # ---------------------------------------------------------------- ModelBackend

    def reset(self, batch_size: int) -> None:
        if batch_size > self.rows_capacity:
            self._new_context(batch_size)
        else:
            self.lib.llama_memory_clear(self.memory, True)
        self._start_rows(batch_size)

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 1,
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append a ragged block to every row in one `llama_decode`; logits of its end.

        tokens, valid: [batch, n] -> logits [batch, logits_to_keep, vocab] (float32; zero at a
        hole), hidden [batch, logits_to_keep, hidden] when asked.
        """
        self.pages.before_pass()
        start = time.perf_counter()
        out = self._forward(tokens, valid, logits_to_keep, want_hidden)
        if tokens.shape == (1, 1):  # a one-token step: the unit a move's cost is kept in
            self.pages.step_seconds.append(time.perf_counter() - start)
        return out

    def _forward(
        self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int, want_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, n = tokens.shape
        keep = min(logits_to_keep, n)
        valid_l = valid.tolist()
        tokens_l = tokens.tolist()
        lengths_l = [len(row) for row in self.row_tokens]
        count = sum(map(sum, valid_l))
        counts = [sum(v) for v in valid_l]
        self._before_pass(lengths_l, counts, want_hidden)
        # every valid token, rows in the order of their sequence ids: (row, column of its
        # logits or -1, token, position). With a cache stream per row llama.cpp puts rows in
        # one micro-batch only while their sequence ids rise one by one through the batch; a
        # server's rows join on whichever sequence holds their prefix, so in row order a round
        # of 8 rows ran as several passes (docs/findings.md has the measurement)
        entries: list[tuple[int, int, int, int]] = []
        for b in sorted(range(batch), key=self.seq_ids.__getitem__):
            pos = lengths_l[b]
            for j in range(n):
                if valid_l[b][j]:
                    entries.append(
                        (b, j - (n - keep) if j >= n - keep else -1, tokens_l[b][j], pos)
                    )
                    pos += 1
        filled = sum(col >= 0 for _, col, _, _ in entries) == batch * keep
        # [batch, keep, vocab]; zeroed only where a hole stays unwritten (a one-token step has
        # none, and a zeroed row of 151,936 logits costs what the copy into it does)
        logits = (torch.empty if filled else torch.zeros)(batch, keep, self.vocab_size)
        hidden = torch.zeros(batch, keep, self.hidden_size) if want_hidden else None
        # llama_decode takes at most n_batch tokens: a longer block (a batch of long prompts)
        # goes in pieces, each piece's outputs copied before the next overwrites them
        for start in range(0, count, self.max_batch_tokens):
            self._decode_piece(entries[start : start + self.max_batch_tokens], logits, hidden)
        for b in range(batch):
            if counts[b]:
                self.row_tokens[b].extend(
                    t for t, v in zip(tokens_l[b], valid_l[b], strict=True) if v
                )
        return logits, hidden

    def step_logits(self, tokens: list[int]) -> torch.Tensor:
        """`forward` of one token per row, the logits left where llama.cpp wrote them: [batch,
        vocab], a view valid until this model's next pass. Why: a plain round reads them once,
        and the copy of a vocabulary-wide row and a ragged block's bookkeeping cost a few per
        cent of a small model's step on a CPU (docs/findings.md, the plain path)."""
        self.pages.before_pass()
        start = time.perf_counter()
        batch = len(tokens)
        lengths = [len(row) for row in self.row_tokens]
        self._before_pass(lengths, [1] * batch, False)
        order = sorted(range(batch), key=self.seq_ids.__getitem__)  # as `_forward` runs rows
        self._ensure_batch(batch)
        for i, b in enumerate(order):
            self._entry(i, tokens[b], lengths[b], b, True)
        self._decode(batch)
        if batch == 1:
            self.pages.step_seconds.append(time.perf_counter() - start)
        for row, token in zip(self.row_tokens, tokens, strict=True):
            row.append(token)
        logits = self._logits_view(batch)
        if order != list(range(batch)):  # output i is row order[i]'s
            logits = logits[torch.tensor(order).argsort()]  # [batch, vocab], a copy
        return logits

    def _before_pass(self, lengths: list[int], counts: list[int], want_hidden: bool) -> None:
        """Refuse a pass past a row's context; move the rows down (`_compact`); embeddings on
        only for a pass that reads hidden states."""
        for b, (held, count) in enumerate(zip(lengths, counts, strict=True)):
            if held + count > self.context_length:
                raise ValueError(
                    f"{self.role}: row {b} would hold {held + count} tokens, beyond "
                    f"this llama.cpp context of {self.context_length} per row"
                )
        self._compact()
        if want_hidden != self.embeddings_on:  # with embeddings on, llama.cpp outputs (and
            # computes the logits of) every token of a batch: only when the hidden states are read
            self.lib.llama_set_embeddings(self.ctx, want_hidden)
            self.embeddings_on = want_hidden

    def _entry(self, i: int, token: int, pos: int, row: int, output: bool) -> None:
        """Entry i of llama.cpp's batch: `token` at `pos` of row `row`'s sequence."""
        lb = self.batch
        lb.token[i], lb.pos[i], lb.n_seq_id[i] = token, pos, 1
        lb.seq_id[i][0] = self.seq_ids[row]
        lb.logits[i] = output

    def _decode_piece(
        self,
        piece: list[tuple[int, int, int, int]],
        logits: torch.Tensor,  # [batch, keep, vocab], filled in place
        hidden: torch.Tensor | None,  # [batch, keep, hidden], filled in place
    ) -> None:
        """One `llama_decode` of `piece`, its wanted outputs copied into logits (and hidden)."""
        self._ensure_batch(len(piece))
        rows, cols, index = [], [], []  # where each output goes, and which output it is
        for i, (b, col, token, pos) in enumerate(piece):
            self._entry(i, token, pos, b, col >= 0)
            if col >= 0:
                rows.append(b)
                cols.append(col)
                index.append(i if hidden is not None else len(index))
        self._decode(len(piece))
        if not rows:
            return
        rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
        outputs = len(piece) if hidden is not None else len(rows)
        pick = torch.tensor(index) if hidden is not None else slice(None)
        logits[rows_t, cols_t] = self._outputs(
            self.lib.llama_get_logits(self.ctx), outputs, self.vocab_size
        )[pick]  # the one copy of the logits (two where every token was output)
        if hidden is not None:
            hidden[rows_t, cols_t] = self._outputs(
                self.lib.llama_get_embeddings(self.ctx), outputs, self.hidden_size
            )[pick]

    def _decode(self, count: int) -> None:
        self.batch.n_tokens = count
        status = self.lib.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(
                f"{self.role}: llama_decode failed with status {status} on a batch of {count} "
                "tokens (1: no room left in the cache; < 0: an error inside llama.cpp)"
            )

    def _logits_view(self, rows: int) -> torch.Tensor:
        """llama.cpp's logits of the last pass's `rows` outputs, in place: [rows, vocab]. The
        view is made again only when llama.cpp's buffer moved (its outputs grew)."""
        pointer = self.lib.llama_get_logits(self.ctx)
        key = (ctypes.addressof(pointer.contents), rows)
        if self._view_key != key:
            self._view_key, self._view = key, self._outputs(pointer, rows, self.vocab_size)
        return self._view

    @staticmethod
    def _outputs(pointer, rows: int, width: int) -> torch.Tensor:
        """A view of llama.cpp's output buffer (no copy; the caller's assignment copies once)."""
        array = (ctypes.c_float * (rows * width)).from_address(ctypes.addressof(pointer.contents))
        return torch.frombuffer(array, dtype=torch.float32).view(rows, width)
