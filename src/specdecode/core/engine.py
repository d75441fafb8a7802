"""The decoding loop: one speculative step, repeated until every row has stopped.

`speculative_step` is Leviathan et al. (2023), Alg. 1 and Chen et al. (2023), batched: the drafter
proposes up to k tokens per row, the target scores the k + 1 positions of every row in one
forward pass, the verification rule decides per row how many to keep, and both caches are rolled
back per row by bookkeeping (each backend's `truncate`). Plain autoregressive decoding is the same
step with no drafter: same cache, same sampling code, so every speedup is measured against a
fair baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.backends.base import ModelBackend
from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.drafting.base import Draft, Drafter
from specdecode.core.sampling import (
    InvalidLogitsError,
    PositionRandom,
    RowRandom,
    RowSampling,
    bad_rows,
    greedy_tokens,
    law_scales,
    row_seed_list,
    sample_from,
)
from specdecode.core.stats import DecodeStats, RowStats
from specdecode.core.verification import (
    GreedyRule,
    LosslessSamplingRule,
    Verdict,
    VerificationRule,
    make_rule,
)


@dataclass(frozen=True)
class StepEvent:
    """Tokens committed in one step, for the rows (original prompt indices) that got some."""

    rows: list[int]
    new_tokens: list[list[int]]
    finished: list[bool]


@dataclass(frozen=True)
class RowRequest:
    """One row to decode: its prompt ids, budget, law, seed and the ids that end it."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # which earlier rows' cached prefixes this row may reuse: only those of the same partition
    # (a server's clients stay apart: none learns from a reused prefix what another sent)
    cache_partition: str = ""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a row needs at least one prompt token")
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class RowUpdate:
    """What one round did for one row (`DecodeLoop.step`)."""

    key: int  # the row's key, from `DecodeLoop.add`
    tokens: list[int]  # committed this round (none while its prompt is still being fed)
    finished: bool  # ended (a stop id or its budget): it has left the batch
    drafted: int  # tokens drafted for it this round (0: a plain step)
    accepted: int  # of them, accepted
    reused: int = 0  # prompt tokens its cache already held (on the row's first update)


class RowFailed(RuntimeError):
    """Rows could not be decoded: they have left the batch and both models (their sequences
    freed), and the others go on. `reasons[key]`: why each row failed. `updates`: what the
    round did for the other rows, the answer `step` would have given: their tokens do not
    depend on the failed rows (each row's verdict reads its own logits), so they stand."""

    def __init__(self, reasons: dict[int, Exception], updates: Sequence[RowUpdate] = ()) -> None:
        super().__init__("; ".join(f"row {key}: {why}" for key, why in reasons.items()))
        self.reasons = dict(reasons)
        self.updates = list(updates)

    @property
    def keys(self) -> list[int]:
        return list(self.reasons)


UNUSABLE = (
    "a model's logits for this row were NaN or +inf (or all -inf), or its temperature is too "
    "small for float32 (its law overflows); check the weights and dtype (fp16 overflow is a "
    "common cause)"
)


@dataclass
class HostRows:
    """The running rows' ends on the host, for a run of plain rounds (`Batch.on_host`): lists
    per row, and the tokens those rounds took, not yet in the batch's tensors."""

    last: list[int]  # each row's last committed token: what its target cache lacks
    lens: list[int]  # committed tokens
    left: list[int]  # tokens it may still take
    stops: list[set[int]]  # the ids that end it
    added: list[list[int]]  # taken since the tensors were last written, one per round

    def select(self, keep: list[int]) -> None:
        for name in ("last", "lens", "left", "stops", "added"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])


class Batch:
    """Committed tokens of the rows running, in one padded buffer, with their budgets and ends.

    `capacity` is the longest row (prompt, new tokens and a round's drafts); rows join
    (`add`) and leave (`select`) between rounds. A run of plain rounds keeps them on the host
    (`on_host`, `append`) and writes its tokens into the tensors when anything else needs them
    (`sync`)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.sequences = torch.zeros(0, capacity, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(0, dtype=torch.long, device=device)  # [batch]
        self.budget = torch.zeros(0, dtype=torch.long, device=device)  # tokens still allowed
        self.stop_ids = torch.full((0, 1), -1, dtype=torch.long, device=device)  # [batch, s]
        self.rows: list[int] = []  # the key of each running row
        self.host: HostRows | None = None

    def on_host(self) -> HostRows:
        """The rows on the host, read off the tensors at the first plain round of a run."""
        if self.host is None:
            last = self.sequences.gather(1, self.seq_lens[:, None] - 1)[:, 0]  # [batch]
            host = torch.stack([last, self.seq_lens, self.budget]).tolist()  # [3, batch]
            stops = [set(ids) - {-1} for ids in self.stop_ids.tolist()]
            self.host = HostRows(*host, stops, [[] for _ in self.rows])
        return self.host

    def append(self, tokens: list[int]) -> list[bool]:
        """`commit` for a plain round (nothing drafted, every row ready), on the host: each row
        takes its one next token; a running row always has budget left for it. -> done."""
        host = self.on_host()
        done = []
        for b, token in enumerate(tokens):
            host.added[b].append(token)
            host.last[b], host.lens[b], host.left[b] = token, host.lens[b] + 1, host.left[b] - 1
            done.append(host.left[b] == 0 or token in host.stops[b])
        return done

    def sync(self) -> None:
        """Write the tokens of the plain rounds since the last write into the tensors."""
        host, self.host = self.host, None
        if host is None or not host.added or not host.added[0]:
            return
        added = torch.tensor(host.added, device=self.device)  # [batch, n]
        n = added.shape[1]
        index = self.seq_lens[:, None] + torch.arange(n, device=self.device)  # [batch, n]
        self.sequences.scatter_(1, index, added)
        self.seq_lens = self.seq_lens + n
        self.budget = self.budget - n

    def add(self, keys: list[int], requests: list[RowRequest]) -> None:
        self.sync()
        capacity = self.sequences.shape[1]
        rows = torch.zeros(len(requests), capacity, dtype=torch.long)
        for i, r in enumerate(requests):
            rows[i, : len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
        width = max([self.stop_ids.shape[1], *(len(r.stop_token_ids) for r in requests)])
        stops = torch.full((len(requests), width), -1, dtype=torch.long)
        for i, r in enumerate(requests):
            stops[i, : len(r.stop_token_ids)] = torch.tensor(r.stop_token_ids, dtype=torch.long)
        grown = torch.nn.functional.pad(
            self.stop_ids, (0, width - self.stop_ids.shape[1]), value=-1
        )
        self.sequences = torch.cat([self.sequences, rows.to(self.device)])
        lens = torch.tensor([len(r.prompt) for r in requests], device=self.device)
        self.seq_lens = torch.cat([self.seq_lens, lens])
        budget = torch.tensor([r.max_new_tokens for r in requests], device=self.device)
        self.budget = torch.cat([self.budget, budget])
        self.stop_ids = torch.cat([grown, stops.to(self.device)])
        self.rows += keys

    def commit(
        self, draft: Draft, num_accepted: torch.Tensor, next_tokens: torch.Tensor, ready
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append accepted draft tokens and the next token of every ready row ([batch] bool);
        cut at a stop id or the budget. -> block [batch, k + 1], counts, done [batch]."""
        k = draft.tokens.shape[1]
        block = torch.cat([draft.tokens, torch.zeros_like(next_tokens)[:, None]], 1)  # [b, k+1]
        block = block.scatter(1, num_accepted[:, None], next_tokens[:, None])
        counts = (num_accepted + 1) * ready  # [batch]: none for a row still being fed
        slots = torch.arange(k + 1, device=block.device)  # [k + 1]
        is_stop = (block[:, :, None] == self.stop_ids[:, None, :]).any(-1)  # [batch, k + 1]
        is_stop = is_stop & (slots < counts[:, None])
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
        if self.host is not None:  # the run of plain rounds goes on with the rows kept
            self.host.select(keep)
        index = torch.tensor(keep, dtype=torch.long, device=self.sequences.device)
        self.sequences, self.seq_lens, self.budget, self.stop_ids = (
            t.index_select(0, index)
            for t in (self.sequences, self.seq_lens, self.budget, self.stop_ids)
        )
        self.rows = [self.rows[i] for i in keep]
        return index


@dataclass(frozen=True)
class Round:
    """What `speculative_step` did, per row ([batch] each unless said)."""

    block: torch.Tensor  # [batch, k + 1] drafted tokens with the next token at `accepted`
    counts: torch.Tensor  # tokens committed
    accepted: torch.Tensor  # drafted tokens accepted
    drafted: torch.Tensor  # tokens drafted
    passes: torch.Tensor  # drafter passes spent on the row
    done: torch.Tensor  # the row ended
    ready: torch.Tensor  # the row's prompt was all in the target's cache (it took part)
    fed: torch.Tensor  # tokens the target's pass took for the row
    invalid: torch.Tensor  # a model's logits, or the row's law, were unusable

    def to_host(self) -> HostRound:
        """Everything the loop reads, in the round's one copy to the host."""
        width = self.block.shape[1]
        columns = [
            self.counts, self.accepted, self.drafted, self.passes, self.done, self.ready, self.fed,
            self.invalid,
        ]  # fmt: skip
        figures = torch.stack([c.long() for c in columns], 1)  # [batch, 8]
        host = torch.cat([self.block, figures], 1).tolist()
        cols = list(zip(*(row[width:] for row in host), strict=True)) or [()] * 8
        return HostRound([row[:width] for row in host], *(list(c) for c in cols))


@dataclass(frozen=True)
class HostRound:
    """A `Round` on the host: lists per row."""

    block: list[list[int]]
    counts: list[int]
    accepted: list[int]
    drafted: list[int]
    passes: list[int]
    done: list[int]
    ready: list[int]
    fed: list[int]
    invalid: list[int]


@dataclass(frozen=True)
class Proposal:
    """A round begun (`propose`): what the target's pass feeds each row up to, which rows take
    part, the draft, and when the round began."""

    seq_lens: torch.Tensor  # [batch] committed tokens, or a prefilling row's next chunk's end
    ready: torch.Tensor  # [batch] bool: the row's prompt is all in the target's cache
    draft: Draft
    began: float


def propose(
    target: ModelBackend,
    drafter: Drafter | None,
    batch: Batch,
    cfg: DecodeConfig,
    rng: RowRandom | None,
    prefill_chunk: int | None = None,
) -> Proposal:
    """Begin a round: the batch's tensors current, the random numbers started, the drafter
    asked for up to `max_draft_tokens` per ready row where it drafts at this batch size.

    A row whose prompt is longer than `prefill_chunk` tokens still to feed gets its next chunk
    in this round's pass and nothing else (not ready): a long prompt joining a running batch
    holds the other rows up a chunk at a time."""
    began = time.perf_counter()
    batch.sync()
    if rng is not None:
        rng.begin_round(batch.seq_lens)  # position-keyed numbers start at each row's length
    seq_lens = batch.seq_lens  # [batch]
    ready = torch.ones_like(seq_lens, dtype=torch.bool)
    if prefill_chunk is not None:
        held = target.lengths.to(seq_lens.device)
        ready = seq_lens - held <= prefill_chunk
        seq_lens = torch.where(ready, seq_lens, held + prefill_chunk)  # what this pass feeds
    max_draft = (batch.budget - 1).clamp(max=cfg.max_draft_tokens) * ready  # +1 comes free
    # a plain round otherwise: the drafter catches up on its tokens when it drafts again
    drafting = drafter is not None and cfg.drafts_at(len(batch.rows))
    draft = (
        drafter.propose(batch.sequences, seq_lens, max_draft, rng)
        if drafting
        else Draft.empty(len(batch.rows), batch.sequences.device)
    )
    return Proposal(seq_lens, ready, draft, began)


def speculative_step(
    target: ModelBackend,
    drafter: Drafter | None,
    rule: VerificationRule,
    batch: Batch,
    cfg: DecodeConfig,
    rng: RowRandom | None,
    stats: DecodeStats,
    pending_width: int | None = None,
    prefill_chunk: int | None = None,
    scales: torch.Tensor | None = None,
    proposal: Proposal | None = None,
) -> Round:
    """One round for every running row: draft, verify in one target pass, roll back, commit.

    `pending_width`: how many committed tokens the target's cache lacks at most, where the
    caller knows it on the host. `scales`: [batch] each row's temperature (`law_scales`; None:
    every row greedy), for the check of its law. `proposal`: the round, where the caller began
    it (`propose`) to see its draft first.
    """
    proposal = proposal or propose(target, drafter, batch, cfg, rng, prefill_chunk)
    seq_lens, ready, draft = proposal.seq_lens, proposal.ready, proposal.draft
    if prefill_chunk is not None:
        pending_width = None
    t1 = time.perf_counter()
    pending, pending_valid = target.pending(batch.sequences, seq_lens, width=pending_width)
    k = draft.tokens.shape[1]
    draft_valid = torch.arange(k, device=draft.lengths.device) < draft.lengths[:, None]
    logits, _ = target.forward(
        torch.cat([pending, draft.tokens], 1),
        torch.cat([pending_valid, draft_valid], 1),
        logits_to_keep=k + 1,
    )  # logits: [batch, k + 1, vocab]
    invalid = bad_rows(logits, scales)  # [batch]
    if draft.invalid_logits is not None:
        invalid = invalid | draft.invalid_logits
    verdict = rule.verify(draft.tokens, draft.probs, logits, draft.lengths, rng)
    committed = torch.where(ready, seq_lens + verdict.num_accepted, seq_lens)  # [batch]
    target.truncate(committed)
    if drafter is not None:
        drafter.rollback(committed, draft.lengths, verdict.num_accepted)
    next_tokens = verdict.next_tokens  # [batch]
    if cfg.coupled and drafter is not None:
        next_tokens, bad = coupled_next_tokens(drafter, rule, batch, draft, verdict, logits, rng,
                                               stats)  # fmt: skip
        invalid = invalid | bad
    block, counts, done = batch.commit(draft, verdict.num_accepted, next_tokens, ready)
    stats.verify_seconds += time.perf_counter() - t1
    stats.target_passes += 1
    stats.heard(t1 - proposal.began, draft.policy_seconds, draft.passes)
    passes = draft.row_passes if draft.row_passes is not None else draft.lengths  # [batch]
    accepted = torch.minimum(verdict.num_accepted, draft.lengths)
    fed = pending_valid.sum(1) + draft.lengths  # [batch]
    return Round(block, counts, accepted, draft.lengths, passes, done & ready, ready, fed, invalid)


def plain_step(
    target: ModelBackend,
    rule: VerificationRule,
    batch: Batch,
    rng: RowRandom | None,
    stats: DecodeStats,
    scales: torch.Tensor | None = None,
    drafter: Drafter | None = None,
    proposal: Proposal | None = None,
) -> HostRound:
    """`speculative_step` with nothing to draft, for rows whose target caches lack only their
    last token: one pass of one token per row, and the rule's verdict on an empty draft.

    Why a second path: on a CPU, right after a pass has streamed the weights through the
    caches, each distinct tensor op costs tens of microseconds whatever its size, and the
    general round's (the pending block, the drafted masks, the commit over k + 1 slots, the
    round's figures stacked for the host) added up to a few per cent of a small model's step
    (docs/findings.md, the plain path). This one keeps the rows on the host (`Batch.on_host`)
    and reads the logits where the target left them. The greedy verdict is the argmax;
    another rule gets the empty draft, so a seeded row draws the numbers it would draw in
    the general round and writes the same text. `drafter` hears the round as the general
    round tells it (`rollback`, nothing drafted: a drafter that files each pass's states keeps
    them); `proposal`: the round it began (`propose`), whose draft came back empty.
    """
    t0 = time.perf_counter()
    rows = batch.on_host()
    # what the drafter hears (committed, and nothing drafted), made before the pass (a tensor
    # op made right after one costs tens of microseconds): the round's own lengths, or the
    # rows' lengths before its token
    committed = none_drafted = None  # [batch] each
    if drafter is not None:
        committed = (
            proposal.seq_lens
            if proposal is not None
            else torch.tensor(rows.lens, device=batch.device)
        )
        none_drafted = torch.zeros_like(committed)
    logits = target.step_logits(rows.last)  # [batch, vocab], valid until the target's next pass
    if isinstance(rule, GreedyRule) and scales is None:
        tokens, invalid = greedy_tokens(logits)
    else:
        if rng is not None and proposal is None:  # `propose` began the numbers
            rng.begin_round(torch.tensor(rows.lens, device=logits.device))
        view = logits[:, None]  # [batch, 1, vocab]
        none = torch.zeros(len(rows.last), 0, dtype=torch.long, device=logits.device)
        verdict = rule.verify(none, None, view, none.sum(1), rng)
        figures = [verdict.next_tokens, bad_rows(view, scales).long()]
        tokens, invalid = torch.stack(figures).tolist()  # [2, batch]
    done = batch.append(tokens)
    if proposal is not None:
        draft = proposal.draft
        stats.heard(t0 - proposal.began, draft.policy_seconds, draft.passes)
    if committed is not None:
        drafter.rollback(committed, none_drafted, none_drafted)
    stats.verify_seconds += time.perf_counter() - t0
    stats.target_passes += 1
    ones, zeros = [1] * len(tokens), [0] * len(tokens)
    return HostRound([[t] for t in tokens], ones, zeros, zeros, zeros, done, ones, ones, invalid)


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
    rows ([batch] bool) whose law read at a bonus position was unusable (NaN or +inf).
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
    bad = ~torch.isfinite(law).all(-1) & full  # [batch] no host sync: the step checks it
    law = torch.where(full[:, None], law, 1.0 / law.shape[-1])  # other rows' laws are unused
    rng.begin_round(committed)
    token = sample_from(law, rng.draft_uniforms(0, full_host, law.device))  # [batch]
    at = verdict.num_accepted[:, None, None].expand(-1, 2, logits.shape[-1])  # [batch, 2, vocab]
    again = rule.verify(token[:, None], law[:, None], logits.gather(1, at), full.long(), rng)
    drawn = torch.where(again.num_accepted > 0, token, again.next_tokens)  # [batch]
    stats.coupling_seconds += time.perf_counter() - t0
    stats.coupling_passes += 1
    return torch.where(full, drawn, verdict.next_tokens), bad


class DecodeLoop:
    """The engine's loop, stepped one round at a time from outside.

    `add` queues a row; it joins the running batch at the next `step`, which runs one
    `speculative_step` over every running row and returns what each got. Rows leave when they
    end or are cancelled. `generate` runs this loop to the end over a fixed set of rows; a
    server steps it while requests come and go.

    Two ways rows join. `joins=False`: rows are admitted only into an empty batch, which
    starts anew (`reset`): a fixed batch, as every backend supports (the captured one too).
    `joins=True`: the batch is made once with room for `max_rows` rows, and rows join between
    rounds (`add_rows`), on backends that keep a prefix their cells already hold.

    `rule`: the verification rule; None picks one per round from the running rows' laws
    (greedy when every row is greedy, the lossless sampling rule otherwise), since rows of a
    server ask for different laws. `sampling` is the rows' laws, shared with the drafter.
    """

    def __init__(
        self,
        target: ModelBackend,
        drafter: Drafter | None,
        cfg: DecodeConfig,
        *,
        sampling: RowSampling,
        rule: VerificationRule | None = None,
        stats: DecodeStats | None = None,
        max_rows: int = 1,
        capacity: int | None = None,
        joins: bool = False,
        prefill_chunk: int | None = None,
        observe: Callable[[list[int], int, float], object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(
                f"prefill_chunk must be >= 1 (None: whole prompts), not {prefill_chunk}"
            )
        if joins and cfg.coupled:
            raise ValueError("coupled randomness runs fixed batches: use joins=False")
        self.target, self.drafter, self.cfg, self.rule = target, drafter, cfg, rule
        self.sampling, self.max_rows, self.joins = sampling, max_rows, joins
        self.prefill_chunk, self.observe, self.clock = prefill_chunk, observe, clock
        # without a given rule, each round's rows pick one: greedy, or lossless sampling over
        # the rows' laws (`sampling` is kept in step with the rows, so one object serves)
        self.rules = {
            True: make_rule(None, SamplingConfig()),
            False: LosslessSamplingRule(sampling),
        }
        self.stats = stats if stats is not None else DecodeStats([])
        self.capacity = capacity
        self.waiting: list[tuple[int, RowRequest]] = []
        self.cancelled: set[int] = set()
        self.next_key = 0  # rows of `stats` given up front are the first keys' (a fixed batch)
        self.rng: RowRandom | None = None
        self.pending_width: int | None = None
        self.first_round = True
        # the last round fed no prompt tokens and kept every row: a decoding round, what
        # drafting's judge weighs and what a study of decoding speed times
        self.decoding = False
        self.batch = Batch(self._capacity(), target.device)
        if joins:  # room for max_rows rows, made once, then emptied for rows to join
            self._empty_models()

    def _capacity(self, requests: list[RowRequest] = ()) -> int:
        if self.capacity is not None:
            return self.capacity
        longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=0)
        return longest + self.cfg.row_slack

    def __len__(self) -> int:
        return len(self.batch.rows) + len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.batch.rows)

    def add(self, request: RowRequest) -> int:
        """Queue a row; it joins at the next round. Returns its key."""
        if (
            self.capacity is not None
            and len(request.prompt) + request.max_new_tokens + self.cfg.row_slack > self.capacity
        ):
            raise ValueError(
                f"a prompt of {len(request.prompt)} tokens and {request.max_new_tokens} new ones "
                f"do not fit a row of {self.capacity - self.cfg.row_slack} tokens"
            )
        key = self.next_key
        self.next_key += 1
        self.waiting.append((key, request))
        if key >= len(self.stats.rows):
            self.stats.rows.append(RowStats())
        return key

    def cancel(self, key: int) -> None:
        """The row leaves before the next round (its cache cells are freed or kept for reuse)."""
        if any(k == key for k, _ in self.waiting):
            self.waiting = [(k, r) for k, r in self.waiting if k != key]
        elif key in self.batch.rows:
            self.cancelled.add(key)

    def reset(self) -> None:
        """Drop every row and start both models' caches anew: after a failure the state of the
        round is not to be trusted, and a row may have been half admitted (in one model and
        not the other, or in neither and not the batch), which dropping the batch's rows would
        leave behind."""
        self.waiting, self.cancelled = [], set()
        self.batch = Batch(self._capacity(), self.target.device)
        self.sampling.configs = []
        self.pending_width = None
        self._empty_models()

    def _empty_models(self) -> None:
        """Both models with no row, room made for `max_rows` where rows join a running batch."""
        rows = self.max_rows if self.joins else 0
        none = torch.zeros(0, dtype=torch.long, device=self.target.device)
        self.target.reset(rows)
        self.target.select_rows(none)
        if self.drafter is not None:
            self.drafter.start(rows)
            self.drafter.select_rows(none)
        self.rng = RowRandom([])

    def _admit(self) -> dict[int, int]:
        """Move waiting rows into the batch, up to `max_rows`. -> reused prompt tokens by key."""
        room = self.max_rows - len(self.batch.rows)
        if not self.waiting or room <= 0 or (not self.joins and self.batch.rows):
            return {}
        taken, self.waiting = self.waiting[:room], self.waiting[room:]
        keys, requests = [k for k, _ in taken], [r for _, r in taken]
        prompts = [list(r.prompt) for r in requests]
        partitions = [r.cache_partition for r in requests]
        seeds = [r.seed if r.seed is not None else fresh_seed() for r in requests]
        if self.joins:
            reused = self.target.add_rows(prompts, partitions)
            if self.drafter is not None:
                self.drafter.add_rows(prompts, partitions)
            self.rng.add_rows(seeds)
            self.sampling.add_rows([r.sampling for r in requests])
        else:
            self.batch = Batch(self._capacity(requests), self.target.device)
            self.target.reset(len(requests))
            if self.drafter is not None:
                self.drafter.start(len(requests))
            reused = [0] * len(requests)
            self.sampling.configs = [r.sampling for r in requests]
            if self.cfg.coupled:
                self.rng = PositionRandom(seeds, self.batch.sequences.shape[1], self.target.device)
            else:
                self.rng = RowRandom(seeds)
        self.batch.add(keys, requests)
        self.pending_width = None  # the new prompts: read off the device once
        return dict(zip(keys, reused, strict=True))

    def _drop(self, keep: list[int]) -> None:
        index = self.batch.select(keep)
        self.target.select_rows(index)
        if self.drafter is not None:
            self.drafter.select_rows(index)
        if self.rng is not None:
            self.rng.select(keep)
        self.sampling.select(keep)

    def _round(self, rule: VerificationRule, rng: RowRandom | None, scales) -> HostRound:
        """One round on the path it needs. Rows whose target caches lack only their last token
        run `plain_step` where nothing is drafted: no drafter, a batch past `max_draft_batch`,
        a drafter resting, or a draft that came back empty. Prompts being fed, drafts, and
        coupled randomness (which draws a plain round's token through the drafter's law) take
        `speculative_step`."""
        target, drafter, batch, cfg = self.target, self.drafter, self.batch, self.cfg
        if self.pending_width != 1 or cfg.coupled:
            return speculative_step(
                target, drafter, rule, batch, cfg, rng, self.stats, self.pending_width,
                self.prefill_chunk, scales,
            ).to_host()  # fmt: skip
        if drafter is None or not cfg.drafts_at(len(batch.rows)) or drafter.rests():
            return plain_step(target, rule, batch, rng, self.stats, scales, drafter)
        proposal = propose(target, drafter, batch, cfg, rng, self.prefill_chunk)
        if proposal.draft.tokens.shape[1] == 0:
            return plain_step(target, rule, batch, rng, self.stats, scales, drafter, proposal)
        return speculative_step(
            target, drafter, rule, batch, cfg, rng, self.stats, 1, self.prefill_chunk, scales,
            proposal,
        ).to_host()  # fmt: skip

    @torch.inference_mode()
    def step(self) -> list[RowUpdate]:
        """One round over every running row (rows queued since the last one join first).

        A row whose logits or law came out unusable leaves the batch and both models in this
        round and `RowFailed` names it, with the updates of the others, which go on: a fault of
        one row fails that row alone. An error of the round as a whole propagates; `reset`
        then starts the loop anew."""
        if self.cancelled:
            self._drop([i for i, k in enumerate(self.batch.rows) if k not in self.cancelled])
            self.cancelled = set()
        reused = self._admit()
        if not self.batch.rows:
            return []
        greedy = self.sampling.greedy
        rule = self.rule or self.rules[greedy]
        start = self.clock()
        before = self.stats.cost_figures()
        rng = None if greedy else self.rng
        scales = None if greedy else law_scales(self.sampling, self.running, self.target.device)
        # a round that feeds prompt tokens (the first, one a row joins in, each chunk of a long
        # prompt up to its last) begins with the width the target lacks not known
        feeds = self.pending_width is None
        try:
            host = self._round(rule, rng, scales)
        finally:
            self.stats.wall_seconds += self.clock() - start
        seconds = self.clock() - start
        failed = [k for k, bad in zip(self.batch.rows, host.invalid, strict=True) if bad]
        self.decoding = not feeds and not failed
        if self.observe is not None and self.decoding:
            # a decoding round (no prompt tokens in it): what it took, for drafting's judge
            self.observe(host.fed, sum(host.counts), seconds)
        if self.first_round and any(host.ready):  # it holds the prefills
            self.stats.end_first_round(before, self.clock() - start, sum(host.counts))
            self.first_round = False
        updates = []
        for i, key in enumerate(self.batch.rows):
            if host.invalid[i]:
                continue
            if host.ready[i]:
                self.stats.rows[key].record(
                    host.drafted[i], host.accepted[i], host.counts[i], host.passes[i]
                )
            updates.append(RowUpdate(
                key, host.block[i][: host.counts[i]], bool(host.done[i]), host.drafted[i],
                min(host.accepted[i], host.counts[i]), reused.get(key, 0),
            ))  # fmt: skip
        ended = zip(host.done, host.invalid, strict=True)
        keep = [i for i, (done, bad) in enumerate(ended) if not (done or bad)]
        # the target keeps a row's accepted drafts; its next token is what it lacks
        self.pending_width = max(
            (host.counts[i] - host.accepted[i] for i in keep if host.ready[i]), default=0
        )
        if not all(host.ready[i] for i in keep):
            self.pending_width = None
        if len(keep) < len(self.batch.rows):
            self._drop(keep)
        if failed:
            raise RowFailed({key: InvalidLogitsError(UNUSABLE) for key in failed}, updates)
        return updates


def fresh_seed() -> int:
    """A seed for a row that was given none."""
    return int(torch.randint(0, 2**62, ()))


def decode(
    target: ModelBackend,
    drafter: Drafter | None,
    rule: VerificationRule,
    prompts: list[list[int]],
    cfg: DecodeConfig,
    stats: DecodeStats | None = None,
    sampling: RowSampling | None = None,
    observe: Callable[[list[int], int, float], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[StepEvent]:
    """Run a fixed batch to completion on `DecodeLoop`, yielding what each round commits.

    Finished rows leave the batch (and both caches) at once. The caches belong to this call, so
    a consumer that stops early leaves nothing half-updated behind.
    """
    stats = stats if stats is not None else DecodeStats([RowStats() for _ in prompts])
    seeds = (
        row_seed_list(len(prompts), cfg.seed, cfg.row_seeds)
        if not cfg.sampling.greedy
        else [None] * len(prompts)
    )
    loop = DecodeLoop(
        target, drafter, cfg, sampling=sampling or RowSampling(), rule=rule, stats=stats,
        max_rows=max(len(prompts), 1), observe=observe, clock=clock,
    )  # fmt: skip
    for prompt, seed in zip(prompts, seeds, strict=True):
        loop.add(RowRequest(prompt, cfg.max_new_tokens, cfg.sampling, seed, cfg.stop_token_ids))
    while len(loop):
        try:
            updates = loop.step()
        except RowFailed as failed:  # the caller asked for every row of a fixed batch
            raise next(iter(failed.reasons.values())) from failed
        shown = [u for u in updates if u.tokens or u.finished]
        if shown:
            yield StepEvent(
                [u.key for u in shown], [u.tokens for u in shown], [u.finished for u in shown]
            )
