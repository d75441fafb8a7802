"""The price book: what passes cost on this machine, timed through the model interface, kept
in the cache, and corrected by what drafting delivers.

Timing goes through `ModelBackend` only, so every backend is priced the same way
(`measure_prices`; the model it fills is `core.prices.Prices`). Timing takes seconds to
minutes (more rows, longer), so measured prices are kept in the cache root under a key naming
what they depend on (`price_key`): the model files, the backend, its threads and the CPU. A
process of another user can skew a timing, and no timing holds what a round costs besides its
passes; `outcomes.Outcomes` checks what the plan predicts against the rounds decoding takes,
and its measured worth of a predicted gain is kept beside the prices (`store_prices`), written
outside any round. An entry that cannot be read is timed afresh, and one that cannot be
written is kept in memory (`models.atomic`): said once, never a stop. A decoder keeps its
prices and their judge in one `PriceBook`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specdecode.backends.base import ModelBackend
from specdecode.backends.kernels import median_times
from specdecode.core.outcomes import Outcomes, Shift
from specdecode.core.prices import (
    PRICE_CONTEXT_TOKENS,
    PRICED_ROWS,
    PRICED_TOKENS,
    Prices,
    monotone,
)
from specdecode.models.atomic import say_unreadable, write_or_keep
from specdecode.models.packages import cache_root

logger = logging.getLogger(__name__)
log = logging.getLogger("specdecode")

PRICES_DIR = "prices"  # under the cache root
PRICES_ENV = "SPECDECODE_PRICES"  # a folder for them elsewhere (the tests keep theirs apart)


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
    return {r: v for r, v in worth.items() if r >= 1 and math.isfinite(v) and v > 0}


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


# ---- a decoder's prices ----


class PriceBook:
    """One decoder's prices and drafting's judge (`outcomes.Outcomes`, what the plan's predicted
    gains have been worth), with the cache entry they came by. The drafter is asked for at
    each reading: `drafter()` as it stands (a deferred one unloaded, its files keying the
    entry), `load_drafter()` loaded to be timed."""

    def __init__(
        self,
        target: ModelBackend,
        drafter: Callable[[], Any],
        load_drafter: Callable[[], ModelBackend | None],
        vocab_size: int,
        context: int | None,
    ) -> None:
        self.target, self.drafter, self.load_drafter = target, drafter, load_drafter
        self.vocab_size, self.context = vocab_size, context
        self.known: Prices | None = None
        self.outcomes: Outcomes | None = None
        self.entry: tuple[dict, Path] | None = None  # the cache key and root they came by

    def prices(
        self,
        rows: int = 1,
        retime: bool = False,
        cache_dir: str | Path | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> Prices:
        """The prices for batches of up to `rows` rows (`SpeculativeDecoder.prices`): kept,
        read from the cache, or timed and stored."""
        wanted = timed_rows(rows)[-1]
        if not retime and self.known is not None and self.known.rows[-1] >= wanted:
            return self.known
        key = price_key(self.target, self.drafter())
        root = prices_folder(cache_dir)
        found = None if retime or key is None else load_prices(key, root, rows)
        worth = load_worth(key, root) if key is not None else {}
        if found is None:
            found = measure_prices(
                self.target, self.load_drafter(), self.vocab_size, self.context, rows=rows,
                clock=clock,
            )  # fmt: skip
            if key is not None:
                store_prices(key, found, root, worth)  # unwritable: said once, kept
        self.known = found
        if self.outcomes is None:  # a timing for more rows keeps what rounds have shown
            self.outcomes = Outcomes(worth)
        self.entry = (key, root) if key is not None else None
        return found

    def use(self, prices: Prices) -> None:
        """Take prices found elsewhere (`SpeculativeDecoder.use_prices`): not stored anew, and
        what drafting has been worth starts afresh."""
        self.known, self.outcomes, self.entry = prices, Outcomes(), None

    def observe(self, fed: Sequence[int], committed: int, seconds: float) -> bool:
        """Feed one timed round to drafting's judge (`SpeculativeDecoder.observe_round`)."""
        if self.outcomes is None:
            return False
        if self.target.moving_pages:  # slower for now, not mispriced
            return False
        change = self.outcomes.observe(fed, committed, seconds)
        if change is None:
            return False
        if isinstance(change, Shift):
            log.warning(
                "plain rounds at %d row(s) take %.2fx as long as before (another process "
                "started or ended?): drafting and plain rounds are both tried again soon",
                change.rows, change.ratio,
            )  # fmt: skip
            return False
        log.warning(
            "drafting at %d row(s) delivers %.2fx the gain its prices predict (was %.2fx, "
            "+-%.2f): the plan drafts accordingly",
            change.rows, change.new, change.old, change.standard_error,
        )  # fmt: skip
        return True

    def store(self) -> None:
        """Store what drafting has been worth beside the prices, where it changed
        (`SpeculativeDecoder.store_outcomes`)."""
        outcomes, entry = self.outcomes, self.entry
        if outcomes is None or not outcomes.changed or entry is None or self.known is None:
            return
        key, root = entry
        store_prices(key, self.known, root, outcomes.snapshot())
        outcomes.changed = False


class LivePrices:
    """A price book's current prices, read anew at every call (a `PriceModel`): a later timing
    for more rows replaces them under a running drafter."""

    def __init__(self, book: PriceBook) -> None:
        self.book = book

    def shape_cost(self, counts: Sequence[int]) -> float:
        return self.book.known.shape_cost(counts)

    def even_cost(self, rows: int, per_row: float) -> float:
        return self.book.known.even_cost(rows, per_row)

    def draft_cost(self, rows: int) -> float | None:
        return self.book.known.draft_cost(rows)
