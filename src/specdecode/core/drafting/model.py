"""A small causal LM drafting autoregressively: k sequential forward passes, its own cache.

How many tokens each row drafts in a round is the job of a length policy (`length_policies`):
the constant policy fixes it up front; adaptive policies decide after every drafted position,
per row, and the round ends when every row has stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdecode.backends.base import ModelBackend
from specdecode.core.config import SamplingConfig
from specdecode.core.drafting.base import Draft
from specdecode.core.length_policies import DraftedPosition, LengthPolicy
from specdecode.core.sampling import (
    argmax_last,
    bad_rows,
    law_scales,
    logits_to_probs,
    sample_from,
)


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


def draft_room(context: int | None, seq_lens: torch.Tensor) -> torch.Tensor:
    """[batch] tokens a drafter model of `context` tokens per row (None: no limit known) may
    draft for rows of `seq_lens` ([batch]) committed tokens. Its cache holds a row's text and
    its drafts; a GGUF's context is its own trained length, often shorter than the target's,
    and past it llama.cpp refuses the pass (and a transformers model reads positions it was
    never trained on). A row with no room is drafted by lookup, or not at all."""
    if context is None:
        return torch.full_like(seq_lens, torch.iinfo(torch.int32).max)
    return (context - seq_lens).clamp(min=0)


class ModelDrafter:
    """A small causal LM drafting autoregressively, one forward pass per drafted position."""

    def __init__(
        self,
        lm: ModelBackend,
        sampling: SamplingConfig,
        vocab_size: int,
        policy: LengthPolicy,
    ) -> None:
        self.lm = lm
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.policy = policy
        self.context: int | None = getattr(lm, "context_length", None)  # tokens per row

    def room(self, seq_lens: torch.Tensor) -> torch.Tensor:
        return draft_room(self.context, seq_lens)

    def start(self, batch_size: int) -> None:
        self.lm.reset(batch_size)
        self.policy.start(batch_size, self.lm.device)

    def rests(self) -> bool:
        return False  # its every round may draft

    @torch.no_grad()
    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        policy = self.policy
        # [batch] most tokens per row this round, within the model's context
        limits = torch.minimum(policy.round_limits(max_tokens), self.room(seq_lens))
        limit_list = limits.tolist()
        width = max(limit_list, default=0)
        if width == 0:
            return Draft.empty(len(limit_list), sequences.device)
        tokens, valid = self.lm.pending(sequences, seq_lens)  # [batch, n_pending]
        active = limits > 0  # [batch] rows drafting position i
        # only rows that draft catch up: a row that sits rounds out is fed when it next drafts,
        # so a round's cost is its own rows' lag (`behind`), which a priced plan weighs
        valid = valid & active[:, None]
        active_host = [lim > 0 for lim in limit_list]  # the same, for the per-row draws
        lengths = torch.zeros_like(limits)  # [batch]
        drafted, laws, policy_seconds = [], [], 0.0
        invalid = torch.zeros(len(limit_list), dtype=torch.bool, device=sequences.device)
        greedy = self.sampling.greedy
        scales = None if greedy else law_scales(self.sampling, len(limit_list), sequences.device)
        for i in range(width):
            logits, hidden = self.lm.forward(tokens, valid, 1, want_hidden=policy.needs_hidden)
            logits = align_vocab(logits[:, -1], self.vocab_size)  # [batch, vocab]
            invalid = invalid | (bad_rows(logits, scales) & active)  # [batch]
            probs = None
            if greedy:
                token = argmax_last(logits)  # [batch]
            else:
                probs = logits_to_probs(logits, self.sampling)  # [batch, vocab]
                # only rows still drafting draw a number: a row's stream depends on it alone
                token = sample_from(probs, rng.draft_uniforms(i, active_host, probs.device))
                laws.append(probs)
            drafted.append(token)
            lengths = lengths + active
            go_on = active & (limits > i + 1)  # [batch] rows that will draft position i + 1
            if policy.stops_early:
                t0 = time.perf_counter()
                last = hidden[:, -1] if hidden is not None else None  # [batch, hidden]
                number = rng.accept_uniforms(i, token.device) if policy.needs_number else None
                position = DraftedPosition(i, logits, probs, last, token, number)
                go_on = go_on & policy.keep_drafting(position)
                policy_seconds += time.perf_counter() - t0
                active_host = go_on.tolist()  # the per-position host sync adaptive lengths need
                if not any(active_host):
                    break
            else:
                active_host = [i + 1 < lim for lim in limit_list]
            # feed d_i only to rows that will draft position i + 1
            active, tokens, valid = go_on, token[:, None], go_on[:, None]
        probs = torch.stack(laws, 1) if laws else None  # [batch, drafted, vocab]
        return Draft(torch.stack(drafted, 1), probs, lengths, len(drafted), invalid, policy_seconds)

    @torch.no_grad()
    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        """[batch, vocab]: the law this drafter would draft the next token from, for the `rows`
        ([batch] bool) that ask; feeds their pending tokens, as the next round would."""
        # a row that drafted nothing this round may have fed everything already: re-feed its
        # last token (rolling the cache back one) so that every asking row has a position
        self.lm.truncate(torch.where(rows, seq_lens - 1, self.lm.lengths))
        tokens, valid = self.lm.pending(sequences, seq_lens)  # [batch, n_pending]
        logits, _ = self.lm.forward(tokens, valid & rows[:, None], 1)
        return logits_to_probs(align_vocab(logits[:, -1], self.vocab_size), self.sampling)

    def behind(self, seq_lens: torch.Tensor) -> list[int]:
        """Committed tokens each row's cache lacks: what its next drafting round feeds first."""
        return (seq_lens - self.lm.lengths.to(seq_lens.device)).clamp(min=0).tolist()

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        self.lm.truncate(lengths)
        self.policy.observe(num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lm.select_rows(rows)
        self.policy.select_rows(rows)

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> None:
        self.lm.add_rows(prompts, partitions)  # the drafter's cache catches up when it drafts
        self.policy.add_rows(len(prompts))


class DeferredModelDrafter:
    """A `ModelDrafter` made at the first round that drafts with it: until then it only counts
    its rows. Drafting `auto` holds its model this way, so a run whose plan never drafts by
    model (where the drafter's step does not pay) never loads the drafter's weights.

    Made mid-run, the drafter starts empty rows and catches up on every row's committed tokens
    at its first pass (`ModelBackend.pending`), as it does after any round it sat out."""

    def __init__(self, make: Callable[[], ModelDrafter], context: int | None = None) -> None:
        self.make = make
        self.context = context  # the model's tokens per row, known before it is loaded
        self.drafter: ModelDrafter | None = None
        self.rows = 0
        self.capacity = 0  # the most rows a batch has held: the room the made drafter reserves

    def _made(self) -> ModelDrafter:
        if self.drafter is None:
            drafter = self.make()
            drafter.start(max(self.capacity, self.rows))
            drafter.select_rows(torch.arange(self.rows, device=drafter.lm.device))
            self.drafter = drafter
        return self.drafter

    def start(self, batch_size: int) -> None:
        self.rows, self.capacity = batch_size, max(self.capacity, batch_size)
        if self.drafter is not None:
            self.drafter.start(batch_size)

    def rests(self) -> bool:
        return False  # its every round may draft

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        return self._made().propose(sequences, seq_lens, max_tokens, rng)

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        return self._made().next_law(sequences, seq_lens, rows)

    def room(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """As `ModelDrafter.room`; before it is made, from the context it was given."""
        made = self.drafter
        return made.room(seq_lens) if made is not None else draft_room(self.context, seq_lens)

    def behind(self, seq_lens: torch.Tensor) -> list[int]:
        """As `ModelDrafter.behind`; before it is made, every row lacks its whole text."""
        return seq_lens.tolist() if self.drafter is None else self.drafter.behind(seq_lens)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        if self.drafter is not None:
            self.drafter.rollback(lengths, num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = len(rows)
        if self.drafter is not None:
            self.drafter.select_rows(rows)

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> None:
        self.rows += len(prompts)
        self.capacity = max(self.capacity, self.rows)
        if self.drafter is not None:
            self.drafter.add_rows(prompts, partitions)
