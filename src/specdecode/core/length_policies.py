"""Length policies: how many tokens each row drafts in a round.

One protocol, five policies, chosen by name (`POLICIES`). A policy says how many tokens a round
drafts, never how: that is the drafting setting (`drafting`), and drafting `auto` plans its
rounds' lengths from the machine's prices instead of reading a policy.

* `constant`: k tokens every round (SpecDec; the baseline).
* `heuristic`: `transformers` assisted generation's schedule, per row: k grows by 2 after a round
  where every drafted token was accepted and shrinks by 1 otherwise.
* `confidence`: stop drafting once the drafter's own top probability falls under a threshold
  (the idea of `transformers`' `assistant_confidence_threshold`).
* `head` (SpecDec++, Huang et al. 2024): stop once the predicted probability that at least one
  token of the round gets rejected, 1 - prod_i a_i, exceeds `stop_threshold`, where a_i is the
  acceptance head's prediction for the i-th drafted token (from the drafter's hidden state and
  the drafting law's features; a sampling head also reads how likely the drawn token was).
  The SpecDec++ MDP analysis shows this threshold rule is the optimal stopping policy.
* `head-u` (sampling): `head`, with each prediction also reading the token's acceptance number
  u, drawn when the token is drafted. The verdict is u < p/q: a token drawn with a small u is
  kept unless the target all but excludes it, one with u near 1 only if the target likes it at
  least as much as the drafter. The head's logit z and log u are combined by a logistic
  calibration fitted on the head's data (`AcceptanceHead.with_number`).

Priced heads (`DecodeConfig.prices`): the threshold rule is optimal when a verify pass
costs the same whatever its length. Where it does not (a CPU's products turn compute-bound past
6 rows, a GPU's at a tile edge), a head given the machine's prices drafts on while some further
stretch of tokens is worth its price: see `HeadLength`.

Every row decides on its own; the token that triggers a stop is kept (it is already drafted and
verifying it costs almost nothing), and the round ends when every row has stopped or reached the
round's maximum. A policy only chooses how many tokens are drafted, never which: each verdict is
exact for any draft length chosen from the tokens drafted so far (a stopping time), so outputs
under greedy and the sampled distribution are unchanged (tests check this for every policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.acceptance.head import law_features
from specdecode.core.config import POLICIES, DecodeConfig
from specdecode.core.prices import Prices, RoundCosts


@dataclass(frozen=True)
class DraftedPosition:
    """What a policy may look at after the `index`-th token (0-based) of a round is drafted."""

    index: int
    logits: torch.Tensor  # [batch, vocab] the drafter's logits that produced the token
    probs: torch.Tensor | None  # [batch, vocab] the law it was sampled from (None under greedy)
    hidden: torch.Tensor | None  # [batch, hidden] drafter's last hidden state, if asked for
    token: torch.Tensor | None = None  # [batch] the token drafted (drawn from `probs`)
    number: torch.Tensor | None = None  # [batch] its acceptance number u (sampling only): the
    # verdict will be u < p/q, and u is drawn with the token (`sampling.RowRandom`)


class LengthPolicy(Protocol):
    name: str
    stops_early: bool  # False: the round length is known up front (no per-position decision)
    needs_hidden: bool  # True: `keep_drafting` reads the drafter's hidden states
    needs_number: bool  # True: `keep_drafting` reads each drafted token's acceptance number

    def start(self, batch_size: int, device: torch.device) -> None: ...

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor:
        """max_tokens [batch] (what the budget allows) -> most tokens per row this round."""
        ...

    def keep_drafting(self, position: DraftedPosition) -> torch.Tensor:
        """-> [batch] bool: whether each row goes on to draft position index + 1."""
        ...

    def observe(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def add_rows(self, count: int) -> None:
        """Rows that join a running batch start as a new batch's rows would."""
        ...


class _Stateless:
    """Policies without per-row state across rounds."""

    def start(self, batch_size: int, device: torch.device) -> None:
        pass

    def observe(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def add_rows(self, count: int) -> None:
        pass


class ConstantLength(_Stateless):
    name = "constant"
    stops_early = False
    needs_hidden = False
    needs_number = False

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = num_draft_tokens

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor:
        return max_tokens.clamp(max=self.num_draft_tokens)

    def keep_drafting(self, position: DraftedPosition) -> torch.Tensor:
        return torch.ones(position.logits.shape[0], dtype=torch.bool, device=position.logits.device)


class HeuristicLength:
    """Per-row k: +2 after a fully accepted round, -1 (not below 1) otherwise, within bounds."""

    name = "heuristic"
    stops_early = False
    needs_hidden = False
    needs_number = False

    def __init__(self, first: int, min_tokens: int, max_tokens: int) -> None:
        self.first, self.min_tokens, self.max_tokens = first, min_tokens, max_tokens
        self.k = torch.zeros(0, dtype=torch.long)

    def start(self, batch_size: int, device: torch.device) -> None:
        first = min(max(self.first, self.min_tokens), self.max_tokens)
        self.k = torch.full((batch_size,), first, dtype=torch.long, device=device)  # [batch]

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor:
        return torch.minimum(max_tokens, self.k)

    def keep_drafting(self, position: DraftedPosition) -> torch.Tensor:
        return torch.ones_like(self.k, dtype=torch.bool)

    def observe(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        # a row that drafted nothing (budget spent) keeps its k
        all_in = num_accepted >= num_drafted
        step = torch.where(all_in, 2, -1) * (num_drafted > 0)
        self.k = (self.k + step).clamp(self.min_tokens, self.max_tokens)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.k = self.k.index_select(0, rows.to(self.k.device))

    def add_rows(self, count: int) -> None:
        first = min(max(self.first, self.min_tokens), self.max_tokens)
        self.k = torch.cat([self.k, self.k.new_full((count,), first)])


class _StopRule(_Stateless):
    """Adaptive policies: draft up to `max_tokens`, stop a row when `should_stop` says so."""

    stops_early = True
    needs_hidden = False
    needs_number = False

    def __init__(self, threshold: float, min_tokens: int, max_tokens: int) -> None:
        self.threshold, self.min_tokens, self.max_tokens = threshold, min_tokens, max_tokens

    def round_limits(self, max_tokens: torch.Tensor) -> torch.Tensor:
        self.begin_round(max_tokens.shape[0], max_tokens.device)
        return max_tokens.clamp(max=self.max_tokens)

    def begin_round(self, batch_size: int, device: torch.device) -> None:
        pass

    def keep_drafting(self, position: DraftedPosition) -> torch.Tensor:
        stop = self.should_stop(position)  # [batch]
        return ~stop | (position.index + 1 < self.min_tokens)

    def should_stop(self, position: DraftedPosition) -> torch.Tensor: ...


class ConfidenceLength(_StopRule):
    """Stop after a token drafted while the drafter's top probability was under the threshold."""

    name = "confidence"

    def should_stop(self, position: DraftedPosition) -> torch.Tensor:
        probs = position.probs if position.probs is not None else position.logits.softmax(-1)
        return probs.max(-1).values < self.threshold  # [batch]


def going_on_prices(prices: RoundCosts, threshold: float, max_tokens: int) -> torch.Tensor:
    """[max_tokens, max_tokens] the bar `HeadLength` sets: entry [n - 1, m - 1] is what drafting
    m more tokens after n must earn, (1 - h) x its added cost in drafted tokens' prices; inf
    where n + m passes `max_tokens`."""
    bar = torch.full((max_tokens, max_tokens), float("inf"), dtype=torch.float64)
    for n in range(1, max_tokens):
        for m in range(1, max_tokens - n + 1):
            bar[n - 1, m - 1] = (1 - threshold) * prices.added_cost(n, m) / prices.draft
    return bar


def worth_drafting_on(
    all_accepted: torch.Tensor, last: torch.Tensor, bar: torch.Tensor
) -> torch.Tensor:
    """all_accepted [batch] P(every token drafted so far is accepted), last [batch] the latest
    token's predicted acceptance, bar [M] `going_on_prices`' row for this many drafted (on
    their device) ->
    [batch] whether some further stretch of m tokens is worth its price.

    m more tokens add all_accepted x (a + a^2 + ... + a^m) expected tokens, taking the latest
    prediction a for the unseen ones, and cost what the bar prices; the round goes on if that
    beats the rate a draft must pay for: with a flat verify price, only m = 1 can, and the
    rule is SpecDec++'s, all_accepted >= 1 - h.
    """
    steps = torch.arange(bar.shape[0], dtype=torch.float64, device=last.device)  # [M]
    powers = last.double().clamp(0, 1)[:, None] ** steps  # [batch, M] 1, a, a^2, ...
    gain = all_accepted.double()[:, None] * powers.cumsum(-1)  # [batch, M] / a, m = 1..M
    return (gain >= bar).any(-1)  # [batch]


class HeadLength(_StopRule):
    """SpecDec++: stop once P(some token of this round is rejected) > threshold.

    Given the machine's `Prices`, the rule looks past the next token: a round goes on if
    some stretch of m more tokens earns what it adds to the round's cost, at the rate the
    threshold sets for one drafted token (`worth_drafting_on`). Where the verify pass is flat
    that is the threshold rule itself; where it jumps (7 positions on a 2-core CPU), a round
    crosses the jump only if it is likely to go far enough beyond it to pay for it. The
    prices are read at the batch's row count, again whenever it changes.
    """

    name = "head"
    needs_hidden = True

    def __init__(
        self,
        head: torch.nn.Module,
        threshold: float,
        min_tokens: int,
        max_tokens: int,
        reads_number: bool = False,
        prices: Prices | None = None,
    ):
        super().__init__(threshold, min_tokens, max_tokens)
        if prices is not None and not prices.draft_cost(1):
            raise ValueError(
                "a priced head weighs drafted tokens: its prices need a drafter step's price"
            )
        self.head, self.needs_number = head, reads_number
        self.name = "head-u" if reads_number else "head"
        self.log_all_accepted = torch.zeros(0)
        self.prices = prices
        self.bar: torch.Tensor | None = None
        self.bar_rows = 0  # the row count the bar was read at

    def begin_round(self, batch_size: int, device: torch.device) -> None:
        self.log_all_accepted = torch.zeros(batch_size, device=device)  # [batch]
        if self.prices is not None and batch_size != self.bar_rows:  # built once per row count
            bar = going_on_prices(self.prices.rounds(batch_size), self.threshold, self.max_tokens)
            self.bar, self.bar_rows = bar.to(device), batch_size

    def should_stop(self, position: DraftedPosition) -> torch.Tensor:
        if position.hidden is None:
            raise ValueError("the head policy needs the drafter's hidden states")
        features = None
        if self.head.reads_law:
            law = position.probs if position.probs is not None else position.logits.softmax(-1)
            drawn = position.token if self.head.reads_drawn else None
            if self.head.reads_drawn and drawn is None:
                raise ValueError("this head reads the drawn token; the drafter must pass it")
            features = law_features(law, drawn)  # [batch, 3 or 4]
        logit = self.head(position.hidden, features).float()  # [batch]
        if self.needs_number:
            if position.number is None:
                raise ValueError("the head-u policy needs each drafted token's acceptance number")
            logit = self.head.with_number(logit, position.number)
        # log sigmoid is exact where the product of many probabilities would underflow
        self.log_all_accepted = self.log_all_accepted + torch.nn.functional.logsigmoid(logit)
        if self.bar is not None:  # its last row (max_tokens drafted) is all inf: a stop
            row = self.bar[position.index]  # [max_tokens]
            return ~worth_drafting_on(self.log_all_accepted.exp(), torch.sigmoid(logit), row)
        return -torch.expm1(self.log_all_accepted) > self.threshold  # 1 - prod a_i > h


def _head_policy(cfg: DecodeConfig, head: torch.nn.Module | None) -> HeadLength:
    name = cfg.length_policy
    if head is None:
        raise ValueError(
            f"length policy {name!r} needs an acceptance head: none was loaded, and none ships "
            "for this drafter, target and verification rule; train one (`specdecode head "
            "collect`, `specdecode head train`) and pass it (--head DIR, or "
            "SpeculativeDecoder.load_head)"
        )
    reads_number = name == "head-u"
    if reads_number and head.config.number_calibration is None:
        raise ValueError(
            "length policy 'head-u' needs a head calibrated against acceptance numbers; this "
            "one has none (heads trained before it existed, or greedy heads): add it with "
            "`specdecode head calibrate HEAD DATA`, or use 'head'"
        )
    return HeadLength(head, cfg.policy_threshold, *cfg.draft_bound, reads_number, cfg.prices)


BUILDERS = {
    "constant": lambda cfg, head: ConstantLength(cfg.num_draft_tokens),
    "heuristic": lambda cfg, head: HeuristicLength(cfg.num_draft_tokens, *cfg.draft_bound),
    "confidence": lambda cfg, head: ConfidenceLength(cfg.policy_threshold, *cfg.draft_bound),
    "head": _head_policy,
    "head-u": _head_policy,
}
assert tuple(BUILDERS) == POLICIES


def make_policy(cfg: DecodeConfig, head: torch.nn.Module | None = None) -> LengthPolicy:
    """A fresh policy (policies keep per-row state) for one decoding call."""
    return BUILDERS[cfg.length_policy](cfg, head)
