"""Drafters: anything that proposes draft tokens for every row of a batch.

One protocol (`Drafter`): `start` a batch, `propose` up to `max_tokens[b]` tokens per row with
the exact distributions they were drawn from (or `None` for a deterministic drafter), hear the
committed lengths and the accepted counts through `rollback`, and drop finished rows with
`select_rows`.

`ModelDrafter` is a small causal LM that drafts autoregressively, k sequential forward passes,
with its own ragged cache. `PromptLookupDrafter` drafts with no model at all: the tokens that
followed the latest earlier occurrence of the text's last few tokens (prompt lookup decoding).

How many tokens each row drafts in a round is the job of a length policy (`length_policies`):
the constant policy fixes it up front; adaptive policies decide after every drafted position,
per row, and the round ends when every row has stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.backends.base import ModelBackend
from specdecode.core.config import PromptLookup, SamplingConfig
from specdecode.core.length_policies import DraftedPosition, LengthPolicy
from specdecode.core.sampling import RowRandom, bad_logits, logits_to_probs, sample_from


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [batch, k] (entries past lengths[b] are padding)
    probs: torch.Tensor | None  # [batch, k, vocab], the law each token was drawn from
    lengths: torch.Tensor  # [batch] tokens proposed per row, <= k
    forwards: int = 0  # batched forward passes spent on this draft
    invalid_logits: torch.Tensor | None = None  # [] bool, set when a drafter logit was NaN/+inf
    policy_seconds: float = 0.0  # time the length policy spent deciding (e.g. the head)
    row_passes: torch.Tensor | None = None  # [batch] drafter passes per row; None: one a token

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

    def rollback(
        self, lengths: torch.Tensor, num_drafted: torch.Tensor, num_accepted: torch.Tensor
    ) -> None:
        """Keep `lengths[b]` committed tokens per row; `num_accepted[b]` of the
        `num_drafted[b]` drafted tokens survived."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def add_rows(self, prompts: list[list[int]]) -> None:
        """Rows that join a running batch between rounds (their committed tokens so far)."""
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
        lm: ModelBackend,
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
        self.policy.start(batch_size, self.lm.device)

    @torch.no_grad()
    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        policy = self.policy
        limits = policy.round_limits(max_tokens)  # [batch] most tokens per row this round
        limit_list = limits.tolist()
        width = max(limit_list, default=0)
        if width == 0:
            return Draft.empty(len(limit_list), sequences.device)
        tokens, valid = self.lm.pending(sequences, seq_lens)  # [batch, n_pending]
        active = limits > 0  # [batch] rows drafting position i
        active_host = [lim > 0 for lim in limit_list]  # the same, for the per-row draws
        lengths = torch.zeros_like(limits)  # [batch]
        drafted, laws, policy_seconds = [], [], 0.0
        invalid = torch.zeros((), dtype=torch.bool, device=sequences.device)
        for i in range(width):
            logits, hidden = self.lm.forward(tokens, valid, 1, want_hidden=policy.needs_hidden)
            logits = align_vocab(logits[:, -1], self.vocab_size)  # [batch, vocab]
            invalid = invalid | bad_logits(logits)
            probs = None
            if self.sampling.greedy:
                token = logits.argmax(-1)  # [batch]
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

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        self.lm.truncate(lengths)
        self.policy.observe(num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.lm.select_rows(rows)
        self.policy.select_rows(rows)

    def add_rows(self, prompts: list[list[int]]) -> None:
        self.lm.add_rows(prompts)  # the drafter's cache catches up when the row first drafts
        self.policy.add_rows(len(prompts))


def lookup_continuation(
    text: torch.Tensor, limit: int, lookup: PromptLookup, with_ngram: bool = False
) -> torch.Tensor | tuple[torch.Tensor, int]:
    """text [length] committed tokens of one row -> [<= limit] the tokens that followed the most
    recent earlier occurrence of its last n tokens, for the largest n in
    max_ngram..min_ngram that occurs; empty if none does. `with_ngram`: also that n (0: none).

    The most recent occurrence rather than the first: a text that repeats itself (a loop
    unrolled, a list, code edited in place) is most like its latest copy.
    """
    length = text.shape[0]
    for n in range(min(lookup.max_ngram, length - 1), lookup.min_ngram - 1, -1):
        # windows[i] = text[i : i + n] for every start whose continuation is not empty
        windows = text[: length - 1].unfold(0, n, 1)  # [length - n, n]
        hits = (windows == text[length - n :]).all(-1).nonzero()  # [matches, 1]
        if hits.numel():
            start = int(hits[-1]) + n
            found = text[start : min(start + limit, length)]
            return (found, n) if with_ngram else found
    return (text[:0], 0) if with_ngram else text[:0]


def lookup_drafts(
    sequences: torch.Tensor, seq_lens: torch.Tensor, limits: list[int], lookup: PromptLookup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's `lookup_continuation` (at most limits[b] tokens), from one host copy of the
    committed texts (the round's one sync) ->
    tokens [batch, width] on the host (zero past each draft), lengths [batch] on the host."""
    lens = seq_lens.tolist()
    texts = sequences[:, : max(lens, default=0)].cpu()  # [batch, longest]
    drafts = [lookup_continuation(texts[b, : lens[b]], lim, lookup) for b, lim in enumerate(limits)]
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)  # [batch]
    width = int(lengths.max()) if drafts else 0
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)  # [batch, width]
    for b, draft in enumerate(drafts):
        tokens[b, : len(draft)] = draft
    return tokens, lengths


def check_lookup_policy(name: str) -> None:
    """Lookup drafts without a model: policies that read a drafter's law or state cannot run."""
    if name not in ("constant", "heuristic"):
        raise ValueError(
            f"prompt lookup drafts without a model, so the length policy {name!r} has no "
            "drafter law or hidden state to read; use constant or heuristic"
        )


class PromptLookupDrafter:
    """Drafts by n-gram lookup in each row's own text (`PromptLookup`); no model, no cache.

    A draft is deterministic, so it goes to verification with no law (`Draft.probs` None):
    lossless sampling then accepts a drafted token x with probability p(x) and otherwise
    resamples from the target's law without x, which keeps the output law the target's. Only
    policies that fix a round's length up front apply (`constant`, `heuristic`): the others
    read a drafter model's logits or hidden states, which there are none of.
    """

    def __init__(
        self, lookup: PromptLookup, policy: LengthPolicy, vocab_size: int, device: torch.device
    ) -> None:
        check_lookup_policy(policy.name)
        self.lookup, self.policy, self.device = lookup, policy, device
        self.vocab_size = vocab_size

    def start(self, batch_size: int) -> None:
        self.policy.start(batch_size, self.device)

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        limits = self.policy.round_limits(max_tokens).tolist()  # most tokens per row
        tokens, lengths = lookup_drafts(sequences, seq_lens, limits, self.lookup)
        lengths = lengths.to(sequences.device)
        return Draft(
            tokens.to(sequences.device),
            None,
            lengths,
            row_passes=torch.zeros_like(lengths),  # no drafter pass at all
        )

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        """[batch, vocab] a point mass on the token lookup would draft next (on the last
        committed token where nothing matches): a law a bonus token can be drawn from and
        verified against, like any drafted token's."""
        tokens, lengths = lookup_drafts(sequences, seq_lens, [1] * len(seq_lens), self.lookup)
        first = torch.nn.functional.pad(tokens, (0, 1))[:, 0].to(sequences.device)  # [batch]
        last = sequences.gather(1, (seq_lens - 1)[:, None])[:, 0]  # [batch]
        token = torch.where(lengths.to(sequences.device) > 0, first, last)
        law = torch.nn.functional.one_hot(token, self.vocab_size).float()  # [batch, vocab]
        return torch.where(rows[:, None], law, 1.0 / self.vocab_size)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        self.policy.observe(num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.policy.select_rows(rows)

    def add_rows(self, prompts: list[list[int]]) -> None:
        self.policy.add_rows(len(prompts))


class LookupFirstDrafter:
    """Prompt lookup where the text repeats itself, the drafter model everywhere else.

    Per row and round: if the text's last n tokens (n >= `lookup.min_ngram`) occurred before,
    the row drafts what followed them, at no model pass; the other rows draft with the model,
    under its length policy. A row's model cache catches up on the committed tokens the next
    time it drafts with the model (`ModelBackend.pending`). Why it pays: on the default pair's
    greedy HumanEval outputs a 3-gram recurs at a third of the positions, and lookup's drafts
    there keep 2.7 of 4 tokens, about what the model keeps anywhere (2.6), without the model's
    0.15 target steps a drafted token; replayed round by round on those outputs, +6% tokens per
    target step over the model alone (`docs/findings.md`).
    """

    def __init__(self, lookup: PromptLookup, model: ModelDrafter) -> None:
        self.lookup, self.model = lookup, model
        self.looked_up: torch.Tensor | None = None  # [batch] rows that drafted by lookup

    def start(self, batch_size: int) -> None:
        self.model.start(batch_size)

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        # a looked-up row drafts at most what the model's policy would let it this round
        limits = self.model.policy.round_limits(max_tokens).tolist()
        looked, looked_lengths = lookup_drafts(sequences, seq_lens, limits, self.lookup)
        device = sequences.device
        use = (looked_lengths > 0).to(device)  # [batch]
        self.looked_up = use
        draft = self.model.propose(sequences, seq_lens, max_tokens.masked_fill(use, 0), rng)
        found = [looked[b, :n] for b, n in enumerate(looked_lengths.tolist())]
        return merge_lookup(draft, found, use)

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        return self.model.next_law(sequences, seq_lens, rows)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        if self.looked_up is not None:  # the model's policy hears only its own rounds: a
            # looked-up row drafted nothing with the model (a heuristic k stays as it was)
            num_drafted = num_drafted.masked_fill(self.looked_up, 0)
        self.model.rollback(lengths, num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.model.select_rows(rows)
        self.looked_up = None

    def add_rows(self, prompts: list[list[int]]) -> None:
        self.model.add_rows(prompts)
        self.looked_up = None


def merge_lookup(draft: Draft, looked: list[torch.Tensor], use: torch.Tensor) -> Draft:
    """The model's draft with the rows in `use` ([batch] bool) replaced by their looked-up
    tokens (`looked[b]`, [n_b] on any device): a looked-up row's law is a point mass on its
    token, and it spent no drafter pass."""
    device = draft.tokens.device
    width = max(draft.tokens.shape[1], max((len(t) for t in looked), default=0))
    if not any(len(t) for t in looked):  # no row looked anything up (no host sync on `use`)
        return draft
    lengths = torch.tensor([len(t) for t in looked], dtype=torch.long, device=device)  # [batch]
    tokens = torch.zeros(len(looked), width, dtype=torch.long)  # [batch, width] on the host
    for b, t in enumerate(looked):
        tokens[b, : len(t)] = t
    tokens = tokens.to(device)
    padded = torch.nn.functional.pad(draft.tokens, (0, width - draft.tokens.shape[1]))
    tokens = torch.where(use[:, None], tokens, padded)  # [batch, width]
    lengths = torch.where(use, lengths, draft.lengths)  # [batch]
    probs = draft.probs  # [batch, drafted, vocab] or None
    if probs is not None:  # sampling: the looked-up rows' laws are point masses
        probs = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]))
        point = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs.dtype)
        probs = torch.where(use[:, None, None], point, probs)
    passes = draft.row_passes if draft.row_passes is not None else draft.lengths
    return Draft(
        tokens,
        probs,
        lengths,
        draft.forwards,
        draft.invalid_logits,
        draft.policy_seconds,
        row_passes=passes.masked_fill(use, 0),
    )
