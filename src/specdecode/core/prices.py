"""What passes cost on this machine: one price model, whatever timed or stated it.

Every policy that weighs drafting against its cost reads the same `Prices`: the priced plan
(`pass_cost`, `draft_cost`), the head policies (`Prices.rounds`, a round of m drafted tokens at
a row count) and the head replay (the same view, from prices stated by hand). They are timed
rather than assumed because they differ by an order of magnitude between machines and
backends: on a 2-core CPU a 4-bit target on llama.cpp pays about half a step per extra token in
a pass, an fp32 target on prepacked PyTorch kernels almost nothing up to a few tokens, a GPU
nothing up to a tile; and a pass of several rows is not the one-row pass of as many tokens.
This module is the price model alone, read by the core and the benches; timing the passes
through `ModelBackend` and keeping what was timed in the cache is the price book's
(`specdecode.pricebook`), outside the core, which reads and writes no files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

PRICE_CONTEXT_TOKENS = 256  # a prompt's length in the recorded benchmarks
PRICED_TOKENS = 12  # tokens per row timed: 1..12; longer passes extrapolate (`Prices.pass_cost`)
PRICED_ROWS = (1, 2, 4, 8)  # row counts timed, up to the batch asked for; more extrapolate
STATED_TOKENS = 25  # a stated price table's length: rounds of up to 24 drafted tokens exactly
LAYOUTS = ("padded", "levels")  # how a backend runs a pass whose rows hold different counts


@dataclass(frozen=True)
class Prices:
    """What a target pass and a drafter step cost here, in steps: one step is a target pass of
    one row and one token, `step_seconds` long (None where the prices were stated, not timed).

    `passes[i][t - 1]` is a target pass over `rows[i]` rows holding t tokens each (an even
    pass); `drafts[i]` a drafter step over `rows[i]` rows (None: no drafter model priced).
    `layout` says how the backend runs a round's ragged pass, whose rows hold different
    counts (`shape_cost`):

    * `padded` (PyTorch): one block as wide as its longest row; the shorter rows ride free.
    * `levels` (llama.cpp, a cache stream per row): a pass per level of the counts (every row
      with tokens left gives the same number to each), so a pass where four of eight rows
      draft one token costs an even pass of eight rows and another of four, more than the
      even pass where all eight draft one.

    Between the measured row counts and tokens the cost is read linearly; beyond them it is
    extrapolated so as not to undersell a pass (`even_cost`).
    """

    rows: tuple[int, ...]
    passes: tuple[tuple[float, ...], ...]
    drafts: tuple[float, ...] | None = None
    step_seconds: float | None = None
    layout: str = "padded"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"a pass layout is one of {LAYOUTS}, got {self.layout!r}")
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        object.__setattr__(self, "passes", tuple(tuple(map(float, p)) for p in self.passes))
        if self.drafts is not None:
            object.__setattr__(self, "drafts", tuple(float(d) for d in self.drafts))
        if (
            not self.rows
            or self.rows[0] != 1
            or any(a >= b for a, b in itertools.pairwise(self.rows))
        ):
            raise ValueError(f"prices need row counts rising from 1, got {self.rows}")
        if len(self.passes) != len(self.rows) or len({len(p) for p in self.passes}) != 1:
            raise ValueError("prices need one pass curve per row count, all of one length")
        if not self.passes[0] or any(not _positive(v) for p in self.passes for v in p):
            raise ValueError(f"target pass prices must be finite numbers > 0, got {self.passes}")
        if self.drafts is not None and (
            len(self.drafts) != len(self.rows)
            or any(not (math.isfinite(d) and d >= 0) for d in self.drafts)
        ):
            raise ValueError(
                f"drafter step prices must be finite numbers >= 0, one per row count, got "
                f"{self.drafts}"
            )
        if self.step_seconds is not None and not _positive(self.step_seconds):
            raise ValueError(f"a step's seconds must be finite and > 0, got {self.step_seconds}")

    @classmethod
    def stated(
        cls, draft: float, verify_slope: float = 0.0, verify_curve: Sequence[float] = ()
    ) -> Prices:
        """One-row prices given as a round's parts, in steps: a drafted token, and the verify
        pass over m drafted tokens, `verify_curve[m - 1]` (past its end, its last entry plus
        `verify_slope` a token; with no curve, 1 + verify_slope m). What the head replay's
        options and the studies state by hand."""
        checked = [("draft", draft), ("verify_slope", verify_slope)]
        checked += [("verify_curve", v) for v in verify_curve]
        for name, value in checked:
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"stated {name} must be a finite number >= 0, got {value}")
        curve = [float(v) for v in verify_curve]
        last, known = (curve[-1], len(curve)) if curve else (1.0, 0)
        size = max(len(curve) + 1, STATED_TOKENS)
        verify = [
            curve[m - 1] if m <= known else last + verify_slope * (m - known)
            for m in range(1, size)
        ]
        return cls((1,), ((1.0, *verify),), (float(draft),))

    @property
    def most_tokens(self) -> int:
        """Tokens per row timed (or stated); longer passes are extrapolated."""
        return len(self.passes[0])

    def even_cost(self, rows: int, per_row: float) -> float:
        """A target pass over `rows` rows holding `per_row` tokens each, in steps. Between
        measured row counts the cost is linear in the rows; past the largest, R, a pass of n
        rows costs n / R passes of R rows: no gain from batching is assumed that was not
        measured."""
        if rows < 1 or per_row < 1:
            raise ValueError(f"a pass holds at least one row and one token, got {rows}, {per_row}")
        return self._by_rows(rows, [_along(curve, per_row) for curve in self.passes])

    def shape_cost(self, counts: Sequence[int]) -> float:
        """A target pass whose rows hold `counts[b]` tokens (each >= 1), in steps, as the
        backend runs it (`layout`)."""
        if not counts or min(counts) < 1:
            raise ValueError(f"a pass holds at least one row and one token a row, got {counts}")
        if self.layout == "padded":
            return self.even_cost(len(counts), max(counts))
        cost, below, rows = 0.0, 0, len(counts)
        for level in sorted(counts):  # the rows holding more than `below` give a pass each
            if level > below:
                cost += self.even_cost(rows, level - below)
                below = level
            rows -= 1
        return cost

    def pass_cost(self, rows: int, tokens: int) -> float:
        """A pass over `rows` rows holding `tokens` tokens in all, every token beyond one a row
        in one row: the round where one row drafts and the others decode."""
        if rows < 1 or tokens < 1:
            raise ValueError(f"a pass holds at least one row and one token, got {rows}, {tokens}")
        return self.shape_cost([1 + max(tokens - rows, 0)] + [1] * (rows - 1))

    def draft_cost(self, rows: int) -> float | None:
        """A drafter step over `rows` rows, in steps (None: no drafter model priced)."""
        if self.drafts is None:
            return None
        if rows < 1:
            raise ValueError(f"a drafter step holds at least one row, got {rows}")
        return self._by_rows(rows, list(self.drafts))

    def _by_rows(self, rows: int, values: list[float]) -> float:
        known = self.rows
        if rows >= known[-1]:
            return values[-1] * rows / known[-1]
        upper = next(i for i, r in enumerate(known) if r > rows)
        low, high = known[upper - 1], known[upper]
        share = (rows - low) / (high - low)
        return values[upper - 1] + share * (values[upper] - values[upper - 1])

    def rounds(self, rows: int = 1) -> RoundCosts:
        """These prices as a round's parts at `rows` rows: what head policies weigh."""
        return RoundCosts(self, rows)

    def scaled(self, row_index: int, factor: float) -> Prices:
        """The prices with the target passes and the drafter step of `rows[row_index]` rows
        times `factor`; index 0 (the unit's own row count) rescales the step's seconds."""
        if not _positive(factor):
            raise ValueError(f"a price factor must be finite and > 0, got {factor}")
        if row_index == 0:
            if self.step_seconds is None:
                raise ValueError("stated prices have no seconds to rescale")
            return replace(self, step_seconds=self.step_seconds * factor)
        passes = list(self.passes)
        passes[row_index] = tuple(v * factor for v in passes[row_index])
        drafts = None
        if self.drafts is not None:
            drafts = tuple(d * factor if i == row_index else d for i, d in enumerate(self.drafts))
        return replace(self, passes=tuple(passes), drafts=drafts)

    def describe(self) -> str:
        seconds = f"a step {self.step_seconds * 1e3:.1f} ms; " if self.step_seconds else ""
        parts = []
        for i, rows in enumerate(self.rows):
            passes = " / ".join(f"{v:.2f}" for v in self.passes[i])
            drafter = f"; a drafter step {self.drafts[i]:.2f}" if self.drafts is not None else ""
            parts.append(f"{rows} row(s), 1.. tokens each: {passes}{drafter}")
        return seconds + " | ".join(parts) + f" (steps; ragged passes {self.layout})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Prices:
        drafts = data.get("drafts")
        return cls(
            tuple(data["rows"]),
            tuple(tuple(p) for p in data["passes"]),
            tuple(drafts) if drafts is not None else None,
            data.get("step_seconds"),
            data.get("layout", "padded"),
        )


@dataclass(frozen=True)
class RoundCosts:
    """A row's round at `rows` rows, in steps: `draft` a drafted token (a drafter step over the
    rows), `verify(m)` the target's pass in which this row holds its m drafted tokens and the
    next one, the others one token each (`Prices.pass_cost`).

    The SpecDec++ threshold rule is the optimal stop when every verify pass costs the same. A
    real pass does not: on a CPU its products turn compute-bound past a few tokens, on a GPU at
    a tile boundary or a larger batch. A head policy given these weighs each further token
    against what it adds to the round's cost (`length_policies.HeadLength`); the head replay
    counts rounds at `round_cost`.
    """

    prices: Prices
    rows: int = 1

    @property
    def draft(self) -> float:
        return self.prices.draft_cost(self.rows) or 0.0

    def verify(self, drafted: int) -> float:
        return self.prices.pass_cost(self.rows, self.rows + drafted)

    def round_cost(self, drafted: int) -> float:
        """A round that drafts `drafted` tokens: its verify pass and its drafter steps."""
        return self.verify(drafted) + self.draft * drafted

    def added_cost(self, drafted: int, more: int) -> float:
        """Steps that drafting `more` tokens after `drafted` adds to the round (drafts and the
        verify pass's growth); drafted = 0 is the round's start (no verify pass priced yet)."""
        grown = self.verify(drafted + more) - (self.verify(drafted) if drafted else 0.0)
        return more * self.draft + grown

    def describe(self, most_drafted: int = 8) -> str:
        verify = " / ".join(f"{self.verify(m):.2f}" for m in range(1, most_drafted + 1))
        return (
            f"a drafted token {self.draft:.3f} steps; a verify pass of 1..{most_drafted} "
            f"drafted: {verify}"
        )


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _along(curve: tuple[float, ...], per_row: float) -> float:
    """The curve (entry t - 1: t tokens) at `per_row` tokens: linear between its points; past
    its end, the line through its upper half. Not the last step's slope: two neighbouring
    timings are as noisy as their difference, and a flat last step once priced a batch of 8
    rows of 9 tokens at the cost of 12 tokens, which made the plan draft where it lost
    to plain decoding. Never under the mean growth per token over the whole curve."""
    known = len(curve)
    if per_row <= known:
        low = math.floor(per_row)
        if low >= known:
            return curve[-1]
        share = per_row - low
        return curve[low - 1] + share * (curve[low] - curve[low - 1])
    if known == 1:
        return curve[0] * per_row
    half = max(known // 2, 1)
    slope = (curve[-1] - curve[half - 1]) / (known - half)
    slope = max(slope, (curve[-1] - curve[0]) / (known - 1), 0.0)
    return curve[-1] + slope * (per_row - known)


def monotone(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares; pooling adjacent violators): a pass
    of more tokens never costs less, and a timing that says so is noise, spread over its
    neighbours rather than kept."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [s / c for s, c in blocks for _ in range(int(c))]
