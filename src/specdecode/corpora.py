"""Corpora for drafting auto: which files a corpus setting names, their token ids indexed
(`core.drafting.corpus.CorpusIndex`), and the index kept in the cache.

The shipped corpus is the standard library of the Python that runs this (`stdlib_sources`):
code that every machine with the package already holds, tokenized once per tokenizer and
cached. A cached index that cannot be read is built again, and one that cannot be written is
used from memory (`models.atomic`): the cache saves seconds at a start, and never stops one.
The core only looks an index up; reading files and keeping them is this module's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specdecode.core.drafting.corpus import CorpusIndex
from specdecode.models.atomic import say_unreadable, write_or_keep
from specdecode.models.packages import cache_root

logger = logging.getLogger(__name__)

# what `load_index` raises on a file that is no whole index
LOAD_ERRORS = (zipfile.BadZipFile, ValueError, KeyError, EOFError, OSError)


def save_index(index: CorpusIndex, path: Path) -> bool:
    """Keep the index at `path`, whole or not at all (`models.atomic`), so that a process
    reading it while another writes it, or after a writer was killed, never reads half of
    one. False where it cannot be written (said once): the index in memory serves."""
    arrays = {
        f"{name}{n}": a for n, t in index.tables.items() for name, a in zip("kns", t, strict=True)
    }
    return write_or_keep(path, lambda out: np.savez(out, **arrays), "corpus index", logger, "wb")


def load_index(path: Path) -> CorpusIndex:
    """The index saved at `path`. A file that is no index (cut short, damaged, another
    format) raises `LOAD_ERRORS`, not a half-built index: every array is read (and its
    checksum checked) and the three of each order must agree in length."""
    data = np.load(path, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):  # a single array: no index either
        raise ValueError("not an .npz archive of arrays")
    with data:
        orders = sorted({int(name[1:]) for name in data.files})
        tables = {n: (data[f"k{n}"], data[f"n{n}"], data[f"s{n}"]) for n in orders}
    for n, arrays in tables.items():
        if any(a.ndim != 1 or a.shape != arrays[0].shape for a in arrays):
            raise ValueError(f"the arrays of order {n} differ in shape")
    return CorpusIndex(tables)


STDLIB = "stdlib"  # the corpus of this Python's standard library sources


def stdlib_sources() -> list[Path]:
    """The Python files of this interpreter's standard library, less its tests and tools. The
    walk does not enter the skipped folders: site-packages, under the standard library's root,
    holds far more files than the library itself."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    found = []
    for folder, folders, files in os.walk(root):
        folders[:] = [f for f in folders if f not in skipped]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def corpus_files(spec: str) -> list[Path]:
    """The files a corpus setting names: `STDLIB`, a file, or a folder (its files, hidden ones
    left out). Refused at once where there are none, before any model loads."""
    if spec == STDLIB:
        if sources := stdlib_sources():
            return sources
        raise ValueError(
            "this Python's standard library has no .py sources to index (a zipped or stripped "
            "install): give a corpus file or folder with --corpus PATH"
        )
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if files:
            return files
        raise ValueError(f"the corpus folder {spec} holds no files")
    raise ValueError(
        f"no corpus {spec!r}: give {STDLIB!r} (this Python's standard library), a text file or "
        "a folder of them"
    )


def corpus_index(
    spec: str, encode: Callable[[list[str]], list[list[int]]], tokenizer_id: str, folder: Path
) -> CorpusIndex:
    """The index of the corpus `spec` names (`corpus_files`) as `encode` tokenizes it, built
    once and kept in `folder` under the files' and the tokenizer's identity. Files that are
    not UTF-8 text are left out. A kept index that cannot be read is built again (and said,
    once); one that cannot be kept is used from memory."""
    files = corpus_files(spec)
    stats = [(p, p.stat()) for p in files]
    identity = hashlib.sha256(
        "\n".join(
            [tokenizer_id, *(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats)]
        ).encode()
    ).hexdigest()[:20]
    path = folder / f"corpus-{identity}.npz"
    if path.is_file():
        try:
            return load_index(path)
        except LOAD_ERRORS as error:
            say_unreadable(logger, "corpus index", path, error, "building it again")
    texts = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    index = CorpusIndex.build(encode(texts))
    save_index(index, path)
    return index


def named_index(
    spec: str, tokenizer: Any, cache_dir: str | os.PathLike[str] | None = None
) -> CorpusIndex:
    """The index of a named corpus (`corpus_files`) as the target's `tokenizer` reads it, kept
    under `<cache>/corpora`, keyed by the tokenizer's vocabulary."""
    if tokenizer is None:
        raise ValueError("a named corpus is tokenized with the target's tokenizer: none is loaded")
    vocab = sorted(tokenizer.get_vocab().items())
    tokenizer_id = hashlib.sha256(repr(vocab).encode()).hexdigest()

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return corpus_index(spec, encode, tokenizer_id, cache_root(cache_dir) / "corpora")
