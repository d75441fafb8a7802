"""Cache files written whole or not at all, and caches that cannot be written.

Every file the package keeps in its cache (a corpus index, measured prices, a page verdict, a
model's file records) may be read by a process that starts while another writes it, and a
write may be cut short: the process killed, the disk full. A file written to a scratch name of
its own beside the target and renamed over it (`os.replace`, atomic within one folder) is seen
whole or not at all, and two processes writing the same entry at once never write into one
scratch file: the last rename wins, and either result is whole.

A cache is a shortcut, never a condition to start: one that cannot be written (a read-only or
full disk, a folder that cannot be made) leaves what was built in memory (`write_or_keep`), and
a file that cannot be read is rebuilt. Either is said once per process (`say_once`), in one
line, not at every start of a round.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import IO, Any

# a scratch file untouched this long was left by a process killed while writing: a write
# lasts seconds at most, so one this old is no other process's work in progress
STALE_SECONDS = 3600.0
FILE_MODE = 0o644  # mkstemp makes its file private; a cache is an ordinary readable folder

_said: set[Hashable] = set()  # the topics `say_once` has spoken of in this process


@contextlib.contextmanager
def atomic_writer(path: Path, mode: str = "w", *, suffix: str = ".tmp") -> Iterator[IO[Any]]:
    """A file (text, UTF-8, or binary for a mode with "b") whose content replaces `path` when
    the block ends without an error. It is written as `.<name>.<random><suffix>` in `path`'s
    folder and removed where the block or the rename fails, so a failed write leaves `path` as
    it was. What a killed writer left of `path` long ago is removed first (`STALE_SECONDS`):
    unique names do not overwrite each other's leftovers as a fixed one did."""
    _clear_stale(path, suffix)
    handle, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(handle, mode, encoding=None if "b" in mode else "utf-8") as out:
            yield out
        os.chmod(scratch, FILE_MODE)
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """`text` as the whole of `path` (`atomic_writer`); an error leaves `path` as it was."""
    with atomic_writer(path) as out:
        out.write(text)


def _clear_stale(path: Path, suffix: str) -> None:
    """Remove scratch files of `path` that no live write can still own."""
    now = time.time()
    with contextlib.suppress(OSError):
        for old in path.parent.glob(f"{glob.escape(f'.{path.name}.')}*{glob.escape(suffix)}"):
            with contextlib.suppress(OSError):
                if now - old.stat().st_mtime > STALE_SECONDS:
                    old.unlink()


def write_or_keep(
    path: Path,
    write: Callable[[IO[Any]], object],
    what: str,
    log: logging.Logger,
    mode: str = "w",
) -> bool:
    """Write `path` through `atomic_writer`, its folder made first; True where it was written.
    Where the cache cannot be written (read-only, full, its folder not to be made) the caller
    goes on with what it built in memory: False, and `what` (the kind of file) said once per
    process, so a server that cannot keep its cache does not say so at every request."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_writer(path, mode) as out:
            write(out)
    except OSError as error:
        say_once(
            log,
            ("unwritable", what),
            "the %s cannot be written to the cache (%s): kept in memory",
            what,
            error,
        )
        return False
    return True


def say_unreadable(
    log: logging.Logger, what: str, path: Path, error: BaseException, instead: str
) -> None:
    """Say, once per process and file, that the cache file `path` could not be read and what
    is done `instead` (built, timed or measured again): the reason in the same line, never a
    traceback, as the start goes on."""
    reason = f"{type(error).__name__}: {error}"
    message = "the %s %s cannot be read (%s): %s"
    say_once(log, ("unreadable", str(path)), message, what, path, reason, instead)


def say_once(log: logging.Logger, topic: Hashable, message: str, *args: object) -> None:
    """`log.warning(message, *args)` the first time this process speaks of `topic`: a fault of
    the cache is the same fault at its next reading, and one line says it."""
    if topic not in _said:
        _said.add(topic)
        log.warning(message, *args)
