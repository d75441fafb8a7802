"""The cache files a start writes (the corpus index, the prices, the 2 MiB-page verdict, a
model's file records) never stop a start or a round: two processes writing one entry at once
both succeed, what a killed writer leaves is used or rebuilt, a damaged file is rebuilt with
one line said, and a cache that cannot be written leaves the work in memory, said once."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specdecode import pricebook as pricing
from specdecode.backends import hugepages
from specdecode.core.drafting.corpus import CorpusIndex
from specdecode.core.prices import Prices
from specdecode.corpora import LOAD_ERRORS, corpus_index, load_index
from specdecode.models import atomic
from specdecode.models.cache import RECORD_FILE, FileRecords

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
as_root = pytest.mark.skipif(
    IS_ROOT, reason="root writes into a folder of mode 0o555; the refused-rename tests stand in"
)

KEY = {"target": {"backend": "test", "files": []}, "drafter": None, "machine": "m", "plan": {}}
PRICES = Prices((1, 2), ((1.0, 1.4, 1.9), (1.6, 2.2, 3.0)), None, 0.01)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test a process that has said nothing yet (`say_once` speaks once per process)."""
    monkeypatch.setattr(atomic, "_said", set())


def said(caplog) -> list[str]:
    """The warnings the package logged."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("specdecode")
    ]


def scratch_in(folder: Path) -> list[str]:
    """Files of `folder` other than cache entries: what a write left behind."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


class Encoder:
    """Characters as token ids, counting the corpora it tokenizes (one count: one build)."""

    def __init__(self) -> None:
        self.builds = 0

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.builds += 1
        return [[ord(c) for c in t] for t in texts]


@pytest.fixture
def docs(tmp_path) -> str:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("abcab abcab abcab xyz xyz " * 20)
    return str(folder)


def index_file(folder: Path) -> Path:
    (path,) = folder.glob("corpus-*.npz")
    return path


def refuse_renames(monkeypatch) -> None:
    """A cache that cannot be written, where a process may write anywhere (root): the rename
    that would land each file is refused as a read-only folder refuses it."""

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied (read-only cache)", str(dst))

    monkeypatch.setattr(os, "replace", refuse)


@pytest.fixture
def read_only(tmp_path):
    """A cache folder of mode 0o555 (restored for the clean-up)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    yield folder
    folder.chmod(0o755)


# ---------------------------------------------------------------- two writers at once

WRITER = r"""
import os, sys, time
from pathlib import Path

kind, folder, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
if kind == "corpus":
    from specdecode.corpora import corpus_index
else:
    from specdecode.core.prices import Prices
    from specdecode.pricebook import store_prices
real = os.replace

def late(src, dst):  # both writers hold a finished scratch file when the first renames its own
    time.sleep(0.5)
    real(src, dst)

os.replace = late
ready.touch()
while not go.exists():
    time.sleep(0.005)
if kind == "corpus":
    index = corpus_index(sys.argv[5], lambda ts: [[ord(c) for c in t] for t in ts], "c", folder)
    print(index.next_token([ord("a")]))
else:
    key = {"target": {"backend": "test", "files": []}, "drafter": None, "machine": "m",
           "plan": {}}
    step = float(sys.argv[5])
    print(store_prices(key, Prices((1,), ((1.0, 1.5),), None, step), folder, {1: step}))
"""


def run_at_once(tmp_path: Path, kind: str, folder: Path, args: list[str]) -> list[str]:
    """Two processes writing the same entry of `folder` at the same moment; their outputs."""
    go = tmp_path / "go"
    procs, ready = [], []
    for i, arg in enumerate(args):
        ready.append(tmp_path / f"ready{i}")
        command = [sys.executable, "-c", WRITER, kind, str(folder), str(ready[i]), str(go), arg]
        procs.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "the writers did not start"
        time.sleep(0.02)
    go.touch()
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "Traceback" not in err, err
        outputs.append(out.strip())
    return outputs


def test_two_processes_build_one_corpus_index_at_once(tmp_path, docs) -> None:
    folder = tmp_path / "corpora"  # not there yet: both make it
    outputs = run_at_once(tmp_path, "corpus", folder, [docs, docs])
    built = CorpusIndex.build(Encoder()([(Path(docs) / "a.txt").read_text()]))
    assert outputs == [str(built.next_token([ord("a")]))] * 2
    kept = load_index(index_file(folder))  # whole: one writer's or the other's
    assert kept.next_token([ord("a"), ord("b")]) == built.next_token([ord("a"), ord("b")])
    assert scratch_in(folder) == []
    encode = Encoder()
    corpus_index(docs, encode, "c", folder)
    assert encode.builds == 0  # the next start reads it


def test_two_processes_store_prices_at_once(tmp_path, caplog) -> None:
    folder = tmp_path / "prices"
    outputs = run_at_once(tmp_path, "prices", folder, ["0.01", "0.02"])
    assert outputs == [str(pricing.cache_file(KEY, folder))] * 2
    kept = pricing.load_prices(KEY, folder)
    assert kept is not None and kept.step_seconds in (0.01, 0.02)
    assert pricing.load_worth(KEY, folder) == {1: kept.step_seconds}  # one writer's entry
    assert scratch_in(folder) == [] and said(caplog) == []


# ---------------------------------------------------------------- a writer killed


def test_a_killed_index_write_leaves_a_cache_the_next_start_uses(tmp_path, docs, caplog) -> None:
    """Killed before its rename: the scratch file is left, the index is not touched."""
    folder = tmp_path / "corpora"
    first = corpus_index(docs, Encoder(), "c", folder)
    path = index_file(folder)
    (folder / f".{path.name}.k1ll3d.tmp").write_bytes(path.read_bytes()[:700])
    encode = Encoder()
    again = corpus_index(docs, encode, "c", folder)
    assert encode.builds == 0 and said(caplog) == []
    assert again.next_token([ord("x")]) == first.next_token([ord("x")])


def test_a_killed_index_write_with_a_cut_target_is_rebuilt(tmp_path, docs, caplog) -> None:
    """A write that reached the disk only in part (a kill, a crash before the data was
    flushed): the cut index is rebuilt and said in one line; the next start reads it."""
    folder = tmp_path / "corpora"
    first = corpus_index(docs, Encoder(), "c", folder)
    path = index_file(folder)
    whole = path.read_bytes()
    path.write_bytes(whole[: min(1000, len(whole) // 2)])
    leftover = folder / f".{path.name}.k1ll3d.tmp"
    leftover.write_bytes(whole[:300])
    encode = Encoder()
    again = corpus_index(docs, encode, "c", folder)
    assert encode.builds == 1
    assert again.next_token([ord("a")]) == first.next_token([ord("a")])
    (line,) = said(caplog)
    assert "corpus index" in line and "BadZipFile" in line and "\n" not in line
    assert load_index(path).next_token([ord("a")]) == first.next_token([ord("a")])
    encode = Encoder()
    corpus_index(docs, encode, "c", folder)
    assert encode.builds == 0  # rewritten whole
    assert leftover.exists()  # young: it could be a live writer's, so it is left alone


def test_what_a_writer_killed_long_ago_left_is_cleared(tmp_path) -> None:
    target = tmp_path / "entry.json"
    old, young = tmp_path / ".entry.json.0ld.tmp", tmp_path / ".entry.json.y0ung.tmp"
    other = tmp_path / ".other.json.0ld.tmp"  # another file's: not this write's to judge
    for leftover in (old, young, other):
        leftover.write_text("{")
    hours_ago = time.time() - 2 * atomic.STALE_SECONDS
    os.utime(old, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    atomic.atomic_write_text(target, "{}\n")
    assert target.read_text() == "{}\n" and (target.stat().st_mode & 0o777) == atomic.FILE_MODE
    assert not old.exists() and young.exists() and other.exists()


def test_a_failed_write_leaves_the_file_as_it_was_and_no_scratch(tmp_path) -> None:
    target = tmp_path / "entry.json"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic.atomic_writer(target) as out:
        out.write("half a ne")
        raise RuntimeError("killed")
    assert target.read_text() == "old\n" and scratch_in(tmp_path) == []


def test_a_killed_prices_write_leaves_a_cache_the_next_start_rebuilds(tmp_path, caplog) -> None:
    folder = tmp_path / "prices"
    path = pricing.store_prices(KEY, PRICES, folder, {1: 0.8})
    assert path is not None and pricing.load_prices(KEY, folder) == PRICES
    (folder / f".{path.name}.k1ll3d.tmp").write_text(path.read_text()[:40])
    assert pricing.load_prices(KEY, folder) == PRICES and said(caplog) == []  # used
    path.write_text(path.read_text()[:40])  # and now the entry itself cut short
    assert pricing.load_prices(KEY, folder) is None
    assert pricing.load_worth(KEY, folder) == {}
    (line,) = said(caplog)  # one line for the file, though both readings failed
    assert "prices entry" in line and "JSONDecodeError" in line and "\n" not in line
    assert pricing.store_prices(KEY, PRICES, folder, {1: 0.8}) == path
    assert pricing.load_prices(KEY, folder) == PRICES and pricing.load_worth(KEY, folder)


@pytest.fixture
def weights(tmp_path, monkeypatch) -> Path:
    """A model file and an empty cache root, on a kernel that can move pages."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hugepages, "available", lambda: True)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


class Timer:
    """Step times of a model with and without 2 MiB pages, counting its measurements."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> tuple[float, float]:
        self.calls += 1
        return 1.5, 1.0


def test_a_killed_verdict_write_leaves_a_cache_the_next_start_rebuilds(weights, caplog) -> None:
    timer = Timer()
    assert hugepages.decide(weights, timer) and timer.calls == 1
    file = weights.parent / "cache" / hugepages.DECISIONS_FILE
    (file.parent / f".{file.name}.k1ll3d.tmp").write_text(file.read_text()[:20])
    assert hugepages.decide(weights, timer) and timer.calls == 1  # the leftover is no matter
    file.write_text(file.read_text()[:20])
    assert hugepages.decide(weights, timer) and timer.calls == 2
    (line,) = said(caplog)
    assert "verdict" in line and "measuring again" in line and "\n" not in line
    assert hugepages.recorded(weights)["huge_pages"] is True  # rewritten whole


# ---------------------------------------------------------------- damaged files


def zip_of(arrays: dict[str, np.ndarray]) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def npy_of(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


INDEX_DAMAGE = {
    "garbage": lambda whole: b"\x00garbage, no archive" * 10,
    "empty": lambda whole: b"",
    "one byte flipped": lambda whole: whole[:200] + bytes([whole[200] ^ 0xFF]) + whole[201:],
    "an array missing": lambda whole: zip_of({"k1": np.zeros(2, np.uint64)}),
    "arrays of two lengths": lambda whole: zip_of(
        {"k1": np.zeros(2, np.uint64), "n1": np.zeros(3, np.int32), "s1": np.ones(2, np.float32)}
    ),
    "a single array": lambda whole: npy_of(np.arange(5)),
    "an array header cut": lambda whole: npy_of(np.arange(5))[:30],
}


@pytest.mark.parametrize("damage", sorted(INDEX_DAMAGE))
def test_a_damaged_corpus_index_is_rebuilt_with_one_line(tmp_path, docs, caplog, damage) -> None:
    folder = tmp_path / "corpora"
    first = corpus_index(docs, Encoder(), "c", folder)
    path = index_file(folder)
    path.write_bytes(INDEX_DAMAGE[damage](path.read_bytes()))
    with pytest.raises(LOAD_ERRORS):  # the damage is real
        load_index(path)
    encode = Encoder()
    again = corpus_index(docs, encode, "c", folder)
    assert encode.builds == 1
    assert again.next_token([ord("b"), ord("c")]) == first.next_token([ord("b"), ord("c")])
    (line,) = said(caplog)
    assert str(path) in line and "building it again" in line and "\n" not in line
    assert load_index(path).next_token([ord("a")]) == first.next_token([ord("a")])
    assert scratch_in(folder) == []


PRICES_DAMAGE = {
    "not JSON": "{'key': nothing",
    "cut short": None,  # the entry's first half
    "a list": "[1, 2, 3]",
    "no key": '{"prices": {}}',
    "prices of no shape": "KEYED",
}


@pytest.mark.parametrize("damage", sorted(PRICES_DAMAGE))
def test_a_damaged_prices_entry_is_timed_afresh_with_one_line(tmp_path, caplog, damage) -> None:
    folder = tmp_path / "prices"
    path = pricing.store_prices(KEY, PRICES, folder, {1: 0.8})
    text = PRICES_DAMAGE[damage]
    if text is None:
        text = path.read_text()[: len(path.read_text()) // 2]
    elif text == "KEYED":
        text = json.dumps({"key": KEY, "prices": {"rows": [1], "passes": "x"}, "worth": [1]})
    path.write_text(text)
    assert pricing.load_prices(KEY, folder) is None
    assert pricing.load_worth(KEY, folder) == {}
    (line,) = said(caplog)
    assert str(path) in line and "afresh" in line and "\n" not in line
    pricing.store_prices(KEY, PRICES, folder)  # what a start does next: time, store
    assert pricing.load_prices(KEY, folder) == PRICES


@pytest.mark.parametrize(
    "damage", ["\x00\x01 no JSON", '{"cut": ', "[1, 2]", '{"KEY": {"huge_pages": "yes"}}']
)
def test_a_damaged_verdict_is_measured_again_with_one_line(weights, caplog, damage) -> None:
    file = weights.parent / "cache" / hugepages.DECISIONS_FILE
    file.parent.mkdir(parents=True)
    file.write_text(damage.replace("KEY", hugepages.decision_key(weights)))
    timer = Timer()
    assert hugepages.decide(weights, timer) is True and timer.calls == 1
    hugepages.record_move(weights, 40.0)  # reads the file again: nothing more to say
    (line,) = said(caplog)
    assert str(file) in line and "measuring again" in line and "\n" not in line
    entry = hugepages.recorded(weights)
    assert entry["huge_pages"] is True and entry["move_steps"] == 40.0  # rewritten whole


def test_damaged_model_records_read_as_none_and_are_rewritten_whole(tmp_path, caplog) -> None:
    (tmp_path / RECORD_FILE).write_text('{"format": 1, "files": {"a": ')
    records = FileRecords.load(tmp_path)
    assert records.files == {} and not records.readable
    (line,) = said(caplog)
    assert RECORD_FILE in line and "\n" not in line
    records.files["a"] = {"artefact": "fp32", "bytes": 1, "sha256": "0" * 64}
    records.save()
    assert FileRecords.load(tmp_path).files == records.files and scratch_in(tmp_path) == []


def test_model_records_that_cannot_be_renamed_leave_the_old_file(tmp_path, monkeypatch) -> None:
    records = FileRecords(tmp_path, {"a": {"artefact": "fp32", "bytes": 1, "sha256": "0" * 64}})
    records.save()
    before = (tmp_path / RECORD_FILE).read_text()
    refuse_renames(monkeypatch)
    records.files["b"] = dict(records.files["a"])
    with pytest.raises(PermissionError):
        records.save()  # a writer under the model's lock is told
    records.save_quietly()  # a reader's bookkeeping is not
    assert (tmp_path / RECORD_FILE).read_text() == before and scratch_in(tmp_path) == []


# ---------------------------------------------------------------- caches that cannot be written


@pytest.mark.parametrize("filled", [True, False], ids=["filled", "empty"])
def test_an_unwritable_corpus_cache_works_from_memory(
    tmp_path, docs, caplog, monkeypatch, filled
) -> None:
    folder = tmp_path / "corpora"
    first = corpus_index(docs, Encoder(), "c", folder) if filled else None
    refuse_renames(monkeypatch)
    encode = Encoder()
    for _ in range(2):  # two starts of one process (a server's corpus, read again)
        index = corpus_index(docs, encode, "c", folder)
        assert index.next_token([ord("x"), ord("y")]) == (ord("z"), 1.0)
    assert scratch_in(folder) == []
    if filled:
        assert encode.builds == 0 and said(caplog) == []  # read, not written
        assert index.next_token([ord("a")]) == first.next_token([ord("a")])
    else:
        assert encode.builds == 2 and not list(folder.glob("*.npz"))
        (line,) = said(caplog)  # once per process, not per start
        assert "corpus index cannot be written" in line and "read-only" in line


@as_root
@pytest.mark.parametrize("filled", [True, False], ids=["filled", "empty"])
def test_a_read_only_corpus_folder_works_from_memory(docs, caplog, read_only, filled) -> None:
    if filled:
        corpus_index(docs, Encoder(), "c", read_only)
    read_only.chmod(0o555)
    encode = Encoder()
    index = corpus_index(docs, encode, "c", read_only)
    assert index.next_token([ord("x"), ord("y")]) == (ord("z"), 1.0)
    assert encode.builds == (0 if filled else 1)
    assert len(said(caplog)) == (0 if filled else 1)


def test_a_cache_folder_that_cannot_be_made_works_from_memory(tmp_path, docs, caplog) -> None:
    """A file where the cache's folder should be: `mkdir` fails even for root."""
    (tmp_path / "cache").write_text("not a folder")
    encode = Encoder()
    index = corpus_index(docs, encode, "c", tmp_path / "cache" / "corpora")
    assert index.next_token([ord("x"), ord("y")]) == (ord("z"), 1.0)
    assert pricing.store_prices(KEY, PRICES, tmp_path / "cache" / "prices") is None
    lines = said(caplog)
    assert len(lines) == 2 and all("cannot be written" in line for line in lines)
    assert "corpus index" in lines[0] and "prices" in lines[1]  # each kind said once


@pytest.mark.parametrize("filled", [True, False], ids=["filled", "empty"])
def test_an_unwritable_prices_cache_keeps_them_in_memory(
    tmp_path, caplog, monkeypatch, filled
) -> None:
    folder = tmp_path / "prices"
    if filled:
        pricing.store_prices(KEY, PRICES, folder)
    refuse_renames(monkeypatch)
    assert pricing.store_prices(KEY, PRICES, folder, {1: 0.9}) is None  # no error
    assert pricing.store_prices(KEY, PRICES, folder, {1: 0.7}) is None
    (line,) = said(caplog)
    assert "prices cannot be written" in line and "kept in memory" in line
    assert pricing.load_prices(KEY, folder) == (PRICES if filled else None)
    assert pricing.load_worth(KEY, folder) == {}  # the old entry stands whole
    assert scratch_in(folder) == []


@as_root
def test_a_read_only_prices_folder_keeps_them_in_memory(caplog, read_only) -> None:
    pricing.store_prices(KEY, PRICES, read_only)
    read_only.chmod(0o555)
    assert pricing.store_prices(KEY, PRICES, read_only, {1: 0.9}) is None
    assert pricing.load_prices(KEY, read_only) == PRICES and len(said(caplog)) == 1


@pytest.mark.parametrize("filled", [True, False], ids=["filled", "empty"])
def test_an_unwritable_verdict_cache_decides_from_memory(
    weights, caplog, monkeypatch, filled
) -> None:
    timer = Timer()
    if filled:
        hugepages.decide(weights, timer)
    refuse_renames(monkeypatch)
    assert hugepages.decide(weights, timer) is True  # measured (empty) or read (filled)
    hugepages.record_move(weights, 12.0)  # a move's cost, not kept: no error either
    assert timer.calls == 1
    (line,) = said(caplog)  # the verdict's write (empty) or the move's (filled), said once
    assert "verdict cannot be written" in line and "\n" not in line
    if filled:
        assert hugepages.recorded(weights).get("move_steps") is None  # the old file stands
    else:
        assert hugepages.recorded(weights) is None
        hugepages.decide(weights, timer)  # the next load measures again, and says nothing
        assert timer.calls == 2 and len(said(caplog)) == 1


@as_root
def test_a_read_only_verdict_folder_decides_from_memory(weights, caplog) -> None:
    root = weights.parent / "cache"
    root.mkdir()
    root.chmod(0o555)
    try:
        assert hugepages.decide(weights, Timer()) is True
    finally:
        root.chmod(0o755)
    (line,) = said(caplog)
    assert "verdict cannot be written" in line


@pytest.fixture
def smol_gguf():
    pytest.importorskip("transformers")
    from specdecode.models.store import gguf_file

    return gguf_file("smollm2-135m", progress=False)


def test_a_gguf_in_a_read_only_folder_gives_its_tokenizer_from_memory(
    smol_gguf, tmp_path, monkeypatch, caplog
):
    """A GGUF outside the model cache has its tokenizer saved beside it; where its folder
    refuses the scratch folder (read-only), the tokenizer still serves, said once."""
    from specdecode.models import tokenizer as tokenizers

    local = tmp_path / "mine.gguf"
    local.write_bytes(Path(smol_gguf).read_bytes())

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied (read-only folder)", str(tmp_path))

    monkeypatch.setattr(tokenizers.tempfile, "mkdtemp", refuse)
    with caplog.at_level(logging.WARNING):
        first = tokenizers.gguf_tokenizer(local)
        second = tokenizers.gguf_tokenizer(local)
    assert first.encode("def f(x):") == second.encode("def f(x):") != []
    lines = [r.getMessage() for r in caplog.records if "cannot be saved" in r.getMessage()]
    assert len(lines) == 1 and "read-only" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.gguf"]
