"""What passes cost on this machine: one price model, timed through the model interface.

Every policy that weighs drafting against its cost reads the same `Prices`: the priced plan
(`pass_cost`, `draft_cost`), the head policies (`Prices.rounds`, a round of m drafted tokens at
a row count) and the head replay (the same view, from prices stated by hand). They are timed
rather than assumed because they differ by an order of magnitude between machines and
backends: on a 2-core CPU a 4-bit target on llama.cpp pays about half a step per extra token in
a pass, an fp32 target on prepacked PyTorch kernels almost nothing up to a few tokens, a GPU
nothing up to a tile; and a pass of several rows is not the one-row pass of as many tokens.
Timing goes through `ModelBackend` only, so every backend is priced the same way.

Timing takes seconds to minutes (more rows, longer), so measured prices are kept in the cache
root under a key naming what they depend on (`price_key`): the model files, the backend, its
threads and the CPU. A process of another user can skew a timing, and no timing holds what
a round costs besides its passes; `outcomes.Outcomes` checks what the plan predicts against
the rounds decoding takes, and its measured worth of a predicted gain is kept beside the
prices (`store_prices`), written outside any round. An entry that cannot be read is timed
afresh, and one that cannot be written is kept in memory (`models.atomic`): said once, never
a stop.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdecode.backends.base import ModelBackend
from specdecode.backends.kernels import median_times
from specdecode.models.atomic import say_unreadable, write_or_keep
from specdecode.models.packages import cache_root

logger = logging.getLogger(__name__)

PRICE_CONTEXT_TOKENS = 256  # a prompt's length in the recorded benchmarks
PRICED_TOKENS = 12  # tokens per row timed: 1..12; longer passes extrapolate (`Prices.pass_cost`)
PRICED_ROWS = (1, 2, 4, 8)  # row counts timed, up to the batch asked for; more extrapolate
STATED_TOKENS = 25  # a stated price table's length: rounds of up to 24 drafted tokens exactly
PRICES_DIR = "prices"  # under the cache root
PRICES_ENV = "SPECDECODE_PRICES"  # a folder for them elsewhere (the tests keep theirs apart)
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


# ---- the timer ----


def pass_seconds(
    jobs: Sequence[tuple[ModelBackend, Sequence[int]]],
    context: list[int],
    reps: int,
    rows: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[int, float]]:
    """Median seconds of one pass over `rows` rows, each after `context` and holding n tokens
    (an even pass, `Prices.passes`), for each backend and each n of its counts. Every round
    times every pass of every backend, interleaved, so a stall of the machine (a neighbour's
    burst; on two cores llama.cpp's spinning threads lose whole time slices to any other
    process) lands on one sample of each rather than on every sample of the one timed while it
    lasted. Each pass is rolled back after it, so every one sees the same cache. `clock`: the
    seconds' source (a simulated machine's own)."""
    device = jobs[0][0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def synced() -> float:  # a GPU runs ahead of the host: time the kernels, not their launches
        sync()
        return clock()

    prefix = torch.tensor([context] * rows)  # [rows, context]

    def timed(backend: ModelBackend, start: torch.Tensor, held: torch.Tensor, n: int):
        tokens = start[:, -n:] if len(context) >= n else start[:, -1:].repeat(1, n)  # [rows, n]
        valid = torch.ones_like(tokens, dtype=torch.bool)  # [rows, n]

        def run() -> None:
            backend.forward(tokens, valid, logits_to_keep=n)
            backend.truncate(held)

        return run

    candidates = {}
    for j, (backend, counts) in enumerate(jobs):
        start = prefix.to(backend.device)  # [rows, context], moved once, outside the timing
        backend.reset(rows)
        backend.forward(start, torch.ones_like(start, dtype=torch.bool))
        held = backend.lengths.clone()
        candidates.update({(j, n): timed(backend, start, held, n) for n in counts})
    try:
        seconds = median_times(candidates, reps, synced)
    finally:
        for backend, _ in jobs:
            backend.reset(0)
    return [{n: seconds[j, n] for n in counts} for j, (_, counts) in enumerate(jobs)]


def timed_rows(rows: int) -> tuple[int, ...]:
    """The row counts timed for a batch of `rows`: `PRICED_ROWS` up to it, and it itself while
    it is within their range."""
    most = min(max(rows, 1), PRICED_ROWS[-1])
    return tuple(sorted({r for r in PRICED_ROWS if r <= most} | {most}))


def measure_prices(
    target: ModelBackend,
    drafter: ModelBackend | None,
    vocab_size: int,
    context_length: int | None,
    *,
    rows: int = 1,
    max_tokens: int = PRICED_TOKENS,
    reps: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> Prices:
    """Time even target passes of 1..max_tokens tokens per row and a drafter step, at each row
    count of `timed_rows(rows)`; every curve is made non-decreasing in tokens (`monotone`).
    The target's `pass_layout` (default `padded`) says how its ragged passes go."""
    room = (context_length or 1 << 30) - max_tokens - 1
    if room < 1:
        raise ValueError(f"passes of {max_tokens} tokens do not fit the context")
    context = [(1000 + i) % vocab_size for i in range(min(PRICE_CONTEXT_TOKENS, room))]
    counts = list(range(1, max_tokens + 1))
    measured, drafts = [], []
    for r in timed_rows(rows):
        jobs = [(target, counts)] + ([(drafter, [1])] if drafter is not None else [])
        seconds = pass_seconds(jobs, context, reps, rows=r, clock=clock)
        measured.append(monotone([seconds[0][n] for n in counts]))
        if drafter is not None:
            drafts.append(seconds[1][1])
    step = measured[0][0]
    return Prices(
        timed_rows(rows),
        tuple(tuple(v / step for v in curve) for curve in measured),
        tuple(d / step for d in drafts) if drafter is not None else None,
        step,
        getattr(target, "pass_layout", "padded"),
    )


# ---- the cache ----


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, `platform.processor()` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_identity(backend: ModelBackend) -> dict[str, Any] | None:
    """What a backend's prices depend on besides the machine: its kind, threads, device, its
    files (path, size, modification time) and, on PyTorch, the dtype and the module classes
    (prepacked or int8 layers are other kernels). None: a model with no files to name (built
    in memory), whose prices are not cached."""
    kind = getattr(backend, "backend_kind", None) or type(backend).__name__  # a deferred one's
    info: dict[str, Any] = {"backend": kind, "device": str(backend.device)}
    for name in ("threads", "compiled"):  # llama.cpp's threads; torch-static's compilation
        if getattr(backend, name, None) is not None:
            info[name] = getattr(backend, name)
    path = getattr(backend, "path", None)
    module = getattr(backend, "model", None)
    if path is None and isinstance(module, torch.nn.Module):
        path = getattr(getattr(module, "config", None), "_name_or_path", None) or None
        first = next(module.parameters(), None)
        info["dtype"] = str(first.dtype) if first is not None else None
        info["modules"] = sorted({type(m).__name__ for m in module.modules()})
        info["threads"] = torch.get_num_threads()
    if not path:
        return None
    path = Path(path).expanduser()
    weights = (".gguf", ".safetensors", ".bin")
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in weights)
    if not files:
        return None
    info["files"] = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return info


def price_key(target: ModelBackend, drafter: ModelBackend | None) -> dict[str, Any] | None:
    """The cache key of a pair's prices (None: not cacheable), with the timing plan, so that
    a changed plan times afresh."""
    target_id = model_identity(target)
    drafter_id = model_identity(drafter) if drafter is not None else None
    if target_id is None or (drafter is not None and drafter_id is None):
        return None
    if target.device.type == "cuda":
        machine = torch.cuda.get_device_name(target.device)
    else:
        machine = cpu_name()
    plan = {"context": PRICE_CONTEXT_TOKENS, "tokens": PRICED_TOKENS, "passes": "even"}
    return {"target": target_id, "drafter": drafter_id, "machine": machine, "plan": plan}


def prices_folder(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where prices are kept: `<cache_dir>/prices` when given, else `$SPECDECODE_PRICES`, else
    `prices` under the cache root (`models.packages.cache_root`)."""
    if cache_dir is None and os.environ.get(PRICES_ENV):
        return Path(os.environ[PRICES_ENV]).expanduser()
    return cache_root(cache_dir) / PRICES_DIR


def cache_file(key: dict[str, Any], folder: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return folder / f"{digest}.json"


def _entry(key: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The cache entry under `key`; None where there is none, it holds another key or it is
    unreadable (said once: a damaged entry is timed afresh and written anew)."""
    path = cache_file(key, folder)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        return entry if entry["key"] == json.loads(json.dumps(key)) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        _unreadable(path, error)
        return None


def _unreadable(path: Path, error: Exception, instead: str = "timing the passes afresh") -> None:
    say_unreadable(logger, "prices entry", path, error, instead)


def load_prices(key: dict[str, Any], folder: Path, rows: int = 1) -> Prices | None:
    """The cached prices under `key` if they cover `timed_rows(rows)`; None where there are
    none, the file is unreadable or holds another key (then they are timed afresh)."""
    entry = _entry(key, folder)
    try:
        prices = Prices.from_json(entry["prices"]) if entry is not None else None
    except (ValueError, KeyError, TypeError) as error:
        _unreadable(cache_file(key, folder), error)
        return None
    if prices is None or prices.step_seconds is None or prices.rows[-1] < timed_rows(rows)[-1]:
        return None
    if (prices.drafts is None) != (key["drafter"] is None):
        return None
    return prices


def load_worth(key: dict[str, Any], folder: Path) -> dict[int, float]:
    """The worth of the plan's predicted gains by row count stored beside the prices under
    `key` (`outcomes.Outcomes`); empty where there is none or it cannot be read."""
    try:
        stored = (_entry(key, folder) or {}).get("worth", {})
        worth = {int(r): float(v) for r, v in stored.items()}
    except (ValueError, TypeError, AttributeError) as error:
        _unreadable(cache_file(key, folder), error, "what drafting is worth starts afresh")
        return {}
    return {r: v for r, v in worth.items() if r >= 1 and _positive(v)}


def store_prices(
    key: dict[str, Any], prices: Prices, folder: Path, worth: dict[int, float] | None = None
) -> Path | None:
    """Write the prices (and the plan's measured worth by row count) under `key` atomically:
    a temporary file of a unique name renamed over the entry, so a reader never sees half a
    file and two writers never mix theirs. The entry's path; None where the cache cannot be
    written (said once per process): the caller's prices hold in memory."""
    path = cache_file(key, folder)
    entry: dict[str, Any] = {"key": key, "prices": prices.to_json()}
    if worth:
        entry["worth"] = {str(r): v for r, v in sorted(worth.items())}
    text = json.dumps(entry, indent=1) + "\n"
    return path if write_or_keep(path, lambda out: out.write(text), "prices", logger) else None
