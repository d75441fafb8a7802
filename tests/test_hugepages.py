"""Moving a process's fresh anonymous memory to 2 MiB pages: what the llama.cpp backend does
to its weights. The bytes must not change; where the kernel allows it, the pages must."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path

import pytest

from specdecode.backends import hugepages

pytestmark = pytest.mark.skipif(
    not hugepages.available(), reason="no transparent huge pages (Linux 6.1+, THP not 'never')"
)

SIZE = 64 * 1024 * 1024


def huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of the mapping that contains [start, end), from /proc/self/smaps."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= start and end <= hi:
            return int(re.search(r"AnonHugePages:\s+(\d+) kB", block).group(1)) * 1024
    raise AssertionError("mapping not found")


def mapped(libc, size: int) -> int:
    """A private anonymous read-write mapping of `size` bytes, every page written (as loaded
    weights are): a real allocation, which the process's maps then list."""
    address = libc.mmap(None, size, 3, 0x22, -1, 0)  # read-write, private anonymous
    assert address not in (None, ctypes.c_void_p(-1).value)
    pattern = bytes(range(251)) * (size // 251) + bytes(size % 251)
    ctypes.memmove(address, pattern, size)
    return address


def region_of(regions: set[hugepages.Region], start: int, end: int) -> hugepages.Region | None:
    """The region of `regions` holding [start, end), if one does."""
    return next(((lo, hi) for lo, hi in regions if lo <= start and end <= hi), None)


@pytest.fixture
def libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def test_collapse_moves_new_regions_and_keeps_their_bytes(libc):
    before = hugepages.anonymous_regions()
    address = mapped(libc, SIZE)
    try:
        data = (ctypes.c_uint8 * SIZE).from_address(address)
        pattern = bytes(data)
        moved = hugepages.collapse_new_regions(before)
        assert moved >= SIZE - 2 * hugepages.HUGE_PAGE  # all whole huge pages inside it
        assert huge_bytes_in(address, address + SIZE) >= SIZE - 2 * hugepages.HUGE_PAGE
        assert bytes(data) == pattern
    finally:
        libc.munmap(address, SIZE)


def test_a_snapshot_lists_a_new_allocation_and_old_regions_are_left_alone(libc):
    """The snapshot taken before an allocation lacks it and the one after holds it; given the
    later snapshot, a collapse leaves the region as it was, while given the earlier one it
    moves it: what keeps the backend from touching memory it did not just load."""
    before = hugepages.anonymous_regions()
    address = mapped(libc, SIZE)
    try:
        after = hugepages.anonymous_regions()
        region = region_of(after, address, address + SIZE)
        assert region is not None and region not in before  # listed once it exists
        assert region_of(before, address, address + SIZE) is None
        pages = huge_bytes_in(address, address + SIZE)
        assert hugepages.collapse_new_regions(after) == 0
        assert huge_bytes_in(address, address + SIZE) == pages  # left as it was
        assert hugepages.collapse_new_regions(before) >= SIZE - 2 * hugepages.HUGE_PAGE
    finally:
        libc.munmap(address, SIZE)
    assert region_of(hugepages.anonymous_regions(), address, address + SIZE) is None  # unmapped
