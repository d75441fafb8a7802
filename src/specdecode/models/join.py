"""Getting a GGUF out of pinned wheels: free space first, the chunks in order, joined and verified.

The pieces of a fetch that touch no cache bookkeeping, so that each can be tested on its own with
fake distributions: ``store`` calls them under the model's exclusive lock and records the result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from specdecode.models.catalogue import Chunk
from specdecode.models.integrity import ModelIntegrityError
from specdecode.models.packages import (
    PackageFileNotFoundError,
    find_distribution,
    locate_distribution_file,
)

_READ_BLOCK = 8 << 20  # 8 MiB per read when joining


class DiskSpaceError(OSError):
    """Not enough free disk space under the cache for a fetch."""


def check_disk_space(path: Path, need_bytes: int, what: str) -> None:
    """Refuse, with a remedy, when the filesystem holding ``path`` has less than ``need_bytes``."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise DiskSpaceError(
            f"{what} needs about {need_bytes / 1e9:.1f} GB free under {path}, but only "
            f"{free / 1e9:.1f} GB is free there. Remedy: free some disk space, or point the "
            f"cache at a larger disk with the SPECDECODE_CACHE environment variable "
            f"(or cache_dir= / --cache-dir)."
        )


def locate_chunk_files(search_path: Path | Sequence[Path], chunks: Sequence[Chunk]) -> list[Path]:
    """The absolute path of every chunk, in the order of ``chunks`` (never directory order).

    Each chunk is looked up in its own distribution's metadata, found by name and exact version
    in ``search_path`` only; nothing is imported.
    """
    paths = []
    for chunk in chunks:
        dist = find_distribution(search_path, chunk.package.name, chunk.package.version)
        if dist is None:
            raise PackageFileNotFoundError(
                f"{chunk.package.requirement} is not installed in {search_path}"
            )
        paths.append(locate_distribution_file(dist, chunk.file))
    return paths


def join_chunks(
    chunk_paths: Sequence[Path],
    dest: Path,
    expected_bytes: int,
    expected_sha256: str,
    *,
    progress: bool = True,
) -> Path:
    """Concatenate ``chunk_paths`` into ``dest``, hashing as it writes, and verify the result.

    The size is checked before anything is written; the sha256 once all is written. The bytes
    go to ``dest.partial``, renamed to ``dest`` only once verified. On any mismatch or failure
    the partial file is deleted and ``dest`` does not exist afterwards, so an unverified file
    can never be picked up by a later run.
    """
    total = sum(p.stat().st_size for p in chunk_paths)
    if total != expected_bytes:
        raise ModelIntegrityError(
            f"the {len(chunk_paths)} chunks for {dest.name} add up to {total:,} bytes, "
            f"expected {expected_bytes:,}; refusing to join them"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with (
            open(partial, "wb") as out,
            tqdm(
                total=total,
                desc=f"join+sha256 {dest.name}",
                unit="B",
                unit_scale=True,
                disable=not progress,
            ) as bar,
        ):
            for path in chunk_paths:
                with open(path, "rb") as f:
                    while block := f.read(_READ_BLOCK):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise ModelIntegrityError(
                f"sha256 mismatch for {dest.name}: expected {expected_sha256}, got {actual}. "
                f"The joined file was deleted and is not used; the packages may have been "
                f"re-uploaded or corrupted in transit."
            )
        partial.chmod(0o644)
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)
        raise
    return dest
