"""What the cache knows about its own files: a sha256 per file, recorded when written, checked
when loaded; and the per-model lock that keeps two processes from writing one model at once.

Why every load is checked: the sha256 of a joined GGUF used to be checked once, when it was
joined. A file damaged later (a flipped block on disk, a copy cut short, a hand edit) was then
loaded without a word: flipped bytes in a safetensors file load fine and print garbage, a
truncated one dies in a safetensors traceback that names neither the model nor a remedy. So
every file the store writes (the joined GGUF, every file of the fp32 conversion: weights,
config, tokenizer files) gets a record in ``specdecode_files.json`` next to it, and every load
compares the file with its record.

What a check costs. sha256 runs at 0.4-0.7 GB/s on the shared 2-core Xeon this was written on
(measured on the real joined target GGUF: 1.12 GB in 2.5 s at a first read, 1.6 s at a
second), so hashing the default pair at every load would add 14-24 s for its fp32 safetensors
(7.1 + 2.5 GB) or 2.3-4 s for its two GGUF files (1.1 + 0.5 GB), to loads that take seconds. A
load therefore checks each file's size and *stamp* (size, mtime, ctime, inode) against the
record: one ``stat``, about 5 us a file, under a millisecond for a whole model. It hashes a file
in full only when its stamp changed since it was last hashed, then records the new stamp. ``models
verify`` always hashes in full. ctime is in the stamp because a program can set mtime back
(``touch -r``, ``rsync -t``) but not ctime: any write or ``utime`` moves it. What the fast path
cannot see is a change that moves no timestamp at all (bit rot under the filesystem, a raw write
to the block device); ``models verify`` is the check for that.

A stamp is trusted only once it is *settled*: its mtime and ctime at least ``RACY_NS`` older
than the moment the file was hashed. Filesystem timestamps are coarse (a clock tick, several
ms), so a write landing in the same tick as the hash would leave the stamp unchanged; the same
"racy clean" problem git solves for its index. A freshly written file is therefore hashed once
more at its next load (the default target's GGUF: about 2 s, once), after which its stamp holds.
A conversion instead waits out the window (at most 2 s, after a minute of converting) before it
hashes its files in place (``record_files``), so the 7 GB fp32 target is not hashed twice.

Concurrency. Each model has a lock file under ``<cache>/locks/``, taken with ``flock``: shared
while a process checks and loads a model, exclusive while one fetches, converts, repairs or
removes it. Every file lands by ``os.replace`` from a temporary name, so even a reader that does
not lock sees a whole old file or a whole new one, never half of one. ``flock`` locks die with
their process, so a fetch killed by SIGTERM or SIGKILL leaves no stale lock; what it leaves on
disk (a ``.partial`` file, half-installed packages) is cleared by the next fetch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

RECORD_FILE = "specdecode_files.json"
RECORD_FORMAT = 1
RACY_NS = 2_000_000_000  # a stamp younger than this at hashing time is hashed again next time
_READ_BLOCK = 8 << 20  # 8 MiB per read when joining and hashing
_PROGRESS_MIN_BYTES = 64 << 20  # smaller files hash without a progress bar


class ModelIntegrityError(ValueError):
    """A model file has the wrong size or sha256; it is not used."""


class DamagedModelError(ModelIntegrityError):
    """A cached file of a model is damaged or partial, and could not be re-created here.

    The message names the model, each file and what is wrong with it, and the command that
    re-creates them. A ``ValueError``, so the command line prints it as one line, exit 2.
    """

    def __init__(self, name: str, problems: Iterable[FileProblem], fix: str, why: str = ""):
        self.name = name
        self.problems = tuple(problems)
        self.fix = fix
        listed = "; ".join(f"{p.path}: {p.detail}" for p in self.problems)
        super().__init__(
            f"model {name!r} is damaged in the cache: {listed}. It was not loaded{why}. "
            f"Fix: `{fix}`, which deletes the cached copy and re-creates it."
        )


class LockBusyError(OSError):
    """A lock asked for without waiting is held by another process."""


# --------------------------------------------------------------------------- hashing


def sha256_file(path: Path, *, progress: bool = True) -> str:
    """Hex sha256 of a file, read in blocks, with a byte progress bar for large files."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size,
            desc=f"sha256 {path.name}",
            unit="B",
            unit_scale=True,
            disable=not progress or size < _PROGRESS_MIN_BYTES,
        ) as bar,
    ):
        while block := f.read(_READ_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def stamp_of(st: os.stat_result) -> list[int]:
    """What must stay equal for a file to count as unchanged since it was hashed."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _settled(record: dict[str, Any]) -> bool:
    """Whether the recorded stamp is old enough to be trusted without hashing (see module doc)."""
    stamp, checked = record.get("stamp"), record.get("checked_ns")
    if not isinstance(stamp, list) or len(stamp) != 4 or not isinstance(checked, int):
        return False
    return max(stamp[1], stamp[2]) + RACY_NS <= checked


# --------------------------------------------------------------------------- records


class FileRecords:
    """``specdecode_files.json`` of one model folder: per file its artefact, size and sha256.

    ``artefact`` groups the files: ``"gguf"`` for the joined GGUF, ``"fp32"`` for the files of
    the safetensors conversion. A missing or unreadable record file reads as no records (so
    every file present is *unrecorded*): the GGUF can still be checked against the catalogue,
    and an unrecorded conversion is re-created from it.
    """

    def __init__(self, directory: Path, files: dict[str, dict[str, Any]], readable: bool = True):
        self.directory = directory
        self.files = files
        self.readable = readable  # False: the record file exists but could not be parsed

    @classmethod
    def load(cls, directory: Path) -> FileRecords:
        path = directory / RECORD_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls(directory, {})
        except (OSError, ValueError) as err:
            logger.warning("ignoring unreadable %s (%s)", path, err)
            return cls(directory, {}, readable=False)
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict) or not all(
            isinstance(r, dict)
            and isinstance(r.get("bytes"), int)
            and isinstance(r.get("sha256"), str)
            for r in files.values()
        ):
            logger.warning("ignoring malformed %s", path)
            return cls(directory, {}, readable=False)
        return cls(directory, files)

    def save(self) -> None:
        """Write the records by rename, so a reader never sees half of them."""
        data = {"format": RECORD_FORMAT, "files": dict(sorted(self.files.items()))}
        write_atomic(self.directory / RECORD_FILE, json.dumps(data, indent=1) + "\n")

    def names(self, artefact: str) -> list[str]:
        return sorted(n for n, r in self.files.items() if r.get("artefact") == artefact)

    def add(
        self,
        name: str,
        artefact: str,
        sha256: str,
        checked_ns: int,
        st: os.stat_result | None = None,
    ) -> None:
        """Record ``name`` (as ``st`` shows it, else as on disk now), hashed at ``checked_ns``."""
        st = st if st is not None else (self.directory / name).stat()
        self.files[name] = {
            "artefact": artefact,
            "bytes": st.st_size,
            "sha256": sha256,
            "stamp": stamp_of(st),
            "checked_ns": checked_ns,
        }

    def restamp(self, checks: Iterable[FileCheck]) -> bool:
        """Take the stamps of files just hashed and found good; True if any changed."""
        changed = False
        for check in checks:
            if check.restamp is None or check.name not in self.files:
                continue
            stamp, checked_ns = check.restamp
            record = self.files[check.name]
            if record.get("stamp") != stamp or record.get("checked_ns") != checked_ns:
                record["stamp"], record["checked_ns"] = stamp, checked_ns
                changed = True
        return changed

    def save_quietly(self) -> None:
        """``save`` where failing only costs a hash next time (a read-only cache, a full disk)."""
        try:
            self.save()
        except OSError as err:
            logger.debug("could not update %s: %s", self.directory / RECORD_FILE, err)


def record_files(
    records: FileRecords, names: Iterable[str], artefact: str, *, progress: bool = False
) -> None:
    """Hash files that have just landed in ``records.directory``, and record them settled.

    It first waits until ``RACY_NS`` has passed since the newest of their timestamps (at most
    2 s, after a conversion that takes a minute or more), so that the stamps it records are
    settled: the next load trusts them without hashing again (for the default target's fp32
    copy that saves a 12 s re-hash at the first load after the conversion).
    """
    names = list(names)
    paths = [records.directory / name for name in names]
    newest = max((max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in paths), default=0)
    wait_ns = newest + RACY_NS - time.time_ns()
    if wait_ns > 0:
        time.sleep(wait_ns / 1e9)
    for name, path in zip(names, paths, strict=True):
        st = path.stat()
        checked_ns = time.time_ns()
        records.add(name, artefact, sha256_file(path, progress=progress), checked_ns, st)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class FileProblem:
    """One file that is not as recorded. ``kind``: missing, size, sha256 or unrecorded."""

    path: Path
    kind: str
    detail: str

    @property
    def damaged(self) -> bool:
        """Present but with other content than recorded (partial files are ``missing``)."""
        return self.kind in ("size", "sha256")


@dataclass(frozen=True)
class FileCheck:
    """The outcome of checking one file; ``restamp`` is (stamp, hashed at) to record if good."""

    name: str
    problem: FileProblem | None = None
    hashed: bool = False
    restamp: tuple[list[int], int] | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_file(
    directory: Path,
    name: str,
    expected_bytes: int,
    expected_sha256: str,
    record: dict[str, Any] | None,
    *,
    full: bool,
    progress: bool = False,
) -> FileCheck:
    """Compare ``directory/name`` with its expected size and sha256.

    The size is always compared (a truncated file fails here without being read). The sha256 is
    computed unless ``full`` is False and ``record`` holds a settled stamp equal to the file's
    current one. A file found good gets its current stamp back for recording, unless it changed
    while it was hashed.
    """
    path = directory / name
    try:
        before = path.stat()
    except FileNotFoundError:
        return FileCheck(name, FileProblem(path, "missing", "missing"))
    if before.st_size != expected_bytes:
        how = "truncated" if before.st_size < expected_bytes else "too long"
        detail = f"{how}: {before.st_size:,} bytes, expected {expected_bytes:,}"
        return FileCheck(name, FileProblem(path, "size", detail))
    unchanged = record is not None and record.get("stamp") == stamp_of(before)
    if not full and unchanged and _settled(record):
        return FileCheck(name)
    checked_ns = time.time_ns()
    actual = sha256_file(path, progress=progress)
    if actual != expected_sha256:
        detail = f"sha256 is {actual[:16]}..., expected {expected_sha256[:16]}..."
        return FileCheck(name, FileProblem(path, "sha256", detail), hashed=True)
    after = path.stat()
    same = stamp_of(after) == stamp_of(before)
    return FileCheck(name, hashed=True, restamp=(stamp_of(after), checked_ns) if same else None)


# --------------------------------------------------------------------------- locking


_held = threading.local()  # lock path -> exclusive?, for this thread


@dataclass
class ModelLock:
    """An ``flock`` on ``path``: shared to check and load a model, exclusive to write it.

    Taking it again in the same thread is a no-op when the held mode covers it (shared inside
    exclusive), and an error when it would need an upgrade: two ``flock`` calls of one process
    on separate descriptors exclude each other, so an upgrade would wait for itself forever.
    """

    path: Path
    what: str  # the model, for messages

    @contextlib.contextmanager
    def shared(self, *, wait: bool = True) -> Iterator[None]:
        with self._hold(exclusive=False, wait=wait):
            yield

    @contextlib.contextmanager
    def exclusive(self, *, wait: bool = True) -> Iterator[None]:
        with self._hold(exclusive=True, wait=wait):
            yield

    @contextlib.contextmanager
    def _hold(self, *, exclusive: bool, wait: bool) -> Iterator[None]:
        held: dict[str, bool] = getattr(_held, "locks", None) or {}
        _held.locks = held
        key = str(self.path.absolute())
        if key in held:
            if exclusive and not held[key]:
                raise RuntimeError(f"{self.what}: exclusive lock asked for inside a shared one")
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            if exclusive:
                raise
            # a read-only cache: nothing can write it either, so reading unlocked is safe
            logger.debug("reading %s without a lock (%s)", self.what, err)
            yield
            return
        try:
            self._acquire(fd, exclusive, wait)
            held[key] = exclusive
            try:
                if exclusive:
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                yield
            finally:
                del held[key]
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _acquire(self, fd: int, exclusive: bool, wait: bool) -> None:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        # a shared request waits only for a writer, whose pid the lock file holds
        holder = "" if exclusive else self.holder()
        if not wait:
            raise LockBusyError(f"{self.what} is being written by another process{holder}")
        doing = "using or writing" if exclusive else "writing"
        logger.warning(
            "waiting for another process %s %s%s (lock %s)", doing, self.what, holder, self.path
        )
        fcntl.flock(fd, mode)

    def holder(self) -> str:
        """`` (pid N)`` of the last process that took the lock exclusively, if recorded."""
        try:
            pid = self.path.read_text().strip()
        except OSError:
            return ""
        return f" (pid {pid})" if pid.isdigit() else ""
