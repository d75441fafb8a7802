"""A loaded model's move to 2 MiB pages: decided at its load, run beside its passes, timed.

Why apart from `hugepages`: that module moves pages and keeps this machine's verdict and a
move's cost; this one applies them to one model: whether its load reads the weights into
memory that can move (`plan_move`), when the move starts, in a thread beside the passes, and
what it cost in the model's own one-token steps (`PageMove`), and the two loads the verdict
times side by side (`time_huge_pages`).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from specdecode.backends import hugepages
from specdecode.backends.hugepages import Mover, Region, StepTimes, collapse


class SteppedModel(Protocol):
    """What `time_huge_pages` steps: a backend whose weights may be in 2 MiB pages."""

    @property
    def huge_page_bytes(self) -> int: ...

    def reset(self, batch_size: int) -> None: ...

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> Any: ...

    def close(self) -> None: ...


def time_huge_pages(load: Callable[[str, bool], SteppedModel], steps: int = 8) -> StepTimes:
    """Median seconds of a one-token step of one model loaded twice by `load(role,
    huge_pages)`: its weights in llama.cpp's file mapping (4 KiB pages), and read into memory
    moved to 2 MiB pages.

    Both copies are loaded at once and stepped in turn, so a burst of other work on the
    machine slows both alike. Where the kernel moves nothing, the two are the same pages and
    the times are returned as equal (no gain), without timing.
    """
    plain = load("4 KiB pages", False)
    huge = None
    try:
        huge = load("2 MiB pages", True)
        token = torch.zeros(1, 1, dtype=torch.long)  # [1, 1]
        valid = torch.ones(1, 1, dtype=torch.bool)
        if huge.huge_page_bytes == 0:
            return 1.0, 1.0
        times: dict[int, list[float]] = {0: [], 1: []}
        models = (plain, huge)
        for model in models:
            model.reset(1)
            model.forward(token, valid)  # faults the file mapping in; not timed
        for step in range(steps):
            for which in (0, 1) if step % 2 == 0 else (1, 0):
                start = time.perf_counter()
                models[which].forward(token, valid)
                times[which].append(time.perf_counter() - start)
        return statistics.median(times[0]), statistics.median(times[1])
    finally:
        plain.close()
        if huge is not None:
            huge.close()


def plan_move(
    path: str | os.PathLike[str],
    huge_pages: bool | None,
    passes: int | None,
    measure: Callable[[], StepTimes],
) -> tuple[bool, Mover | None, bool]:
    """Whether a load of `path` reads its weights into memory that can move to 2 MiB pages,
    the `Mover` its move waits on (None: it starts at once), and whether the weights stay in
    4 KiB pages although 2 MiB pages would gain (`LlamaCppModel`'s `huge_pages`, `passes`)."""
    if huge_pages is not None:
        return huge_pages, None, False
    if not hugepages.decide(path, measure):
        return False, None, False
    entry = hugepages.recorded(path)
    if passes is not None and not hugepages.pays_within(entry, passes):
        return False, None, True  # mapped as shipped: no copy, no move
    return True, Mover(entry), False


class PageMove:
    """One model's weights on their way to 2 MiB pages.

    The move runs beside the passes rather than before them: it takes seconds, which a short
    answer would wait for and not get back (the kernel moves each page in place; the passes
    read the same bytes throughout). A decided move also waits until the passes have earned
    it (`mover`)."""

    def __init__(
        self,
        path: Path,
        role: str,
        regions: set[Region] | None,
        mover: Mover | None,
        slower: bool,
    ) -> None:
        self.path = path
        self.role = role
        self.moved = 0  # bytes moved, once the move ends
        self.thread: threading.Thread | None = None
        self.regions = regions  # the weights' regions, until the move starts
        self.mover = mover
        self.slower = slower  # the weights stay in 4 KiB pages although 2 MiB would gain
        self.passes = 0  # the model's passes so far
        self.step_seconds: deque[float] = deque(maxlen=64)  # the latest one-token steps'
        if regions is not None and (mover is None or mover.due(0)):
            self.start()

    def before_pass(self) -> None:
        """Start a waiting move once the passes so far have earned it; count this pass."""
        if self.regions is not None and self.mover is not None and self.mover.due(self.passes):
            self.start()
        self.passes += 1

    def start(self) -> None:
        """Move the weights' regions to 2 MiB pages in a thread. A decided move is timed and
        its cost kept beside the verdict, in this model's one-token steps (`hugepages.Mover`
        weighs it next time): estimated once half the pages are moved, as a short run may end
        before the move does, and again at its end. Steps that ran beside the move count
        slower than they are, so the cost is rather under- than overstated."""
        regions, self.regions = self.regions, None
        if regions is None:
            return
        timed = self.mover is not None
        start = time.perf_counter()
        halfway = [False]

        def record(done: int, total: int) -> None:
            if not self.step_seconds or done <= 0:
                return
            seconds = (time.perf_counter() - start) * total / done
            hugepages.record_move(self.path, seconds / statistics.median(self.step_seconds))

        def progress(done: int, total: int) -> None:
            if timed and not halfway[0] and 2 * done >= total and self.step_seconds:
                halfway[0] = True
                record(done, total)

        def move() -> None:
            self.moved = collapse(regions, progress)
            if timed and self.moved:
                record(1, 1)

        self.thread = threading.Thread(target=move, name=f"{self.role}-2MiB-pages", daemon=True)
        self.thread.start()

    @property
    def moving(self) -> bool:
        """Being moved, waiting to be, or left in 4 KiB pages for a run too short to repay the
        move (`LlamaCppModel.moving_pages`)."""
        moving = self.thread is not None and self.thread.is_alive()
        return moving or self.regions is not None or self.slower

    def finish(self) -> int:
        """Bytes moved to 2 MiB pages, after starting a waiting move and waiting for it."""
        self.start()
        self.join()
        return self.moved

    def join(self) -> None:
        """Wait for a running move: it reads the weights' pages, which stay until it ends."""
        if self.thread is not None:
            self.thread.join()
