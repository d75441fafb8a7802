"""Back a model's freshly allocated weights with 2 MiB pages (Linux transparent huge pages).

Why: a decoding step streams every weight once. llama.cpp's CPU buffers come from
`posix_memalign`, which Linux backs with 4 KiB pages unless the process asks for more (the
common `transparent_hugepage=madvise` setting), so a model of a gigabyte is hundreds of thousands
of pages and nearly every page of a step misses the TLB; in 2 MiB pages the same buffers make a
step faster (`docs/findings.md`, 12, has the measurements). The weights are read into anonymous
memory (llama.cpp's load mode "none", not a file mapping, which huge pages cannot back here) and
this module then asks the kernel to collapse the new regions: `madvise(MADV_HUGEPAGE)` so later
faults get huge pages, then `MADV_COLLAPSE` (Linux 6.1+) to move what is already there. Where the
kernel or its settings refuse, nothing changes but the speed: `collapse_new_regions` reports what
it managed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

HUGE_PAGE = 2 * 1024 * 1024
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


def collapse_new_regions(before: set[Region]) -> int:
    """Ask for huge pages on every anonymous region of at least `MIN_REGION` bytes that is not
    in `before`; returns the bytes the kernel collapsed (0 where it could not)."""
    if os.name != "posix":
        return 0
    try:
        madvise = _madvise()
    except (OSError, AttributeError):
        return 0
    collapsed = 0
    for start, end in sorted(anonymous_regions() - before):
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the region
        hi = end // HUGE_PAGE * HUGE_PAGE
        if hi - lo < MIN_REGION:
            continue
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            continue  # THP off ("never") or not built into this kernel
        for page in range(lo, hi, HUGE_PAGE):  # page by page: one that cannot be collapsed
            # (never written, say) fails the whole call
            if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
    return collapsed
