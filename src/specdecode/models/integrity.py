"""Hashes and their checks: is a file still the one that was hashed?

Every file the cache writes (the joined GGUF, every file of the fp32 conversion and of the GGUF's
tokenizer) is hashed when it lands, and compared with that hash whenever it is used. A damaged
file otherwise loads without a word: flipped bytes in a safetensors file load fine and print
garbage, a truncated one dies in a traceback that names neither the model nor a remedy.

Hashing gigabytes at every load would cost far more than the load itself, so a load compares
each file's size and *stamp* (size, mtime, ctime, inode) with the recorded one: one ``stat``. It
hashes a file in full only when its stamp changed since it was last hashed, then records the new
stamp; ``models verify`` always hashes in full. ctime is in the stamp because a program can set
mtime back (``touch -r``, ``rsync -t``) but not ctime: any write or ``utime`` moves it. What the
stamp cannot see is a change that moves no timestamp at all (bit rot under the filesystem, a raw
write to the block device); ``models verify`` is the check for that.

A stamp is trusted only once it is *settled*: its mtime and ctime at least ``RACY_NS`` older
than the moment the file was hashed. Filesystem timestamps are coarse (a clock tick), so a write
landing in the same tick as the hash would leave the stamp unchanged: the "racy clean" problem
git solves for its index. A file hashed while it was written (the joined GGUF) is therefore
hashed once more at its next check; files written in one go (a conversion) wait out the window
before they are hashed (``hash_settled``), so they are hashed once.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

RACY_NS = 2_000_000_000  # a stamp younger than this at hashing time is hashed again next time
READ_BLOCK = 8 << 20  # bytes per read when hashing or joining
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
        while block := f.read(READ_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def stamp_of(st: os.stat_result) -> list[int]:
    """What must stay equal for a file to count as unchanged since it was hashed."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def record_of(st: os.stat_result, sha256: str, checked_ns: int) -> dict[str, Any]:
    """What the cache records of a file (``st``) hashed at ``checked_ns``."""
    return {"bytes": st.st_size, "sha256": sha256, "stamp": stamp_of(st), "checked_ns": checked_ns}


def _settled(record: dict[str, Any]) -> bool:
    """Whether the recorded stamp is old enough to be trusted without hashing (module doc)."""
    stamp, checked = record.get("stamp"), record.get("checked_ns")
    if not isinstance(stamp, list) or len(stamp) != 4 or not isinstance(checked, int):
        return False
    return max(stamp[1], stamp[2]) + RACY_NS <= checked


def hash_settled(paths: Sequence[Path], *, progress: bool = False) -> list[dict[str, Any]]:
    """The records of files that have just landed, hashed once their stamps have settled.

    Waits until ``RACY_NS`` has passed since the newest of their timestamps (a short wait
    after a conversion that took far longer), so that the next load trusts the stamps without
    hashing the files again.
    """
    newest = max((max(p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in paths), default=0)
    wait_ns = newest + RACY_NS - time.time_ns()
    if wait_ns > 0:
        time.sleep(wait_ns / 1e9)
    found = []
    for path in paths:
        st = path.stat()
        checked_ns = time.time_ns()
        found.append(record_of(st, sha256_file(path, progress=progress), checked_ns))
    return found


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
    """The outcome of checking one file; ``record``: what to record of it, when it was found
    good by a hash whose stamp still holds (None: nothing new to record)."""

    name: str
    problem: FileProblem | None = None
    hashed: bool = False
    record: dict[str, Any] | None = None


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
    current one. A file found good by a hash gets a fresh record, unless it changed while it
    was hashed.
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
    return FileCheck(
        name, hashed=True, record=record_of(after, actual, checked_ns) if same else None
    )
