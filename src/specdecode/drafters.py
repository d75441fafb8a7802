"""Drafters: anything that proposes draft tokens for every row of a batch.

One protocol (`Drafter`): `start` a batch, `propose` up to `max_tokens[b]` tokens per row with
the exact distributions they were drawn from (or `None` for a deterministic drafter), hear the
committed lengths through `rollback`, and drop finished rows with `select_rows`.

`ModelDrafter` is a small causal LM that drafts autoregressively, k sequential forward passes,
with its own ragged cache. How many tokens each row drafts in a round is the job of a length
policy (`LengthPolicy`); the constant policy drafts `num_draft_tokens` every round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.config import SamplingConfig
from specdecode.kv_cache import CachedModel
from specdecode.sampling import RowRandom, bad_logits, logits_to_probs, sample_from


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [batch, k] (entries past lengths[b] are padding)
    probs: torch.Tensor | None  # [batch, k, vocab], the law each token was drawn from
    lengths: torch.Tensor  # [batch] tokens proposed per row, <= k
    forwards: int = 0  # batched forward passes spent on this draft
    invalid_logits: torch.Tensor | None = None  # [] bool, set when a drafter logit was NaN/+inf

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> Draft:
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(torch.zeros(batch, 0, dtype=torch.long, device=device), None, zeros)


class Drafter(Protocol):
    def start(self, batch_size: int) -> None: ...

    def propose(
        self,
        sequences: torch.Tensor,  # [batch, capacity] committed tokens
        seq_lens: torch.Tensor,  # [batch]
        max_tokens: torch.Tensor,  # [batch] most tokens a row may draft this round
        rng: RowRandom | None,
    ) -> Draft: ...

    def rollback(self, lengths: torch.Tensor) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...


class LengthPolicy(Protocol):
    """How many tokens each row drafts this round."""

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ConstantLength:
    """Draft k tokens every round (fewer only where the row's token budget is nearly spent)."""

    num_draft_tokens: int

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor:
        return max_tokens.clamp(max=self.num_draft_tokens)


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bring drafter logits to the target's vocabulary size (families pad embeddings).

    Extra drafter ids are cut off and missing ones get -inf; the draft is then sampled from this
    aligned law, and the same law enters the acceptance ratio, so nothing is lost.
    """
    # logits: [batch, v_draft] -> [batch, vocab_size]
    extra = vocab_size - logits.shape[-1]
    if extra < 0:
        return logits[..., :vocab_size]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits


class ModelDrafter:
    """A small causal LM drafting autoregressively, one forward pass per drafted position."""

    def __init__(
        self,
        lm: CachedModel,
        sampling: SamplingConfig,
        vocab_size: int,
        policy: LengthPolicy,
    ) -> None:
        self.lm = lm
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.policy = policy

    def start(self, batch_size: int) -> None:
        self.lm.reset(batch_size)

    @torch.no_grad()
    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        limits = self.policy.round_limits(max_tokens)  # [batch]
        limit_list = limits.tolist()
        width = max(limit_list, default=0)
        if width == 0:
            return Draft.empty(len(limit_list), sequences.device)
        tokens, valid = self.lm.pending(sequences, seq_lens)  # [batch, n_pending]
        drafted, laws = [], []
        invalid = torch.zeros((), dtype=torch.bool, device=sequences.device)
        for i in range(width):
            logits, _ = self.lm.forward(tokens, valid, logits_to_keep=1)
            logits = align_vocab(logits[:, -1], self.vocab_size)  # [batch, vocab]
            invalid = invalid | bad_logits(logits)
            if self.sampling.greedy:
                token = logits.argmax(-1)  # [batch]
            else:
                probs = logits_to_probs(logits, self.sampling)  # [batch, vocab]
                # only rows still drafting draw a number: a row's stream depends on it alone
                draws = rng.uniform([int(i < lim) for lim in limit_list], probs.device)
                token = sample_from(probs, draws[:, 0])
                laws.append(probs)
            drafted.append(token)
            # feed d_i only to rows that will draft position i + 1
            tokens = token[:, None]
            valid = (limits > i + 1)[:, None]
        probs = torch.stack(laws, 1) if laws else None  # [batch, width, vocab]
        return Draft(torch.stack(drafted, 1), probs, limits, width, invalid)

    def rollback(self, lengths: torch.Tensor) -> None:
        self.lm.truncate(lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lm.select_rows(rows)
