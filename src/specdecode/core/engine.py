"""The decoding loop: one speculative step, repeated until every row has stopped.

`speculative_step` is Leviathan et al. (2023), Alg. 1 and Chen et al. (2023), batched: the drafter
proposes up to k tokens per row, the target scores the k + 1 positions of every row in one
forward pass, the verification rule decides per row how many to keep, and both caches are rolled
back per row by bookkeeping (see `kv_cache`). Plain autoregressive decoding is the same step with
no drafter: same cache, same sampling code, so every speedup is measured against a fair baseline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdecode.backends.base import ModelBackend
from specdecode.core.config import DecodeConfig
from specdecode.core.drafting.base import Draft, Drafter
from specdecode.core.sampling import (
    InvalidLogitsError,
    PositionRandom,
    RowRandom,
    bad_logits,
    row_seed_list,
    sample_from,
)
from specdecode.core.stats import DecodeStats, RowStats
from specdecode.core.verification import Verdict, VerificationRule


@dataclass(frozen=True)
class StepEvent:
    """Tokens committed in one step, for the rows (original prompt indices) that got some."""

    rows: list[int]
    new_tokens: list[list[int]]
    finished: list[bool]


class Batch:
    """Committed tokens of the rows still running, in one padded buffer."""

    def __init__(self, prompts: list[list[int]], cfg: DecodeConfig, device: torch.device) -> None:
        capacity = max(map(len, prompts)) + cfg.max_new_tokens + cfg.max_draft_tokens + 2
        self.sequences = torch.zeros(len(prompts), capacity, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            self.sequences[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.seq_lens = torch.tensor([len(p) for p in prompts], device=device)  # [batch]
        self.budget = torch.full_like(self.seq_lens, cfg.max_new_tokens)  # tokens still allowed
        self.rows = list(range(len(prompts)))  # original index of each running row
        self.stop_ids = torch.tensor(cfg.stop_token_ids, dtype=torch.long, device=device)

    def commit(self, draft: Draft, num_accepted: torch.Tensor, next_tokens: torch.Tensor):
        """Append accepted draft tokens and the next token; cut at a stop token or the budget."""
        k = draft.tokens.shape[1]
        block = torch.cat([draft.tokens, torch.zeros_like(next_tokens)[:, None]], 1)  # [b, k+1]
        block = block.scatter(1, num_accepted[:, None], next_tokens[:, None])
        counts = num_accepted + 1  # [batch]
        slots = torch.arange(k + 1, device=block.device)  # [k + 1]
        is_stop = torch.isin(block, self.stop_ids) & (slots < counts[:, None])
        first_stop = torch.where(is_stop, slots, k + 1).min(1).values  # [batch]
        counts = torch.minimum(torch.minimum(counts, first_stop + 1), self.budget)
        index = (self.seq_lens[:, None] + slots).clamp(max=self.sequences.shape[1] - 1)
        keep = slots < counts[:, None]
        self.sequences.scatter_(1, index, torch.where(keep, block, self.sequences.gather(1, index)))
        self.seq_lens = self.seq_lens + counts
        self.budget = self.budget - counts
        done = (self.budget == 0) | is_stop.any(1)
        return block, counts, done

    def select(self, keep: list[int]) -> torch.Tensor:
        index = torch.tensor(keep, dtype=torch.long, device=self.sequences.device)
        self.sequences, self.seq_lens, self.budget = (
            t.index_select(0, index) for t in (self.sequences, self.seq_lens, self.budget)
        )
        self.rows = [self.rows[i] for i in keep]
        return index


def speculative_step(
    target: ModelBackend,
    drafter: Drafter | None,
    rule: VerificationRule,
    batch: Batch,
    cfg: DecodeConfig,
    rng: RowRandom | None,
    stats: DecodeStats,
    pending_width: int | None = None,
):
    """One round for every running row: draft, verify in one target pass, roll back, commit.

    `pending_width`: how many committed tokens the target's cache lacks at most, where the
    caller knows it on the host (after the first round: what the last round's figures say).
    """
    t0 = time.perf_counter()
    if rng is not None:
        rng.begin_round(batch.seq_lens)  # position-keyed numbers start at each row's length
    max_draft = (batch.budget - 1).clamp(max=cfg.max_draft_tokens)  # [batch]; +1 comes free
    drafting = drafter is not None and (
        cfg.max_draft_batch is None or len(batch.rows) <= cfg.max_draft_batch
    )  # a plain round otherwise: the drafter catches up on its tokens when it drafts again
    draft = (
        drafter.propose(batch.sequences, batch.seq_lens, max_draft, rng)
        if drafting
        else Draft.empty(len(batch.rows), batch.sequences.device)
    )
    t1 = time.perf_counter()
    pending, pending_valid = target.pending(
        batch.sequences, batch.seq_lens, width=pending_width
    )  # [batch, n]
    k = draft.tokens.shape[1]
    draft_valid = torch.arange(k, device=draft.lengths.device) < draft.lengths[:, None]
    logits, _ = target.forward(
        torch.cat([pending, draft.tokens], 1),
        torch.cat([pending_valid, draft_valid], 1),
        logits_to_keep=k + 1,
    )  # logits: [batch, k + 1, vocab]
    invalid = bad_logits(logits)
    if draft.invalid_logits is not None:
        invalid = invalid | draft.invalid_logits
    verdict = rule.verify(draft.tokens, draft.probs, logits, draft.lengths, rng)
    committed = batch.seq_lens + verdict.num_accepted  # [batch] cache keeps these tokens
    target.truncate(committed)
    if drafter is not None:
        drafter.rollback(committed, draft.lengths, verdict.num_accepted)
    next_tokens = verdict.next_tokens  # [batch]
    if cfg.coupled and drafter is not None:
        next_tokens, bad = coupled_next_tokens(drafter, rule, batch, draft, verdict, logits, rng,
                                               stats)  # fmt: skip
        invalid = invalid | bad
    block, counts, done = batch.commit(draft, verdict.num_accepted, next_tokens)
    stats.verify_seconds += time.perf_counter() - t1
    stats.draft_seconds += t1 - t0
    stats.policy_seconds += draft.policy_seconds
    stats.target_forwards += 1
    stats.drafter_forwards += draft.forwards
    passes = draft.row_passes if draft.row_passes is not None else draft.lengths  # [batch]
    # [batch, 5]: what the loop reads on the host; `invalid` ([] bool) goes with it, checked
    # in the round's one copy to the host rather than by a sync of its own
    figures = torch.stack([counts, verdict.num_accepted, draft.lengths, passes, done.long()], 1)
    invalid = torch.as_tensor(invalid, device=figures.device).long().expand(len(figures), 1)
    return block, torch.cat([figures, invalid], 1)


def check_finite(invalid: bool) -> None:
    """Raise where a model's logits of the round were unusable (read in the round's host copy)."""
    if invalid:
        raise InvalidLogitsError(
            "a model produced NaN or +inf logits (or a position where every logit is -inf); "
            "check its weights and dtype (fp16 overflow is a common cause)"
        )


def coupled_next_tokens(
    drafter: Drafter,
    rule: VerificationRule,
    batch: Batch,
    draft: Draft,
    verdict: Verdict,
    logits: torch.Tensor,  # [batch, k + 1, vocab] the target's, of this round
    rng: RowRandom | None,
    stats: DecodeStats,
) -> tuple[torch.Tensor, torch.Tensor | bool]:
    """The next token of every row, with the bonus token of a fully accepted row drawn the way
    a drafted token at its position would be: from the drafter's law there, then accepted or
    recovered against the target's. That law takes one more drafter pass (timed apart, in
    `stats.coupling_seconds`). Together with `PositionRandom`, a row's text then depends on its
    seed alone, whatever length any round drafted. The output law stays the target's: drafting
    then verifying one token is itself an exact draw from it. Also returns whether the law
    read at a bonus position was unusable (NaN or +inf), for the step's one check.
    """
    assert isinstance(rng, PositionRandom), "coupling needs position-keyed numbers"
    full = verdict.num_accepted == draft.lengths  # [batch] rows owed a bonus token
    full_host = full.tolist()
    if not any(full_host):
        return verdict.next_tokens, False
    t0 = time.perf_counter()
    k = draft.tokens.shape[1]
    slots = torch.arange(k, device=draft.tokens.device)  # [k]
    index = (batch.seq_lens[:, None] + slots).clamp(max=batch.sequences.shape[1] - 1)  # [b, k]
    sequences = batch.sequences.scatter(1, index, draft.tokens)  # drafts written past the end
    committed = batch.seq_lens + verdict.num_accepted  # [batch]
    law = drafter.next_law(sequences, committed, full)  # [batch, vocab]
    bad = (~torch.isfinite(law).all(-1) & full).any()  # no host sync: the step checks it
    law = torch.where(full[:, None], law, 1.0 / law.shape[-1])  # other rows' laws are unused
    rng.begin_round(committed)
    token = sample_from(law, rng.draft_uniforms(0, full_host, law.device))  # [batch]
    at = verdict.num_accepted[:, None, None].expand(-1, 2, logits.shape[-1])  # [batch, 2, vocab]
    again = rule.verify(token[:, None], law[:, None], logits.gather(1, at), full.long(), rng)
    drawn = torch.where(again.num_accepted > 0, token, again.next_tokens)  # [batch]
    stats.coupling_seconds += time.perf_counter() - t0
    stats.coupling_forwards += 1
    return torch.where(full, drawn, verdict.next_tokens), bad


@torch.inference_mode()  # generator-aware: on while the loop runs, off while its consumer does
def decode(
    target: ModelBackend,
    drafter: Drafter | None,
    rule: VerificationRule,
    prompts: list[list[int]],
    cfg: DecodeConfig,
    stats: DecodeStats | None = None,
) -> Iterator[StepEvent]:
    """Run the batch to completion, yielding the tokens each step commits, row by row.

    Finished rows leave the batch (and both caches) at once. The caches belong to this call, so
    a consumer that stops early leaves nothing half-updated behind.

    Inference mode rather than `no_grad`: no tensor of the loop ever needs autograd, and
    dropping the version counters and autograd metadata of every small operation saves 6-12% of
    a pass of the small seq2seq pair on this CPU, where a pass is mostly per-operation overhead.
    """
    device = target.device
    batch = Batch(prompts, cfg, device)
    stats = stats if stats is not None else DecodeStats([RowStats() for _ in prompts])
    rng = None
    if not cfg.sampling.greedy:
        seeds = row_seed_list(len(prompts), cfg.seed, cfg.row_seeds)
        capacity = batch.sequences.shape[1]
        rng = PositionRandom(seeds, capacity, device) if cfg.coupled else RowRandom(seeds)
    target.reset(len(prompts))
    if drafter is not None:
        drafter.start(len(prompts))
    start = time.perf_counter()
    first_round = True
    pending_width = None  # the prompts: read off the device once
    before = stats.cost_figures()
    try:
        while batch.rows:
            block, figures = speculative_step(
                target, drafter, rule, batch, cfg, rng, stats, pending_width
            )
            width = block.shape[1]
            host = torch.cat([block, figures], 1).tolist()  # the round's one copy to the host
            check_finite(bool(host[0][-1]))
            block_l = [row[:width] for row in host]
            counts_l, accepted_l, drafted_l, passes_l, done_l, _ = (
                list(column) for column in zip(*(row[width:] for row in host), strict=True)
            )
            done_l = [bool(d) for d in done_l]
            if first_round:  # it holds the prefills
                stats.end_first_round(before, time.perf_counter() - start, sum(counts_l))
                first_round = False
            for i, row in enumerate(batch.rows):
                stats.rows[row].record(drafted_l[i], accepted_l[i], counts_l[i], passes_l[i])
            yield StepEvent(
                list(batch.rows), [b[:c] for b, c in zip(block_l, counts_l, strict=True)], done_l
            )
            keep = [i for i, d in enumerate(done_l) if not d]
            # the target keeps a row's accepted drafts; its next token is what it lacks
            pending_width = max((counts_l[i] - accepted_l[i] for i in keep), default=0)
            if len(keep) < len(batch.rows):
                index = batch.select(keep)
                target.select_rows(index)
                if drafter is not None:
                    drafter.select_rows(index)
                if rng is not None:
                    rng.select(keep)
    finally:
        stats.wall_seconds += time.perf_counter() - start
