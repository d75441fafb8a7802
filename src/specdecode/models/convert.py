"""GGUF to fp32 safetensors: what the torch backend loads, made once from the verified GGUF.

transformers can read a GGUF directly, but it dequantizes every weight on each load (50-140 s for
the default pair), so the store converts once and keeps the result as plain fp32 safetensors
(seconds to load). Converting is separate from fetching: the GGUF is the primary cached file
(llama.cpp runs it as is) and the conversion is made only when the torch backend first asks.

``convert_gguf`` writes into a fresh folder and renames it into place; the store then moves the
files into the model's cache folder and records their hashes (``integrity``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

MARKER_FILE = "specdecode_model.json"


class ConversionError(RuntimeError):
    """The GGUF loaded, but the converted model would not match it."""


def is_converted(path: Path) -> bool:
    """Whether ``path`` holds a finished conversion (the marker is written last).

    Says nothing about whether the files are intact: the store checks them against their
    records (``store.fetch_model``, ``models verify``).
    """
    return (path / MARKER_FILE).is_file() and (path / "config.json").is_file()


def strip_quantization_marker(model: torch.nn.Module) -> torch.nn.Module:
    """Make a model loaded from GGUF saveable as a plain fp32 checkpoint, in place.

    transformers loads a GGUF file through its ``GgufHfQuantizer`` and, even after dequantizing
    every weight, leaves ``model.hf_quantizer`` set (whose ``is_serializable()`` is always
    False, so ``save_pretrained`` raises "The model is quantized with gguf and is not
    serializable"), ``model.is_quantized``/``quantization_method``, and
    ``config.quantization_config`` (which, if saved into ``config.json``, would make the next
    ``from_pretrained`` look for a GGUF file again). All of them are cleared here, after
    checking that the weights really are dense floating-point tensors.
    """
    packed = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise ConversionError(
            f"the model still holds packed (non-float) weights, e.g. {packed[:3]}; load the GGUF "
            f"dequantized (GgufConfig(dequantize=True)) before converting"
        )
    for module in (m for m in model.modules() if hasattr(m, "config")):
        if getattr(module, "hf_quantizer", None) is not None:
            module.hf_quantizer = None
        if getattr(module, "is_quantized", False):
            module.is_quantized = False
        if "quantization_method" in vars(module):
            del module.quantization_method
        config = getattr(module, "config", None)
        if config is None:
            continue
        for cfg in (config, *(getattr(config, k) for k in ("text_config",) if hasattr(config, k))):
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            if getattr(cfg, "_is_quantized", False):
                cfg._is_quantized = False
    return model


def _gguf_has_output_head(gguf_path: Path) -> bool:
    """Whether the GGUF stores a separate ``output.weight`` (an untied LM head)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    return any(t.name == "output.weight" for t in reader.tensors)


def gguf_identity_parts(
    gguf_path: Path, rows: int
) -> tuple[tuple[str, int, int, int], torch.Tensor]:
    """What the fingerprint of ``gguf_path``'s conversion reads, with no conversion: (model type,
    vocabulary, hidden size, layers) and the token embedding's first ``rows`` rows [rows, hidden],
    dequantized by the ``gguf`` function transformers' loader uses, so to the same fp32 values.

    A quantized row is a run of whole blocks, so the first rows dequantize on their own (a
    memory map: milliseconds). The model type is the GGUF's architecture, which is transformers'
    ``model_type`` for the catalogue's families (llama, qwen2); a family that names them apart
    gets another fingerprint, so a head is refused there, never admitted wrongly.
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ConversionError(f"{gguf_path} has no token_embd.weight")
    hidden, vocab = (int(n) for n in embedding.shape)  # GGUF lists the fastest dimension first
    values = dequantize(embedding.data[:rows], embedding.tensor_type)  # [rows, hidden]
    first = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(rows, hidden)
    return (arch, vocab, hidden, layers), first


def _check_head_tying(model: torch.nn.Module, untied_in_file: bool) -> None:
    """The converted head must be tied exactly when the file has no head of its own."""
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is None:
        return
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    if untied_in_file and tied:
        raise ConversionError(
            "the GGUF has its own output.weight but the loaded model ties the head to the "
            "embeddings; saving it would lose the head"
        )
    if not untied_in_file and not tied:
        raise ConversionError(
            "the GGUF has no output.weight but the loaded model's head is not tied to the "
            "embeddings, so the head would be left uninitialised"
        )


def _load_gguf(directory: Path, filename: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5 may keep GGUF weights packed; ask for plain dense fp32 weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=filename, dtype=torch.float32, local_files_only=True, **kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(
        str(directory), gguf_file=filename, local_files_only=True
    )
    return model.eval(), tokenizer


def _load_gguf_alone(gguf_path: Path, scratch: Path) -> tuple[Any, Any]:
    """``_load_gguf`` on ``gguf_path`` seen through a folder that holds nothing else.

    transformers resolves a GGUF inside a model folder, and the store's model folder also holds
    the previous conversion (config.json, tokenizer files: possibly the damaged ones being
    replaced). A symlink in an empty scratch folder keeps those out of the load. A symlink, not
    a hard link: linking would change the GGUF's ctime and so cost a re-hash at its next check.
    """
    scratch.mkdir(parents=True, exist_ok=True)
    alone = Path(tempfile.mkdtemp(prefix=".gguf-", dir=scratch))
    try:
        (alone / gguf_path.name).symlink_to(gguf_path.absolute())
        return _load_gguf(alone, gguf_path.name)
    finally:
        shutil.rmtree(alone, ignore_errors=True)


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    record: dict[str, Any] | None = None,
    progress: bool = True,
) -> Path:
    """Load ``gguf_path`` with transformers (dequantized, fp32) and save it under ``out_dir``.

    The model (safetensors), its generation config and the tokenizer are written into a
    temporary sibling folder together with ``specdecode_model.json`` (``record`` plus timings),
    which is then renamed to ``out_dir`` in one step. If ``out_dir`` appears meanwhile (another
    process finished first) that copy is kept and ours discarded. The store converts into a
    fresh folder under its exclusive lock and records the files' hashes afterwards.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    steps = ["load GGUF (dequantize to fp32)", "save safetensors", "save tokenizer"]
    with tqdm(
        total=len(steps), desc=f"convert {gguf_path.name}", unit="step", disable=not progress
    ) as bar:
        bar.set_postfix_str(steps[0], refresh=True)
        untied_in_file = _gguf_has_output_head(gguf_path)
        model, tokenizer = _load_gguf_alone(gguf_path, out_dir.parent)
        load_seconds = time.perf_counter() - start
        _check_head_tying(model, untied_in_file)
        strip_quantization_marker(model)
        bar.update(1)

        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary readable folder
        try:
            bar.set_postfix_str(steps[1], refresh=True)
            model.save_pretrained(tmp)
            bar.update(1)
            bar.set_postfix_str(steps[2], refresh=True)
            tokenizer.save_pretrained(tmp)
            bar.update(1)
            info = {
                **(record or {}),
                "gguf_file": gguf_path.name,
                "dtype": "float32",
                "tie_word_embeddings": not untied_in_file,
                "vocab_size": model.get_input_embeddings().weight.shape[0],
                "num_params": sum(p.numel() for p in model.parameters()),
                "gguf_load_seconds": round(load_seconds, 1),
                "conversion_seconds": round(time.perf_counter() - start, 1),
                "transformers_version": _version("transformers"),
                "torch_version": torch.__version__,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            (tmp / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")
            for path in tmp.iterdir():  # safetensors writes its file private (0600)
                path.chmod(0o644)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                if not is_converted(out_dir):
                    raise
                logger.info("%s was written by another process meanwhile; keeping it", out_dir)
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
