"""Planners of the mixed drafter: per row and round, lookup or the model, and how far.

Each round every row gets a source: lookup where its text's last n tokens occurred before
(`PromptLookup`), else the drafter model (if there is one). The planner then says how many
tokens each row drafts:

* `FixedPlanner` (drafting `lookup-first`): a looked-up row drafts what followed its match, a
  model row drafts under the model's length policy; as far as that policy lets either.
* `PricedPlanner` (drafting `auto`): only as far as drafting pays at this machine's prices.

Why price: whether a drafted token pays depends on the machine as much as on the drafter. On a
CPU where a verify pass grows by a good part of a step per token and the drafter model's step
is a large fraction of the target's, model drafts lose whatever their acceptance, while a
lookup draft (no model pass) pays where it is right often enough; a batch of many rows makes
every extra token dearer still. A planner that drafts blindly loses to plain decoding on such a
machine; this one plans every round from the prices (`PriceModel`) and the acceptance each
source has had.

Expected tokens of a row drafting k with per-token acceptance a are 1 + a + ... + a^k; the
round's cost is the target's pass over all rows and all their tokens, in the shape the backend
runs it (`PriceModel.shape_cost`), plus, at each drafted depth, one drafter step over the model
rows drafting that deep. The shape matters: llama.cpp with a cache stream per row runs a ragged
pass as a pass per level of its rows' counts, so eight rows drafting one token each cost less
than four doing so and four not. A row with nothing worth drafting can then pad its draft with
a filler token (its last token: free, and never counted on) to keep the pass even. Tried each
round: every row to one depth (its model rows drafting with the model, or padding), and from
the best of those, the rows that gain most raised a token at a time while the ratio of expected
tokens to cost grows; a plain step where nothing beats it. Acceptance is estimated online: per
row for the model, per match length for lookup (matches of 3 tokens are right far more often
than matches of 1), with counts that decay so the estimate follows the text; a source that was
not tried for a while drifts back to its prior and is tried again. A corpus's drafts are
weighed per row and share band: a row starts from the band's rate over earlier rows and what
the corpus got right in the row's prompt (`prime`), so a chat row does not pay for a code
corpus's guesses that a code row keeps.

A plan only chooses how many tokens are drafted, never which, so outputs stay exact under
greedy decoding and the sampled law stays the target's (the lengths are a stopping time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from specdecode.core.length_policies import LengthPolicy
from specdecode.core.outcomes import Outcomes

PRIOR = (3.0, 1.0)  # pseudo-counts (kept, rejected): a source starts at 0.75 and is tried
MEMORY = 0.8  # weight of the past in each update: about the last five rounds count
# a lookup match length's or corpus band's acceptance is a property of the texts, not of one
# row's moment: it remembers about twenty drafts, and drifts back to the prior over a hundred
# rounds without one (at MEMORY a one-token match, kept a fifth of the time, was tried again
# every third round and drafted in 30% of an MT-Bench answer's rounds at one row)
KEY_MEMORY, KEY_RELAX = 0.95, 0.99
EXPLORED_DEPTH = 1  # tokens a row drafts at most where drafting is explored
# plain rounds an explored drafting round's pass costs at most, at the prices, past its first
# row: as many rows as fit (all of them where rows are nearly free, a GPU), one where each
# extra token costs most of a step (a CPU whose steps are compute-bound)
EXPLORED_COST = 1.5


class PriceModel(Protocol):
    """What a planner reads of a machine's prices, in steps (a one-row, one-token target pass)."""

    def shape_cost(self, counts: Sequence[int]) -> float:
        """A target pass whose rows hold `counts[b]` tokens each, as the backend runs it."""
        ...

    def even_cost(self, rows: int, per_row: float) -> float:
        """A target pass over `rows` rows holding `per_row` tokens each."""
        ...

    def draft_cost(self, rows: int) -> float | None:
        """One drafter step over `rows` rows (None: no drafter model priced)."""
        ...


class Plan(NamedTuple):
    """A round's plan: per row, tokens from its source, filler tokens after them, and whether
    the source is the drafter model (else the row's lookup match)."""

    lengths: list[int]
    fillers: list[int]
    by_model: list[bool]


class Outlook(NamedTuple):
    """A round's plan as the prices see it: expected committed tokens, and its cost in steps."""

    tokens: float
    cost: float

    @property
    def ratio(self) -> float:
        return self.tokens / self.cost


class Planner(Protocol):
    """Says how many tokens each row drafts this round, given what lookup found."""

    def start(self, batch_size: int) -> None: ...

    def budget(self, max_tokens: torch.Tensor) -> list[int]:
        """max_tokens [batch] (what the engine allows) -> most tokens per row this round."""
        ...

    def plan(
        self,
        keys: list[int],
        found: list[int],
        budget: list[int],
        behind: list[int],
        room: list[int] | None = None,
    ) -> Plan:
        """Each row's source (its lookup match, or the model) and tokens from it, and filler
        tokens after them: `keys[b]` the key of what was found for the row (a lookup match's
        length, or a corpus guess's `mixed.corpus_key`, above them; 0: none), `found[b]` how
        many tokens it found (<= budget[b]), `behind[b]` the committed tokens the drafter
        model's cache lacks for the row, `room[b]` the most the model may draft for it
        within its context (0: the model skips the row; None: no limit)."""
        ...

    def observe(self, keys: list[int], drafted: list[int], accepted: list[int]) -> None:
        """`keys[b]`: the key of a row that drafted by lookup or corpus (as `plan` takes
        them), 0 for the model's rows; `drafted[b]`: the row's tokens from its source this
        round (fillers not counted)."""
        ...

    def prime(self, row: int, evidence: Sequence[tuple[int, int]]) -> None:
        """What a corpus would have got right in row `row`'s text so far, per share band
        (`CorpusIndex.evidence`: positions with a choice, right choices)."""
        ...

    def select_rows(self, keep: list[int]) -> None: ...

    def add_rows(self, count: int) -> None: ...


class FixedPlanner:
    """Lookup where it found something, else the model; each as far as the policy allows."""

    def __init__(self, policy: LengthPolicy) -> None:
        self.policy = policy  # the model's own: it also stops the model's rows early

    def start(self, batch_size: int) -> None:
        pass

    def budget(self, max_tokens: torch.Tensor) -> list[int]:
        return self.policy.round_limits(max_tokens).tolist()

    def plan(
        self,
        keys: list[int],
        found: list[int],
        budget: list[int],
        behind: list[int],
        room: list[int] | None = None,
    ) -> Plan:
        room = room if room is not None else budget  # no limit: a row drafts its budget at most
        by_model = [n == 0 and r > 0 for n, r in zip(keys, room, strict=True)]
        lengths = [  # a row the model cannot take drafts its match, if any
            min(b, r) if m else f for f, b, r, m in zip(found, budget, room, by_model, strict=True)
        ]
        return Plan(lengths, [0] * len(lengths), by_model)

    def observe(self, keys: list[int], drafted: list[int], accepted: list[int]) -> None:
        pass

    def prime(self, row: int, evidence: Sequence[tuple[int, int]]) -> None:
        pass  # drafts every match it is given: there is nothing to weigh

    def select_rows(self, keep: list[int]) -> None:
        pass

    def add_rows(self, count: int) -> None:
        pass


def at_prior_weight(rate: float) -> tuple[float, float]:
    """(kept, rejected) pseudo-counts of acceptance `rate`, as many in all as `PRIOR`'s."""
    strength = sum(PRIOR)
    return strength * rate, strength * (1 - rate)


class Acceptance:
    """Decaying kept / rejected counts of drafted tokens, for a set of keys (rows, n-grams),
    each starting at, and drifting back to, its prior (`PRIOR` unless given)."""

    def __init__(
        self,
        size: int,
        memory: float = MEMORY,
        relax: float = MEMORY,
        priors: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        self.priors = list(priors) if priors is not None else [PRIOR] * size
        self.kept = [k for k, _ in self.priors]
        self.rejected = [r for _, r in self.priors]
        self.memory, self.relax_memory = memory, relax

    def rate(self, key: int) -> float:
        return self.kept[key] / (self.kept[key] + self.rejected[key])

    def observe(self, key: int, drafted: int, accepted: int) -> None:
        """Tokens are judged in order until the first rejection: `accepted` kept, then one
        rejected unless every drafted token was kept (the estimator of a per-token rate)."""
        self.kept[key] = self.memory * self.kept[key] + accepted
        self.rejected[key] = self.memory * self.rejected[key] + (accepted < drafted)

    def relax(self, key: int) -> None:
        """No drafts this round: drift back toward the prior, so the source is tried again."""
        keep, (kept, rejected) = self.relax_memory, self.priors[key]
        self.kept[key] = keep * self.kept[key] + (1 - keep) * kept
        self.rejected[key] = keep * self.rejected[key] + (1 - keep) * rejected

    def select(self, rows: list[int]) -> None:
        self.priors = [self.priors[b] for b in rows]
        self.kept = [self.kept[b] for b in rows]
        self.rejected = [self.rejected[b] for b in rows]

    def add(self, count: int, prior: tuple[float, float] = PRIOR) -> None:
        self.priors += [prior] * count
        self.kept += [prior[0]] * count
        self.rejected += [prior[1]] * count

    def set_prior(self, key: int, prior: tuple[float, float]) -> None:
        self.priors[key] = prior
        self.kept[key], self.rejected[key] = prior


BEST_RATE = 0.95  # a drafter model's acceptance at its best, for `model_can_pay`


def model_can_pay(prices: PriceModel, max_tokens: int, rows: int) -> bool:
    """Whether drafting by model could pay here at all: for some length up to `max_tokens` at
    1 or `rows` rows, a round of drafts accepted at `BEST_RATE` yields more tokens per unit of
    cost than a plain step. Where none does, the plan would never draft by model, so the
    model need not be loaded (nor its memory and load time paid)."""
    draft = prices.draft_cost(1)
    if draft is None:
        return False
    for r in sorted({1, max(rows, 1)}):
        plain = r / prices.even_cost(r, 1)
        for k in range(1, max_tokens + 1):
            expected = r * sum(BEST_RATE**i for i in range(k + 1))
            cost = prices.even_cost(r, k + 1) + k * (prices.draft_cost(r) or 0.0)
            if expected / cost > plain:
                return True
    return False


def explored_caps(caps: list[int], rates: list[float], prices: PriceModel) -> list[int]:
    """The rows an explored drafting round may draft on, one token each (`caps[b]` > 0: row b
    has a source), the most likely kept first: as many as keep the pass within
    `EXPLORED_COST` plain rounds at the prices (the others padded with fillers where that
    costs less), or where even one row costs more, the cheapest number of them (a padded pass
    costs the same however many rows it drafts on).
    An exploration asks what a predicted gain is worth on this machine; a round that costs
    little asks it as well as one that drafts on every row, and where drafting loses every
    explored token is paid for."""
    batch = len(caps)
    order = sorted((b for b in range(batch) if caps[b] > 0), key=lambda b: -rates[b])
    if not order:
        return [0] * batch
    bound = EXPLORED_COST * prices.shape_cost([1] * batch)
    even = prices.shape_cost([2] * batch)  # the other rows padded with a filler each
    cost = {  # of drafting on the first n rows of the order
        n: min(even, prices.shape_cost([2 if r in order[:n] else 1 for r in range(batch)]))
        for n in range(1, len(order) + 1)
    }
    within = [n for n, c in cost.items() if c <= bound]
    n = max(within) if within else min(cost, key=lambda n: (cost[n], -n))
    return [1 if b in order[:n] else 0 for b in range(batch)]


def plan_lengths(
    rates: list[float],
    caps: list[int],
    budget: list[int],
    uses_model: list[bool],
    prices: PriceModel,
    catch_up: list[float] | None = None,
    worth: float = 1.0,
) -> tuple[list[int], list[int], Outlook]:
    """Tokens each row drafts this round from its source, filler tokens after them (see the
    module's note), and the plan's expected committed tokens per unit of cost: row b's source
    gives up to `caps[b]` tokens, each kept with probability `rates[b]` while the ones before
    were; it drafts `budget[b]` tokens at most in all. `uses_model[b]`: its source is the
    drafter model, whose steps cost; `catch_up[b]`: what its first model token costs besides
    (its drafter cache's lag). `worth`: what a drafting plan's predicted gain is worth here
    (`outcomes.Outcomes`): a plan drafts only where its ratio times `worth` beats a plain
    step's; 0 runs a plain round.

    The drafter's step prices are read once into a table: a plan runs every round, on the
    engine's thread."""
    batch = len(rates)
    catch = catch_up if catch_up is not None else [0.0] * batch
    models = sum(uses_model)
    draft_by_rows = [0.0] + [prices.draft_cost(r) or 0.0 for r in range(1, models + 1)]
    gained = []  # gained[b][j]: expected tokens of the row's first j source tokens
    for rate, cap in zip(rates, caps, strict=True):
        sums = [0.0]
        for j in range(1, cap + 1):
            sums.append(sums[-1] + rate**j)
        gained.append(sums)

    def outlook(k: list[int], real: list[int]) -> Outlook:
        """Expected committed tokens and cost: k[b] drafted, the first real[b] of them from
        the row's source."""
        expected = batch + sum(g[r] for g, r in zip(gained, real, strict=True))
        cost = prices.shape_cost([1 + x for x in k])
        model_real = [r for r, m in zip(real, uses_model, strict=True) if m and r]
        for depth in range(1, max(model_real, default=0) + 1):
            cost += draft_by_rows[sum(r >= depth for r in model_real)]
        cost += sum(c for c, r, m in zip(catch, real, uses_model, strict=True) if m and r)
        return Outlook(expected, cost)

    def ratio(k: list[int], real: list[int]) -> float:
        """Expected committed tokens per unit of cost."""
        return outlook(k, real).ratio

    plain = [0] * batch
    if worth <= 0:  # a plain round asked for: nothing to weigh
        return plain, plain, outlook(plain, plain)
    # a drafting plan must beat a plain step by what its predictions have been worth
    best, best_real, best_ratio = plain, plain, ratio(plain, plain) / worth
    modes = (True, False) if models else (True,)
    # past every row's source tokens a depth only adds fillers: more cost, nothing expected
    deepest = max(map(min, budget, caps), default=0)
    for with_model in modes:  # the model rows draft with the model, or pad
        for depth in range(1, deepest + 1):
            k = [min(depth, room) for room in budget]
            real = [
                min(x, cap) if with_model or not m else 0
                for x, cap, m in zip(k, caps, uses_model, strict=True)
            ]
            if (value := ratio(k, real)) > best_ratio:
                best, best_real, best_ratio = k, real, value
    while True:  # raise the rows that gain most by a source token, as many as pays
        open_rows = [b for b in range(batch) if best_real[b] == best[b] < min(budget[b], caps[b])]
        open_rows.sort(key=lambda b: -(rates[b] ** (best_real[b] + 1)))
        k, real, step = list(best), list(best_real), None
        for b in open_rows:
            k[b] += 1
            real[b] += 1
            if (value := ratio(k, real)) > best_ratio:
                step, best_ratio = (list(k), list(real)), value
        if step is None:
            break
        best, best_real = step
    fillers = [x - r for x, r in zip(best, best_real, strict=True)]
    return best_real, fillers, outlook(best, best_real)


class PricedPlanner:
    """Each source as far as it pays at `prices`, at most `max_tokens` a row and round.

    With a drafter model, a row whose match is shorter than `first_ngram` tokens (or a corpus
    draft) has two sources: it (free, right less often) or the model (dear, right more often). Both
    assignments are planned each round, the model taking such rows or leaving them to their
    match, and the better plan is kept: at one row on a GPU the model wins them, at eight rows
    on a CPU, where a drafter step costs half a target step, their matches do.

    `outcomes`: drafting's judge, asked each round what a predicted gain is worth at this row
    count and told what the kept plan predicts (`outcomes.Outcomes`)."""

    def __init__(
        self,
        lookup_ngrams: int,
        has_model: bool,
        prices: PriceModel,
        max_tokens: int,
        first_ngram: int = 1,
        corpus_priors: Sequence[float] = (),
        outcomes: Outcomes | None = None,
        texts: dict[tuple[int, int], Acceptance] | None = None,
    ) -> None:
        if has_model and prices.draft_cost(1) is None:
            raise ValueError("pricing a drafter model's rounds needs its step's price")
        self.has_model, self.prices, self.max_tokens = has_model, prices, max_tokens
        self.outcomes = outcomes  # what the plan's predicted gains have been worth here
        self.long_matches = range(first_ngram, lookup_ngrams + 1)  # drafted before the model
        # lookup acceptance by match length, then a corpus's by share band (`mixed.corpus_key`),
        # each band from its own prior: a band of less clear choices is not tried at the price
        # of a clear one's
        priors = [PRIOR] * (lookup_ngrams + 1) + [at_prior_weight(a) for a in corpus_priors]
        # `texts`: what earlier planners of one decoder learnt of each match length and band,
        # kept by their counts; a planner made per call starts where the last left off, as a
        # server's one loop goes on, not from the priors (every fresh start drafted each match
        # length at the priors' rate until its drafts said otherwise)
        fresh = Acceptance(len(priors), KEY_MEMORY, KEY_RELAX, priors)
        key = (lookup_ngrams, len(corpus_priors))
        self.by_ngram = fresh if texts is None else texts.setdefault(key, fresh)
        self.by_row = Acceptance(0)  # the model's acceptance, per row
        # a corpus band's acceptance per row: from the band's (`by_ngram`) and what the corpus
        # got right in the row's own text (`prime`), then the row's own drafts; a chat row
        # stops asking a code corpus after its prompt or its first misses, a code row goes on
        self.first_band = lookup_ngrams + 1
        self.by_band_row = [Acceptance(0, KEY_MEMORY, KEY_RELAX) for _ in corpus_priors]

    def start(self, batch_size: int) -> None:
        self.by_row = Acceptance(batch_size)
        self.by_band_row = [
            Acceptance(batch_size, KEY_MEMORY, KEY_RELAX, [self._band_prior(band)] * batch_size)
            for band in range(len(self.by_band_row))
        ]

    def _band_prior(self, band: int) -> tuple[float, float]:
        """A new row's pseudo-counts for a corpus band: the band's rate over earlier rows, at
        the weight of the prior."""
        return at_prior_weight(self.by_ngram.rate(self.first_band + band))

    def _rate(self, row: int, key: int) -> float:
        band = key - self.first_band
        return self.by_band_row[band].rate(row) if band >= 0 else self.by_ngram.rate(key)

    def budget(self, max_tokens: torch.Tensor) -> list[int]:
        return max_tokens.clamp(max=self.max_tokens).tolist()

    def plan(
        self,
        keys: list[int],
        found: list[int],
        budget: list[int],
        behind: list[int],
        room: list[int] | None = None,
    ) -> Plan:
        room = room if room is not None else budget
        if not self.has_model:
            choices = [[False] * len(keys)]
        else:  # the model takes the rows with short matches, or only those with none, where
            # its context has room for them
            pairs = list(zip(keys, room, strict=True))
            short = [n not in self.long_matches and r > 0 for n, r in pairs]
            unmatched = [n == 0 and r > 0 for n, r in pairs]
            choices = [short] if short == unmatched else [short, unmatched]
        # what a row's first model token costs besides, were the model to draft it
        lags = [self.catch_up(lag) for lag in behind] if self.has_model else [0.0] * len(behind)
        rows = len(keys)
        worth = self.outcomes.worth(rows) if self.outcomes is not None and rows else 1.0
        exploring = self.outcomes is not None and rows and self.outcomes.explores() == "draft"
        if exploring:  # an explored drafting round: one token a row at most (`Outcomes`)
            budget = [min(b, EXPLORED_DEPTH) for b in budget]
            room = [min(r, EXPLORED_DEPTH) for r in room]
        best: tuple[Outlook, Plan] | None = None
        for by_model in choices:
            rates = [
                self.by_row.rate(b) if m else self._rate(b, n)
                for b, (n, m) in enumerate(zip(keys, by_model, strict=True))
            ]
            caps = [
                min(c, r) if m else (f if n else 0)
                for n, f, c, r, m in zip(keys, found, budget, room, by_model, strict=True)
            ]
            catch_up = [c if m else 0.0 for m, c in zip(by_model, lags, strict=True)]
            if exploring:
                caps = explored_caps(caps, rates, self.prices)
            real, fillers, seen = plan_lengths(
                rates, caps, budget, by_model, self.prices, catch_up, worth
            )
            if best is None or seen.ratio > best[0].ratio:
                best = seen, Plan(real, fillers, by_model)
        assert best is not None
        (tokens, cost), plan = best
        if self.outcomes is not None and (any(plan.lengths) or any(plan.fillers)):
            self.outcomes.predicted(rows, tokens, cost, self.prices.even_cost(rows, 1))
        return plan

    def catch_up(self, lag: int) -> float:
        """Steps the drafter spends feeding a row's `lag` missing tokens before it drafts:
        its step's price, grown as a pass over that many more tokens grows."""
        prices = self.prices
        grown = prices.even_cost(1, lag + 1) - prices.even_cost(1, 1)
        return (prices.draft_cost(1) or 0.0) * grown

    def observe(self, keys: list[int], drafted: list[int], accepted: list[int]) -> None:
        for b, (n, k) in enumerate(zip(keys, drafted, strict=True)):
            if k and n:  # a filler after the source's tokens does not count
                self.by_ngram.observe(n, k, min(accepted[b], k))
                if n >= self.first_band:
                    self.by_band_row[n - self.first_band].observe(b, k, min(accepted[b], k))
            elif k:
                self.by_row.observe(b, k, min(accepted[b], k))
            elif not n:
                self.by_row.relax(b)
        for n in range(1, len(self.by_ngram.kept)):
            if n not in keys:
                self.by_ngram.relax(n)
        for band, rows in enumerate(self.by_band_row):
            for b, n in enumerate(keys):
                if n != self.first_band + band:
                    rows.relax(b)

    def prime(self, row: int, evidence: Sequence[tuple[int, int]]) -> None:
        for band, (count, right) in enumerate(evidence[: len(self.by_band_row)]):
            kept, rejected = self._band_prior(band)
            self.by_band_row[band].set_prior(row, (kept + right, rejected + count - right))

    def select_rows(self, keep: list[int]) -> None:
        self.by_row.select(keep)
        for rows in self.by_band_row:
            rows.select(keep)

    def add_rows(self, count: int) -> None:
        self.by_row.add(count)
        for band, rows in enumerate(self.by_band_row):
            rows.add(count, self._band_prior(band))
