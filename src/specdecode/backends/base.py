"""The model interface the engine talks to: a decoder and its per-row cache, behind one protocol.

The engine never sees a `torch.nn.Module`, a llama.cpp context or a static cache; it sees a
`ModelBackend`: a batch of rows, each with its own committed length, that can

* `reset(batch_size)`: start empty rows;
* `forward(tokens, valid, logits_to_keep)`: append a ragged block to every row (invalid entries
  are holes, left-padded) and return the logits of the block's last positions;
* `truncate(lengths)`: keep only the first `lengths[b]` tokens of each row (rollback of
  rejected drafts is bookkeeping: a moved length, removed positions, never a re-run);
* `select_rows(index)`: keep only these rows (finished rows stop costing compute);
* `add_rows(prompts)`: append rows that join between rounds, reusing cached prefixes where the
  backend keeps them;
* `pending(sequences, seq_lens)`: the committed tokens a row has not yet been fed (one
  definition for every backend, `PendingFromLengths`);
* `step_logits(tokens)`: a plain round's pass, one token per row, its logits read in place
  where the backend can (`StepFromForward` otherwise).

`torch_eager.CachedModel` implements it over a `transformers` decoder with a ragged
`DynamicCache` view; `llamacpp.LlamaCppModel` over a GGUF file with one llama.cpp sequence
per row. What differs between them (dtype, threads, weights) stays inside the backend; the
verification rules, samplers, drafters and length policies work unchanged on either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class ModelBackend(Protocol):
    """A decoder with a batch of per-row caches that can be appended to and rolled back."""

    device: torch.device
    lengths: torch.Tensor  # [batch] tokens held in each row's cache
    # whether the weights are not yet where the prices were timed on them (llama.cpp moving them
    # to 2 MiB pages): its rounds are slower for now, not mispriced; False on every other backend
    moving_pages: bool

    def reset(self, batch_size: int) -> None: ...

    def forward(
        self,
        tokens: torch.Tensor,  # [batch, n] token ids (holes: any id)
        valid: torch.Tensor,  # [batch, n] bool, False for a hole (left padding)
        logits_to_keep: int = 1,
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [batch, logits_to_keep, vocab] (float32), hidden [batch, keep, hidden]."""
        ...

    def truncate(self, lengths: torch.Tensor) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> list[int]:
        """Append an empty row per prompt (rows join a running batch between rounds); returns
        how many leading tokens of each prompt its cache already holds (a reused prefix).
        `partitions[i]`: whose cells prompt i may reuse (`RowRequest.cache_partition`; None:
        all ""), for a backend that keeps prefixes; others ignore it."""
        ...

    def pending(
        self, sequences: Tensor, seq_lens: Tensor, pad_id: int = 0, width: int | None = None
    ) -> tuple[Tensor, Tensor]: ...

    def step_logits(self, tokens: list[int]) -> Tensor:
        """Append one token to every row (tokens[b]: the one row b's cache lacks) -> the logits
        after it, [batch, vocab] float32, which may be the backend's own buffer: valid until
        its next pass (`StepFromForward`; llama.cpp's leaves them where it wrote them)."""
        ...


class PendingFromLengths:
    """`ModelBackend.pending` from the tokens each row's cache holds (`lengths`): the one
    definition every backend takes, so that none can drift from the block the others give."""

    lengths: torch.Tensor  # [batch]

    def pending(
        self, sequences: Tensor, seq_lens: Tensor, pad_id: int = 0, width: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """The committed tokens not yet in the cache, as a left-padded ragged block.

        sequences: [batch, capacity], seq_lens: [batch] -> tokens, valid: [batch, n_pending]
        """
        return pending_block(sequences, seq_lens, self.lengths, pad_id, width)


class StepFromForward:
    """`ModelBackend.step_logits` as a `forward` of one token per row: for backends whose
    logits are a fresh tensor anyway."""

    device: torch.device
    forward: Callable[..., tuple[Tensor, Tensor | None]]  # the backend's own

    def step_logits(self, tokens: list[int]) -> Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [batch, 1]
        logits, _ = self.forward(ids, torch.ones_like(ids, dtype=torch.bool))
        return logits[:, 0]  # [batch, vocab]


def pending_block(
    sequences: torch.Tensor,  # [batch, capacity] committed tokens
    seq_lens: torch.Tensor,  # [batch]
    held: torch.Tensor,  # [batch] tokens already in each row's cache
    pad_id: int = 0,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed tokens not yet in a cache, as a left-padded ragged block.

    Shared by every backend, so that a ragged prefill and a drafter catching up on the tokens
    it missed look the same to each: tokens, valid: [batch, n_pending]. `width`, where the
    caller knows it on the host (at least every row's pending count), saves reading it off the
    device: a sync a GPU round would otherwise wait on (the engine knows it for the target).
    """
    n = width if width is not None else int((seq_lens - held).max()) if held.numel() else 0
    index = seq_lens[:, None] - n + torch.arange(n, device=sequences.device)  # [batch, n]
    valid = index >= held[:, None]
    tokens = sequences.gather(1, index.clamp(min=0)).masked_fill(~valid, pad_id)
    return tokens, valid
