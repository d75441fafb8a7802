"""Cost-aware drafting: draft only as far as it pays at this machine's prices, per row and round.

Why: whether a drafted token pays depends on the machine as much as on the drafter. On a 2-core
CPU running the 4-bit default pair on llama.cpp, a verify pass grows about half a plain step per
token and the 0.5B drafter's step costs 0.62 of the target's, so model drafts lose at batch 1
whatever their acceptance, while a prompt-lookup draft (no model pass) pays where it is right
more than half the time; at batch 8 a pass costs about a row's token each, and short drafts pay
far more readily. A policy that drafts blindly loses to plain decoding on such a machine; this
one plans every round from the measured `Prices` and the acceptance each source has had.

Each round, every row gets a source: lookup where its text's last n tokens occurred before
(`PromptLookup`), else the drafter model (if any). Expected tokens of a row drafting k with
per-token acceptance a are 1 + a + ... + a^k; the round's cost is the target's pass over all
rows' tokens plus one drafter pass per drafted position over the model rows drafting it. Tokens
are added one at a time where they add the most expected tokens per added cost, and the round
keeps the allocation with the most expected tokens per unit of cost seen along the way, which
is no drafting at all (a plain step) when nothing pays. Acceptance is estimated online: per row
for the model, per match length for lookup (matches of 3 tokens are right far more often than
matches of 1), with counts that decay so the estimate follows the text; a source that was not
tried for a while drifts back to its prior and is tried again.

A plan only chooses how many tokens are drafted, never which, so outputs stay exact under
greedy decoding and the sampled law stays the target's (the lengths are a stopping time).
"""

from __future__ import annotations

import torch

from specdecode.core.config import PromptLookup
from specdecode.core.drafters import Draft, ModelDrafter, lookup_continuation, merge_lookup
from specdecode.core.prices import Prices

PRIOR = (3.0, 1.0)  # pseudo-counts (kept, rejected): a source starts at 0.75 and is tried
MEMORY = 0.8  # weight of the past in each update: about the last five rounds count


class Acceptance:
    """Decaying kept / rejected counts of drafted tokens, for a set of keys (rows, n-grams)."""

    def __init__(self, size: int) -> None:
        self.kept = [PRIOR[0]] * size
        self.rejected = [PRIOR[1]] * size

    def rate(self, key: int) -> float:
        return self.kept[key] / (self.kept[key] + self.rejected[key])

    def observe(self, key: int, drafted: int, accepted: int) -> None:
        """Tokens are judged in order until the first rejection: `accepted` kept, then one
        rejected unless every drafted token was kept (the estimator of a per-token rate)."""
        self.kept[key] = MEMORY * self.kept[key] + accepted
        self.rejected[key] = MEMORY * self.rejected[key] + (accepted < drafted)

    def relax(self, key: int) -> None:
        """No drafts this round: drift back toward the prior, so the source is tried again."""
        self.kept[key] = MEMORY * self.kept[key] + (1 - MEMORY) * PRIOR[0]
        self.rejected[key] = MEMORY * self.rejected[key] + (1 - MEMORY) * PRIOR[1]

    def select(self, rows: list[int]) -> None:
        self.kept = [self.kept[b] for b in rows]
        self.rejected = [self.rejected[b] for b in rows]


def plan_lengths(
    rates: list[float], caps: list[int], uses_model: list[bool], prices: Prices
) -> list[int]:
    """Tokens to draft per row this round: the allocation with the most expected committed
    tokens per unit of cost, grown a token at a time where it gains the most per its cost."""
    batch = len(rates)

    def drafter_pass(rows: int) -> float:
        return (prices.draft_cost(rows) or 0.0) if rows else 0.0

    k = [0] * batch
    depth_rows = [0] * (max(caps, default=0) + 2)  # model rows drafting position i (1-based)
    tokens = batch
    expected = float(batch)
    cost = prices.pass_cost(batch, tokens)
    best, best_ratio = list(k), expected / cost
    while True:
        pick, pick_score, pick_cost = -1, 0.0, 0.0
        # the same for every row
        grown = prices.pass_cost(batch, tokens + 1) - prices.pass_cost(batch, tokens)
        for b in range(batch):
            if k[b] >= caps[b]:
                continue
            added = grown
            if uses_model[b]:
                rows = depth_rows[k[b] + 1]  # one more row in the drafter's pass at this depth
                added += drafter_pass(rows + 1) - drafter_pass(rows)
            gain = rates[b] ** (k[b] + 1)
            score = gain / max(added, 1e-9)
            if score > pick_score:
                pick, pick_score, pick_cost = b, score, added
        if pick < 0:
            return best
        expected += rates[pick] ** (k[pick] + 1)
        cost += pick_cost
        tokens += 1
        k[pick] += 1
        if uses_model[pick]:
            depth_rows[k[pick]] += 1
        if expected / cost > best_ratio:
            best, best_ratio = list(k), expected / cost


class PricedDrafter:
    """Lookup where the text repeats, the drafter model elsewhere, each as far as it pays.

    `model` may be None (lookup alone). The model drafts under a constant policy of at most
    `max_tokens`; this class tells it, per row, how many to draft.
    """

    def __init__(
        self,
        lookup: PromptLookup,
        model: ModelDrafter | None,
        prices: Prices,
        max_tokens: int,
    ) -> None:
        if model is not None and prices.draft_cost(1) is None:
            raise ValueError("pricing a drafter model's rounds needs its step's price")
        self.lookup, self.model, self.prices, self.max_tokens = lookup, model, prices, max_tokens
        self.by_ngram = Acceptance(lookup.max_ngram + 1)  # lookup acceptance by match length
        self.by_row = Acceptance(0)  # the model's acceptance, per row
        self.round: tuple[list[int], list[int]] | None = None  # (source n-gram or 0, drafted)

    def start(self, batch_size: int) -> None:
        self.by_row = Acceptance(batch_size)
        if self.model is not None:
            self.model.start(batch_size)

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        budget = max_tokens.clamp(max=self.max_tokens).tolist()
        lens = seq_lens.tolist()
        texts = sequences[:, : max(lens, default=0)].cpu()  # [batch, longest] the round's copy
        found = [
            lookup_continuation(texts[b, : lens[b]], budget[b], self.lookup, with_ngram=True)
            for b in range(len(lens))
        ]
        ngram = [n for _, n in found]  # 0: no match, the model drafts (if there is one)
        has_model = self.model is not None
        rates = [self.by_ngram.rate(n) if n else self.by_row.rate(b) for b, n in enumerate(ngram)]
        caps = [len(c) if n else (budget[b] if has_model else 0) for b, (c, n) in enumerate(found)]
        plan = plan_lengths(rates, caps, [n == 0 and has_model for n in ngram], self.prices)
        self.round = (ngram, plan)
        device = sequences.device
        use = torch.tensor([n > 0 for n in ngram], device=device)  # [batch] lookup rows
        model_k = [0 if n else k for n, k in zip(ngram, plan, strict=True)]
        if has_model and max(model_k, default=0) > 0:
            draft = self.model.propose(
                sequences, seq_lens, torch.tensor(model_k, device=device), rng
            )
        else:
            draft = Draft.empty(len(lens), device)
        looked = [c[:k] if n else c[:0] for (c, n), k in zip(found, plan, strict=True)]
        return merge_lookup(draft, looked, use)

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        if self.model is None:
            raise ValueError("coupled sampling with the priced policy needs a drafter model")
        return self.model.next_law(sequences, seq_lens, rows)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        if self.round is None:  # a plain round (the engine did not ask for a draft)
            if self.model is not None:
                self.model.rollback(lengths, num_drafted, num_accepted)
            return
        ngram, plan = self.round
        accepted = num_accepted.tolist()
        for b, (n, k) in enumerate(zip(ngram, plan, strict=True)):
            if k and n:
                self.by_ngram.observe(n, k, accepted[b])
            elif k:
                self.by_row.observe(b, k, accepted[b])
            elif not n:
                self.by_row.relax(b)
        for n in range(1, len(self.by_ngram.kept)):
            if n not in ngram:
                self.by_ngram.relax(n)
        if self.model is not None:
            self.model.rollback(lengths, num_drafted.masked_fill(self._looked(num_drafted), 0),
                                num_accepted)  # fmt: skip
        self.round = None  # heard: a round the engine runs plain next leaves nothing to learn

    def _looked(self, like: torch.Tensor) -> torch.Tensor:
        ngram = self.round[0] if self.round is not None else [0] * like.shape[0]
        return torch.tensor([n > 0 for n in ngram], device=like.device)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.by_row.select(keep)
        self.round = None
        if self.model is not None:
            self.model.select_rows(rows)
