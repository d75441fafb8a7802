"""The drafter protocol: propose up to k tokens per row, then hear what was kept.

One protocol (`Drafter`): `start` a batch, `propose` up to `max_tokens[b]` tokens per row with
the exact distributions they were drawn from (or `None` for a deterministic drafter), hear the
committed lengths and the accepted counts through `rollback`, and drop finished rows with
`select_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.core.sampling import RowRandom


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [batch, k] (entries past lengths[b] are padding)
    probs: torch.Tensor | None  # [batch, k, vocab], the law each token was drawn from
    lengths: torch.Tensor  # [batch] tokens proposed per row, <= k
    passes: int = 0  # batched forward passes spent on this draft
    invalid_logits: torch.Tensor | None = None  # [batch] (or [] for all) bool: unusable law
    policy_seconds: float = 0.0  # time the length policy spent deciding (e.g. the head)
    row_passes: torch.Tensor | None = None  # [batch] drafter passes per row; None: one a token

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> Draft:
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device), None, zeros)


class Drafter(Protocol):
    def start(self, batch_size: int) -> None: ...

    def rests(self) -> bool:
        """Whether the coming round drafts nothing whatever the text (a drafter resting its
        search): the engine then runs it as a plain round, with no `propose`, and `rollback`
        told that nothing was drafted (a model drafter catches up on its tokens when it drafts
        again). Asked only where the engine can run such a round; True begins that round."""
        ...

    def propose(
        self,
        sequences: torch.Tensor,  # [batch, capacity] committed tokens
        seq_lens: torch.Tensor,  # [batch]
        max_tokens: torch.Tensor,  # [batch] most tokens a row may draft this round
        rng: RowRandom | None,
    ) -> Draft: ...

    def rollback(
        self, lengths: torch.Tensor, num_drafted: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """Keep `lengths[b]` committed tokens per row; `num_accepted[b]` of the
        `num_drafted[b]` drafted tokens survived."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> None:
        """Rows that join a running batch between rounds (their committed tokens so far, and
        whose cached prefixes each may reuse: `ModelBackend.add_rows`)."""
        ...

    def next_law(
        self,
        sequences: torch.Tensor,  # [batch, capacity] committed tokens (and drafts past them)
        seq_lens: torch.Tensor,  # [batch]
        rows: torch.Tensor,  # [batch] bool, the rows that need it
    ) -> torch.Tensor:
        """[batch, vocab] the law the next drafted token would be drawn from (coupled
        randomness draws bonus tokens through it)."""
        ...
