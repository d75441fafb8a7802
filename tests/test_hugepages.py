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


def test_collapse_moves_new_regions_and_keeps_their_bytes():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    before = hugepages.anonymous_regions()
    address = libc.mmap(None, SIZE, 3, 0x22, -1, 0)  # read-write, private anonymous
    assert address not in (None, ctypes.c_void_p(-1).value)
    try:
        data = (ctypes.c_uint8 * SIZE).from_address(address)
        pattern = bytes(range(251)) * (SIZE // 251) + bytes(SIZE % 251)
        ctypes.memmove(address, pattern, SIZE)  # every page written, as loaded weights are
        moved = hugepages.collapse_new_regions(before)
        assert moved >= SIZE - 2 * hugepages.HUGE_PAGE  # all whole huge pages inside it
        assert huge_bytes_in(address, address + SIZE) >= SIZE - 2 * hugepages.HUGE_PAGE
        assert bytes(data) == pattern
    finally:
        libc.munmap(address, SIZE)


def test_old_regions_are_left_alone():
    assert hugepages.collapse_new_regions(hugepages.anonymous_regions()) == 0
