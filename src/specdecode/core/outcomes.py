"""Drafting judged by what it achieves: the plan's predicted gain checked against the rounds.

The priced plan (`drafting.planners`) drafts where timed prices and estimated acceptance say a
round yields more tokens per second than a plain step. Both can be wrong on a machine: prices
timed while another process ran, per-round work they do not hold (planning, the lookup, the
host copies), acceptance estimates that start optimistic. On a machine where drafting's margin
is thin (a CPU whose every extra token costs most of a step) such an error turns the plan into
a loss against plain decoding; on one where it is wide (a GPU) it costs a little speed only.

`Outcomes` measures, per row count, the two kinds of rounds the plan runs:

* plain rounds: their seconds, the reference of every comparison;
* drafting rounds: how many plain rounds' worth of time each took (against the median of the
  plain rounds run among them, at least `FRESH`, so a plain round is asked for where there
  are fewer), and how many plain rounds' worth of tokens it committed, beside what the plan
  predicted for both.

Their ratio over the recent drafting rounds, measured gain over predicted gain, is the *worth*
of a predicted gain at that row count: 1 where the plan's predictions hold, 0.8 where drafting
delivers four fifths of what the plan expected (its acceptance estimates optimistic, its
prices too low, work the prices do not hold). The plan drafts a round only where its predicted
gain times this worth beats a plain step (`planners.plan_lengths`); until measured the worth
is `FIRST_WORTH`, so a draft must promise a little more than a plain step. Both kinds of rounds
are measured side by side in time, so a machine that slows down as a whole (another process
starts) moves both and leaves the worth alone (drafting rounds run beside the other process are
never weighed against plain rounds run before it); what moves it is drafting paying more or less
than predicted.

A correction is made only where the evidence lies outside its noise: the measured worth is
more than `confidence` standard errors and `tolerance` away from the current one. After one,
the drafting rounds the plan now runs (fewer or more of the marginal ones) are measured afresh.
A correction that would reverse the last one at a row count waits `hold` rounds at that count,
so the worth cannot flip at every correction.

A kind of round not seen for `explore_every` rounds at a row count is run once: a plain round
where the plan always drafts, a bolder plan where it never does (prices that undersell drafting
show it only in rounds they would not draft), one token a row at most, on as many rows as keep
the pass within 1.5 plain rounds at the prices (`explores`, `planners.explored_caps`): where
drafting loses, every drafted token of such a round is paid for, and one token on one row
measures what a predicted gain is worth as well as a deep draft on every row does. At most two
rounds in `explore_every` explore (4% at the default 50); each exploration that finds nothing
new doubles the wait for the next of its kind, up to `BACKOFF` times (0.5% a kind), until a
correction says the machine changed or an explored drafting round beats a plain one, or plain
rounds run `CHANGED` times slower or faster than before, two windows of plain rounds in a row
(another process started or ended).

A worth stored by an earlier process starts the next one halfway (in ratio) back toward
`FIRST_WORTH`: it was measured on the machine as it was then, perhaps beside another process or
a move of pages, and a low worth drafts little, so its own rounds would take long to correct it.

No file is read or written here: a decoder stores the worth beside its prices outside any round.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

EXPLORE_EVERY = 50  # rounds at a row count without a kind of round before one is run
PLAIN_MEMORY = 9  # plain rounds in the median of a plain round's seconds
DRAFT_MEMORY = 160  # drafting rounds in a worth's measurement, at most
LEAST = 8  # drafting rounds before a worth is measured
JUDGE_EVERY = 4  # drafting rounds between two judgements
EXPLORE_BOLDER = 1.5  # a drafting exploration's worth over the measured one (at least 1)
BACKOFF = 8  # an exploration that changed nothing doubles the wait, up to this many times
CONFIDENCE = 2.0  # standard errors a correction must clear
TOLERANCE = 0.03  # and a relative difference it must exceed
HOLD = 400  # rounds at a row count before a correction may reverse the last one there
WORTH_RANGE = (0.2, 2.0)  # a worth outside is a measurement gone wrong, not a machine
SETTLE = 30  # rounds at a row count before its drafting rounds are weighed (acceptance
# estimates start at their priors)
FIRST_WORTH = 0.97  # a drafting round must promise 3% over a plain step until measured
CHANGED = 1.3  # plain rounds this much slower or faster than before: the machine changed
CLIP = 3.0  # a round's time is read within 1/3 to 3 times its prediction: a stall is not a price
CARRIED = 0.5  # the power of a stored worth's ratio to `FIRST_WORTH` that a new process keeps
FRESH = 5  # plain rounds among a worth's drafting rounds before they are weighed


@dataclass(frozen=True)
class Correction:
    """A change of the worth at `rows` rows, at the `round`-th round observed there."""

    rows: int
    round: int
    old: float
    new: float
    standard_error: float


@dataclass(frozen=True)
class Shift:
    """Plain rounds at `rows` rows running `ratio` times as long as before, seen at the
    `round`-th round observed there: the machine changed, both kinds of round are tried soon."""

    rows: int
    round: int
    ratio: float


@dataclass
class _Kind:
    """When a kind of round (plain, or drafting) was last seen at a row count, in rounds
    observed there, and how many rounds without one before one is run (0: `explore_every`).
    Rounds, not plans: a search that rests (`mixed.Rest`) asks for no plan, and its rests
    must not stretch the waits."""

    last: int = 0
    wait: int = 0

    def due(self, now: int, every: int) -> bool:
        """Whether a plan at round `now` explores this kind; if so the next wait doubles."""
        if now - self.last <= (self.wait or every):
            return False
        self.last = now
        self.wait = min(2 * (self.wait or every), every * BACKOFF)
        return True


@dataclass
class _RowCount:
    """What has been seen at one row count."""

    worth: float = FIRST_WORTH
    plain_reference: float | None = None  # the plain rounds' median when last explored afresh
    plain_count: int = 0  # plain rounds seen
    plain_strikes: int = 0  # windows of plain rounds in a row away from the reference
    # per plain round: (the round it was here, its seconds), as far back as the drafts reach
    timed_plain: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=DRAFT_MEMORY)
    )
    # per drafting round: (the round it was here, its seconds; plain rounds of time predicted;
    # tokens a row committed, predicted)
    drafts: deque[tuple[int, float, float, float, float]] = field(
        default_factory=lambda: deque(maxlen=DRAFT_MEMORY)
    )
    rounds: int = 0  # rounds observed at this row count
    plain_seen: _Kind = field(default_factory=_Kind)
    draft_seen: _Kind = field(default_factory=_Kind)
    since_judged: int = 0
    last_change: Correction | None = None

    def plain_median(self) -> float:
        """The median seconds of the last `PLAIN_MEMORY` plain rounds."""
        count = len(self.timed_plain)
        return statistics.median(
            self.timed_plain[i][1] for i in range(max(count - PLAIN_MEMORY, 0), count)
        )


class Outcomes:
    """The worth of the plan's predicted gains at each row count, from the rounds' outcomes."""

    def __init__(
        self,
        worth: Mapping[int, float] | None = None,  # stored by an earlier process (`CARRIED`)
        *,
        explore_every: int = EXPLORE_EVERY,
        confidence: float = CONFIDENCE,
        tolerance: float = TOLERANCE,
        hold: int = HOLD,
    ) -> None:
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 rounds, got {explore_every}")
        self.explore_every, self.confidence = explore_every, confidence
        self.soon = max(explore_every // 5, 2)  # the wait, in rounds, where evidence asks for one
        self.tolerance, self.hold = tolerance, hold
        self.counts: dict[int, _RowCount] = {}
        for rows, value in (worth or {}).items():
            carried = FIRST_WORTH * (_clamped(float(value)) / FIRST_WORTH) ** CARRIED
            self._at(int(rows)).worth = _clamped(carried)
        self.corrections: list[Correction] = []
        self.shifts: list[Shift] = []
        self.explored = 0  # rounds run as exploration
        self.changed = False  # a correction not yet stored (`stored`)
        self._prediction: tuple[int, float, float] | None = None  # (rows, tokens, steps)
        self._exploring: str | None = None  # the kind of round this plan explores

    def _at(self, rows: int) -> _RowCount:
        if rows not in self.counts:
            self.counts[rows] = _RowCount()
        return self.counts[rows]

    def worth(self, rows: int) -> float:
        """What the plan multiplies a drafting round's predicted gain by at `rows` rows this
        round: the measured worth, or 0 (a plain round) / 1 (the prices' own plan) where that
        kind of round has not been seen for `explore_every` rounds at this row count."""
        seen = self._at(rows)
        self._exploring = self._prediction = None  # a round not observed leaves none behind
        if seen.plain_seen.due(seen.rounds, self.explore_every):
            self._exploring = "plain"
            return 0.0
        if seen.draft_seen.due(seen.rounds, self.explore_every):
            self._exploring = "draft"
            # the plan as the prices have it, or bolder: a machine whose prices undersell
            # drafting shows it only in rounds they would not draft
            return max(1.0, min(EXPLORE_BOLDER * seen.worth, WORTH_RANGE[1]))
        return seen.worth

    def explores(self) -> str | None:
        """The kind of round the plan that `worth` just answered explores ("plain", "draft"),
        or None where it explores nothing."""
        return self._exploring

    def predicted(self, rows: int, tokens: float, steps: float, plain_steps: float) -> None:
        """The plan of this round drafts: it expects `tokens` committed tokens for `steps`
        steps, where a plain round of these rows costs `plain_steps`."""
        self._prediction = rows, tokens / rows, steps / plain_steps

    def observe(
        self, fed: Sequence[int], committed: int, seconds: float
    ) -> Correction | Shift | None:
        """One decoding round: `fed[b]` the tokens its target pass took for row b (all 1: a
        plain round), `committed` the tokens it committed, `seconds` what it took. Returns the
        correction it led to, or the change of the machine its plain rounds showed, if any."""
        prediction, self._prediction = self._prediction, None
        exploring, self._exploring = self._exploring, None
        if exploring is not None:
            self.explored += 1
        if not fed or not (math.isfinite(seconds) and seconds > 0):
            return None
        rows = len(fed)
        seen = self._at(rows)
        seen.rounds += 1
        if max(fed) <= 1:
            seen.timed_plain.append((seen.rounds, seconds))
            seen.plain_seen.last = seen.rounds
            return self._watch_plain(rows, seen)
        seen.draft_seen.last = seen.rounds
        if seen.rounds <= SETTLE:
            return None
        if prediction is None or prediction[0] != rows or not seen.timed_plain:
            return None  # a round no plan predicted, or no plain round to weigh it against
        _, tokens, steps = prediction
        seen.drafts.append((seen.rounds, seconds, steps, committed / rows, tokens))
        if exploring == "draft" and committed / rows > seconds / seen.plain_median():
            # an explored drafting round beat a plain one: look again soon, not after a wait
            seen.draft_seen.wait = self.soon
        seen.since_judged += 1
        if len(seen.drafts) < LEAST or seen.since_judged < JUDGE_EVERY:
            return None
        seen.since_judged = 0
        return self._judge(rows, seen)

    def _watch_plain(self, rows: int, seen: _RowCount) -> Shift | None:
        """Plain rounds `CHANGED` times slower or faster than when last looked at, in two
        windows of `PLAIN_MEMORY` in a row (one window's median moves that far in noise and
        stalls): the machine changed (another process started or ended), so what drafting is
        worth may have too; both kinds of round are explored soon, not after the waits grown
        on the machine as it was."""
        seen.plain_count += 1
        if seen.plain_count % PLAIN_MEMORY:
            return None
        now, before = seen.plain_median(), seen.plain_reference
        if before is None:
            seen.plain_reference = now
            return None
        away = abs(math.log(now / before)) > math.log(CHANGED)
        seen.plain_strikes = seen.plain_strikes + 1 if away else 0
        if seen.plain_strikes < 2:
            return None
        seen.plain_reference, seen.plain_strikes = now, 0
        seen.plain_seen.wait = seen.draft_seen.wait = self.soon
        shift = Shift(rows, seen.rounds, now / before)
        self.shifts.append(shift)
        return shift

    def _judge(self, rows: int, seen: _RowCount) -> Correction | None:
        # drafting rounds are weighed against the plain rounds of their own stretch of time:
        # against older ones, a machine that slowed since (another process started) would
        # pass for drafting that pays less
        fresh = [s for at, s in seen.timed_plain if at >= seen.drafts[0][0]]
        if len(fresh) < FRESH:
            seen.plain_seen.wait = 1  # a plain round soon, then weighed
            return None
        plain = statistics.median(fresh)
        rounds = [
            (min(max(seconds / plain, steps / CLIP), steps * CLIP), steps, got, expected)
            for _, seconds, steps, got, expected in seen.drafts
        ]
        taken, steps, got, expected = (sum(c) for c in zip(*rounds, strict=True))
        n = len(rounds)
        gain, predicted = got / taken, expected / steps
        measured = _clamped(gain / predicted)
        # the ratio estimator's standard error (delta method), relative
        residuals = [g - gain * t for t, _, g, _ in rounds]
        spread = math.sqrt(sum(r * r for r in residuals) / (n - 1)) / (taken / n)
        # and the plain reference's own: a median's standard error is about 1.25 a mean's
        reference = 1.25 * statistics.stdev(fresh) / statistics.fmean(fresh) / math.sqrt(len(fresh))
        error = math.hypot(spread / math.sqrt(n) / gain, reference)
        step = math.log(measured / seen.worth)
        if abs(step) <= max(self.confidence * error, self.tolerance):
            return None
        last = seen.last_change
        if (
            last is not None
            and (last.new - last.old) * step < 0
            and seen.rounds - last.round < self.hold
        ):
            return None  # it would reverse the last correction before its hold is over
        change = Correction(rows, seen.rounds, seen.worth, measured, error)
        seen.worth, seen.last_change = measured, change
        seen.plain_seen.wait = seen.draft_seen.wait = 0  # a changed machine is explored afresh
        # the plan drafts other rounds at the new worth (fewer, or more, of the marginal
        # ones): what they deliver is measured afresh
        seen.drafts.clear()
        self.corrections.append(change)
        self.changed = True
        return change

    def snapshot(self) -> dict[int, float]:
        """The worth at each row count seen (what a decoder stores beside its prices)."""
        return {rows: seen.worth for rows, seen in sorted(self.counts.items())}


def _clamped(worth: float) -> float:
    low, high = WORTH_RANGE
    return min(max(worth, low), high) if math.isfinite(worth) else 1.0
