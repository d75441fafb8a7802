"""Moving a process's fresh anonymous memory to 2 MiB pages: what the llama.cpp backend does
to its weights. The bytes must not change; where the kernel allows it, the pages must. Whether
to move them is measured once per machine and model file and remembered."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import re
from pathlib import Path

import pytest

from specdecode.backends import hugepages

needs_thp = pytest.mark.skipif(
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


@needs_thp
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


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux only")
def test_released_file_pages_leave_resident_memory_and_read_back_the_same(tmp_path):
    """What llama.cpp copied out of a GGUF's mapping stops counting twice, and what is still
    read from the mapping reads the same bytes (faulted back from the page cache)."""
    import mmap

    path = tmp_path / "weights.bin"
    pattern = bytes(range(251)) * (SIZE // 251)
    path.write_bytes(pattern)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert view[:] == pattern  # every page faulted in
        assert hugepages.resident_bytes(path) >= len(pattern) - 4096
        assert hugepages.release_file_pages(path) >= len(pattern) - 4096
        assert hugepages.resident_bytes(path) < len(pattern) // 8
        assert view[:] == pattern
    assert hugepages.release_file_pages(path) == 0  # no mapping left


@needs_thp
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


@needs_thp
def test_regions_named_at_load_are_moved_and_later_ones_left_alone(libc):
    """A move that starts after other memory was mapped (a cache, an index) moves the regions
    named when the weights loaded, and nothing mapped since: that memory was never timed, and
    moving it beside the passes would slow them the longer."""
    before = hugepages.anonymous_regions()
    weights = mapped(libc, SIZE)
    named = hugepages.anonymous_regions() - before
    later = mapped(libc, SIZE)
    try:
        pages = huge_bytes_in(later, later + SIZE)
        assert hugepages.collapse(named) >= SIZE - 2 * hugepages.HUGE_PAGE
        assert huge_bytes_in(weights, weights + SIZE) >= SIZE - 2 * hugepages.HUGE_PAGE
        assert huge_bytes_in(later, later + SIZE) == pages  # left as it was
    finally:
        libc.munmap(weights, SIZE)
        libc.munmap(later, SIZE)


# ------------------------------------------------------------------ the verdict, kept


class Timer:
    """A stand-in for timing a model's steps: returns the given (4 KiB, 2 MiB) step seconds
    and counts its calls."""

    def __init__(self, step_4k: float, step_2m: float) -> None:
        self.times = (step_4k, step_2m)
        self.calls = 0

    def __call__(self) -> tuple[float, float]:
        self.calls += 1
        return self.times


@pytest.fixture
def weights(tmp_path, monkeypatch):
    """A model file and an empty cache root, on a kernel that can move pages."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hugepages, "available", lambda: True)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


@pytest.mark.parametrize("times,huge", [((1.2, 1.0), True), ((1.0, 1.0), False)])
def test_decided_once_and_reused(weights, times, huge):
    timer = Timer(*times)
    assert hugepages.decide(weights, timer) is huge
    assert hugepages.decide(weights, timer) is huge
    assert timer.calls == 1  # the second call read the record
    record = json.loads((weights.parent / "cache" / hugepages.DECISIONS_FILE).read_text())
    (entry,) = record.values()
    assert entry["huge_pages"] is huge and (entry["step_s_4k"], entry["step_s_2m"]) == times


def test_each_model_file_measured_apart(weights):
    other = weights.with_name("drafter.gguf")
    other.write_bytes(b"GGUF" + bytes(30))
    gains, flat = Timer(1.3, 1.0), Timer(1.0, 1.0)
    assert hugepages.decide(weights, gains) and not hugepages.decide(other, flat)
    assert hugepages.decide(weights, flat) and not hugepages.decide(other, gains)
    assert (gains.calls, flat.calls) == (1, 1)


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"KEY": {"huge_pages": "yes"}}'])
def test_damaged_record_measured_again(weights, damage):
    key = hugepages.decision_key(weights)
    file = weights.parent / "cache" / hugepages.DECISIONS_FILE
    file.parent.mkdir(parents=True)
    file.write_text(damage.replace("KEY", key))
    timer = Timer(1.5, 1.0)
    assert hugepages.decide(weights, timer) is True and timer.calls == 1
    assert json.loads(file.read_text())[key]["huge_pages"] is True  # rewritten whole


def test_no_measurement_where_pages_cannot_move(weights, monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    timer = Timer(2.0, 1.0)
    assert hugepages.decide(weights, timer) is False and timer.calls == 0


def test_explicit_setting_wins_over_the_verdict(weights, monkeypatch):
    """huge_pages=True/False loads as told without consulting the verdict; None consults it
    (llama.cpp then fails on this file that is no model, after the decision)."""
    llamacpp = pytest.importorskip("specdecode.backends.llamacpp")
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp_lib import LlamaCppLoadError

    asked = []

    def decide(path, measure):
        asked.append(path)
        return False

    monkeypatch.setattr(hugepages, "decide", decide)
    for setting in (True, False):
        with pytest.raises(LlamaCppLoadError, match="cannot load"):
            llamacpp.LlamaCppModel(weights, huge_pages=setting)
    assert asked == []
    with pytest.raises(LlamaCppLoadError, match="cannot load"):
        llamacpp.LlamaCppModel(weights)
    assert asked == [weights]


def test_a_move_cost_is_kept_beside_its_verdict(weights):
    """What a move costs is kept in one-token steps next to the verdict; the work it needs to
    pay back is that cost over the verdict's gain (here half a step per pass)."""
    assert hugepages.decide(weights, Timer(2.0, 1.0))
    entry = hugepages.recorded(weights)
    assert hugepages.move_steps(entry) is None and hugepages.pays_within(entry, 1)
    hugepages.record_move(weights, 40.0)
    entry = hugepages.recorded(weights)
    assert entry["huge_pages"] is True and hugepages.move_steps(entry) == 40.0
    assert not hugepages.pays_within(entry, 79) and hugepages.pays_within(entry, 80)
    assert hugepages.pays_within(None, 1)  # no verdict: nothing says it cannot pay
    hugepages.record_move(weights, 5.0)  # timed cheaper, on a busy machine: the most is kept
    assert hugepages.move_steps(hugepages.recorded(weights)) == 40.0
    hugepages.record_move(weights, 50.0)
    assert hugepages.move_steps(hugepages.recorded(weights)) == 50.0


def test_a_move_cost_needs_a_verdict(weights):
    hugepages.record_move(weights, 40.0)
    assert hugepages.recorded(weights) is None
    assert not (weights.parent / "cache" / hugepages.DECISIONS_FILE).exists()


def test_a_waiting_move_starts_once_the_passes_would_have_paid(weights):
    assert hugepages.decide(weights, Timer(4.0, 3.0))  # a quarter of a step saved per pass
    assert hugepages.Mover(hugepages.recorded(weights)).due(0)  # no cost known: move to time it
    hugepages.record_move(weights, 10.0)
    mover = hugepages.Mover(hugepages.recorded(weights))
    assert not mover.due(39) and mover.due(40)
    assert hugepages.Mover(None).due(0)
