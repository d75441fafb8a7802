"""Back a model's freshly allocated weights with 2 MiB pages (Linux transparent huge pages).

Why: a decoding step streams every weight once. llama.cpp's CPU buffers come from
`posix_memalign`, which Linux backs with 4 KiB pages unless the process asks for more (the
common `transparent_hugepage=madvise` setting), so a model of a gigabyte is hundreds of thousands
of pages and nearly every page of a step misses the TLB; in 2 MiB pages the same buffers make a
step faster (`docs/findings.md`, 12, has the measurements). The weights are read into anonymous
memory (llama.cpp's load mode "none", not a file mapping, which huge pages cannot back here) and
this module then asks the kernel to collapse the new regions: `madvise(MADV_HUGEPAGE)` so later
faults get huge pages, then `MADV_COLLAPSE` (Linux 6.1+) to move what is already there. Where the
kernel or its settings refuse, nothing changes but the speed: `collapse` reports what
it managed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from specdecode.models.atomic import say_unreadable, write_or_keep
from specdecode.models.packages import cache_root

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_REGION = 16 * 1024 * 1024  # weights and caches are larger; small heaps are left alone

Region = tuple[int, int]  # [start, end) of a mapping


def available() -> bool:
    """Whether this kernel lets a process ask for transparent huge pages (Linux, THP built in
    and not switched to "never"); `MADV_COLLAPSE` needs Linux 6.1 besides."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and tuple(map(int, _kernel()[:2])) >= (6, 1)


def _kernel() -> list[str]:
    release = os.uname().release.split("-")[0].split(".")
    return [part if part.isdigit() else "0" for part in release] + ["0", "0"]


def anonymous_regions() -> set[Region]:
    """The process's private, writable, anonymous mappings (no file behind them)."""
    regions: set[Region] = set()
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # not Linux
        return regions
    for line in lines:
        fields = line.split()
        if len(fields) == 5 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.add((start, end))
    return regions


def _madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def collapse_new_regions(
    before: set[Region], progress: Callable[[int, int], None] | None = None
) -> int:
    """Ask for huge pages on every anonymous region that is not in `before` (`collapse`)."""
    return collapse(anonymous_regions() - before, progress)


def collapse(regions: set[Region], progress: Callable[[int, int], None] | None = None) -> int:
    """Ask for huge pages on each of `regions` of at least `MIN_REGION` bytes; returns the
    bytes the kernel collapsed (0 where it could not). `progress` hears (bytes tried so far,
    bytes to try) after each huge page. The regions are taken as given: a model's weights are
    named when they load, so a move that starts later leaves alone what was mapped since (the
    caches, a corpus index, the interpreter's heap), which is no weight, was not timed, and
    would make the move, and every pass beside it, take longer."""
    if os.name != "posix":
        return 0
    try:
        madvise = _madvise()
    except (OSError, AttributeError):
        return 0
    collapsed = tried = 0
    spans = []  # whole huge pages inside each new region large enough
    for start, end in sorted(regions):
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi - lo >= MIN_REGION:
            spans.append((lo, hi))
    total = sum(hi - lo for lo, hi in spans)
    for lo, hi in spans:
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            continue  # THP off ("never") or not built into this kernel
        for page in range(lo, hi, HUGE_PAGE):  # page by page: one that cannot be collapsed
            # (never written, say) fails the whole call
            if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
            tried += HUGE_PAGE
            if progress is not None:
                progress(tried, total)
    return collapsed


def resident_bytes(path: str | os.PathLike[str]) -> int:
    """Resident bytes of this process's mappings of the file at `path` (0 off Linux)."""
    target = str(Path(path).resolve())
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    total = 0
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head, _, rest = block.partition("\n")
        if head.split(maxsplit=5)[5:] == [target]:
            found = re.search(r"^Rss:\s+(\d+) kB", rest, re.MULTILINE)
            total += int(found.group(1)) * 1024 if found else 0
    return total


def release_file_pages(path: str | os.PathLike[str]) -> int:
    """Unmap this process's pages of every mapping of the file at `path` (`MADV_DONTNEED`);
    returns the bytes of address space released (0 where the file is not mapped, or not on
    Linux).

    Why: llama.cpp maps a GGUF file, then copies most of its weights into repacked CPU buffers
    for faster kernels, and the copied pages stay mapped, counted in the process's resident
    memory a second time though never read again (most of a Q4_K_M model, as docs/findings.md
    measured). The pages
    stay in the page cache: the tensors still read from the mapping (the token embeddings, say)
    fault back in on their first pass at the cost of a minor fault each, the rest are the
    kernel's to reclaim.
    """
    target = str(Path(path).resolve())
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
        madvise = _madvise()
    except (OSError, AttributeError):  # not Linux
        return 0
    released = 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if madvise(start, end - start, MADV_DONTNEED) == 0:
                released += end - start
    return released


# ------------------------------------------------------------------ whether they pay, here
# The gain is the machine's: where the TLB covers more (or page walks are cheaper) a step gains
# nothing, and the move still costs seconds at every load (the weights are read and copied
# instead of mapped). `decide` measures it once per CPU model, THP setting and model file and
# keeps the verdict in the cache root.

DECISIONS_FILE = "hugepages.json"  # in the cache root: one verdict per machine and model file
VERDICT = "2 MiB-page verdict"  # what the file holds, in messages
# the least step-time ratio (4 KiB pages over 2 MiB pages) that pays for moving the weights:
# below it, the seconds the move adds to every load outweigh what the steps gain
MIN_GAIN = 1.05
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# (seconds of a one-token step with the weights in 4 KiB pages, the same in 2 MiB pages)
StepTimes = tuple[float, float]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the machine type where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return os.uname().machine


def decision_key(model: str | os.PathLike[str]) -> str:
    """What a verdict depends on: the CPU model, the kernel's THP setting and the model file
    (its full path and size: the same weights elsewhere are measured again)."""
    path = Path(model).resolve()
    try:
        thp = THP_SETTING.read_text().strip()
    except OSError:
        thp = "none"
    size = path.stat().st_size if path.is_file() else 0
    return f"{cpu_model()} | thp {thp} | {path} ({size} bytes)"


def _read_decisions(file: Path) -> dict:
    """The verdicts recorded so far; none where the file is missing, unreadable or damaged (a
    damaged file is measured again and rewritten, never trusted; said once)."""
    try:
        table = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(table, dict):
            raise ValueError(f"a JSON {type(table).__name__}, not an object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        say_unreadable(logger, f"{VERDICT} file", file, error, "measuring again")
        return {}
    return table


def _valid(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("huge_pages"), bool)
        and all(isinstance(entry.get(k), (int, float)) for k in ("step_s_4k", "step_s_2m"))
    )


def decide(
    model: str | os.PathLike[str],
    measure: Callable[[], StepTimes],
    cache_dir: str | os.PathLike[str] | None = None,
) -> bool:
    """Whether to move `model`'s weights to 2 MiB pages on this machine: the recorded verdict,
    else `measure()` once (a one-token step timed with and without) and the verdict recorded.

    False without measuring where the kernel cannot move pages (`available`). The record is
    written to a temporary file and renamed; where the cache cannot be written, the verdict
    still holds for this process (said once) and the next one measures again.
    """
    if not available():
        return False
    file = cache_root(cache_dir) / DECISIONS_FILE
    key = decision_key(model)
    entry = _read_decisions(file).get(key)
    if _valid(entry):
        return entry["huge_pages"]
    if entry is not None:
        error = ValueError("this model's entry lacks its verdict or timings")
        say_unreadable(logger, f"{VERDICT} file", file, error, "measuring again")
    step_4k, step_2m = measure()
    huge = step_4k >= MIN_GAIN * step_2m
    _update(file, key, {"huge_pages": huge, "step_s_4k": step_4k, "step_s_2m": step_2m})
    return huge


def _update(file: Path, key: str, entry: dict) -> None:
    """Write `entry` under `key`, merged into what the file holds now (another process may have
    added its own meanwhile): to a temporary file, renamed (`models.atomic`). Where the cache
    cannot be written, nothing is kept (said once)."""
    table = _read_decisions(file)
    table[key] = {**(table.get(key) or {}), **entry}
    write_or_keep(
        file, lambda out: json.dump(table, out, indent=1, sort_keys=True), VERDICT, logger
    )


# ------------------------------------------------------------------ when the move pays
# A verdict says the steps gain; the move itself still costs seconds of a core (the kernel
# copies every page), and on a machine of few cores those seconds come out of the passes running
# beside it: a run of a few tokens never earns them back. So a move is timed where it runs, in
# one-token steps of the same model in the same process (`record_move`: a unit that a busy
# machine slows alike), and a model moves only once the work justifies it: where the caller
# knows how many passes it will run, not at all if they cannot repay the move (`pays_within`);
# else once the passes run so far would have repaid it (`Mover`). That rule never loses more
# than the move's own cost over moving at once (the rent-or-buy bound), whatever the run's
# length, and needs no constant of this machine.


def recorded(model: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None):
    """The verdict recorded for `model` here (with `move_steps`, the move's cost in one-token
    steps, once a move was timed), or None."""
    entry = _read_decisions(cache_root(cache_dir) / DECISIONS_FILE).get(decision_key(model))
    return entry if _valid(entry) else None


def record_move(
    model: str | os.PathLike[str], steps: float, cache_dir: str | os.PathLike[str] | None = None
) -> None:
    """Keep what a move of `model`'s weights cost, in one-token steps, beside its verdict: the
    most any move was timed at. A busy machine understates it (llama.cpp's threads wait on
    each other, so its steps slow far more than the kernel's copying does), and an understated
    cost would move the weights for runs too short to repay it."""
    file = cache_root(cache_dir) / DECISIONS_FILE
    key = decision_key(model)
    entry = _read_decisions(file).get(key)
    if _valid(entry) and steps >= 0:
        _update(file, key, {"move_steps": max(steps, move_steps(entry) or 0.0)})


def gain_fraction(entry: dict) -> float:
    """The share of a step that 2 MiB pages save, by the verdict's timings (a ratio: both were
    timed side by side, so a busy machine slowed both alike)."""
    step_4k, step_2m = entry["step_s_4k"], entry["step_s_2m"]
    return max(0.0, 1.0 - step_2m / step_4k) if step_4k > 0 else 0.0


def move_steps(entry: dict | None) -> float | None:
    """The recorded cost of a move in one-token steps, or None where none was timed yet."""
    steps = (entry or {}).get("move_steps")
    return float(steps) if isinstance(steps, (int, float)) and steps >= 0 else None


def pays_within(entry: dict | None, passes: int) -> bool:
    """Whether `passes` passes save, by the verdict's gain, at least the recorded cost of the
    move. True where no move was timed yet (a move is how it gets timed)."""
    cost = move_steps(entry)
    if entry is None or cost is None:
        return True
    return passes * gain_fraction(entry) >= cost


class Mover:
    """When a model's waiting move starts: `due(passes)` turns true once the passes run so far
    would, by the verdict's gain, have repaid the move's recorded cost; at once where no cost
    is recorded (or no verdict is)."""

    def __init__(self, entry: dict | None) -> None:
        self.gain = gain_fraction(entry) if entry is not None else 0.0
        cost = move_steps(entry)
        self.cost = cost if self.gain > 0 else None

    def due(self, passes: int) -> bool:
        return self.cost is None or passes * self.gain >= self.cost
