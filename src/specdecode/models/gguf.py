"""A GGUF file's metadata, read by hand: what a caller must know before the weights load.

Why not the `gguf` package or llama.cpp: the first is no dependency of the llama.cpp backend,
and either would read the whole header (the tokenizer's long arrays included) or the weights,
where a prompt's fit needs one number that comes early in the file.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

# GGUF metadata value types (the GGUF specification): fixed sizes in bytes; 8 is a string,
# 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


class GGUFMetadataError(ValueError):
    """A file is no GGUF of version 2 or later, or its metadata cannot be read."""


def trained_context(path: Path) -> int | None:
    """`{architecture}.context_length` of a GGUF (v2, v3), stopping as soon as it is read (it
    comes before the tokenizer's long arrays in files llama.cpp writes)."""
    try:
        with path.open("rb") as f:
            magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
            if magic != b"GGUF" or version < 2:
                raise GGUFMetadataError(f"{path} is not a GGUF file of version 2 or later")
            _, n_kv = struct.unpack("<QQ", f.read(16))
            values: dict[str, int | str] = {}
            for _ in range(n_kv):
                key = _string(f)
                kind = struct.unpack("<I", f.read(4))[0]
                if kind == 8:
                    values[key] = _string(f)
                elif kind in _INTS:
                    values[key] = struct.unpack(_INTS[kind], f.read(_SIZES[kind]))[0]
                else:
                    _skip(f, kind)
                arch = values.get("general.architecture")
                if isinstance(arch, str) and f"{arch}.context_length" in values:
                    return int(values[f"{arch}.context_length"])
    except (OSError, struct.error, UnicodeDecodeError) as error:
        raise GGUFMetadataError(f"cannot read the metadata of {path}: {error}") from error
    return None


def _string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8")


def _skip(f: BinaryIO, kind: int) -> None:
    if kind in _SIZES:
        f.seek(_SIZES[kind], os.SEEK_CUR)
    elif kind == 8:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, os.SEEK_CUR)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SIZES:
            f.seek(_SIZES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise struct.error(f"unknown GGUF value type {kind}")
