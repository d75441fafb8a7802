"""GGUF to fp32 safetensors: what the torch backend loads, made once from the verified GGUF.

transformers can read a GGUF directly, but it dequantizes every weight on each load, which takes
far longer than reading plain fp32 safetensors, so the conversion is made once and kept.
Converting is separate from fetching: the GGUF is the primary cached file (llama.cpp runs it as
it is) and the conversion is made only when the torch backend first asks (``converted_model``).

``convert_gguf`` writes into a fresh folder and renames it into place; ``ensure_converted`` then
moves the files into the model's cache folder and records their hashes (``cache``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdecode.models.cache import FileRecords, ModelCache, ensure_gguf
from specdecode.models.catalogue import ModelSpec
from specdecode.models.integrity import DamagedModelError
from specdecode.models.join import check_disk_space

logger = logging.getLogger(__name__)

MARKER_FILE = "specdecode_model.json"


class ConversionError(RuntimeError):
    """The GGUF loaded, but the converted model would not match it."""


def is_converted(path: Path) -> bool:
    """Whether ``path`` holds a finished conversion (the marker is written last).

    Says nothing about whether the files are intact: the cache checks them against their
    records (``converted_model``, ``models verify``).
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

    transformers resolves a GGUF inside a model folder, and the cache's model folder also holds
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
    process finished first) that copy is kept and ours discarded. ``ensure_converted`` converts
    into a fresh folder under the model's exclusive lock and records the files' hashes after.
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


# --------------------------------------------------------------------------- in the cache


@contextlib.contextmanager
def converted_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    force: bool = False,
) -> Iterator[Path]:
    """The checked fp32 model folder of catalogue model ``name``, under the model's lock for as
    long as the block runs; fetched and converted first if need be (``cache`` says what is
    re-created, fetched, or refused). ``force`` deletes everything cached first."""
    c = ModelCache.of(name, cache_dir)
    with c.using("fp32", ensure_converted, progress=progress, force=force):
        yield c.directory


def ensure_converted(c: ModelCache, progress: bool) -> None:
    """A good fp32 conversion in the model folder (exclusive lock held)."""
    name = c.spec.name
    records = FileRecords.load(c.directory)
    converted = c.check("fp32", records, progress=progress)
    if converted.ok:
        if records.take("fp32", converted.checks):
            records.save_quietly()
        return
    gguf = c.check("gguf", records, progress=progress)
    if gguf.damaged:
        raise DamagedModelError(name, [*converted.damaged, *gguf.damaged], c.fix)
    if converted.damaged and not gguf.ok:
        why = ", and no verified GGUF is cached to re-create it from"
        raise DamagedModelError(name, converted.damaged, c.fix, why=why)
    if not converted.absent:
        state = "damaged" if converted.damaged else "incomplete"
        source = f"the verified GGUF {c.gguf}" if gguf.ok else "the GGUF, fetched first"
        logger.warning(
            "%s: the cached fp32 copy is %s (%s); re-creating it from %s",
            name,
            state,
            converted.describe(),
            source,
        )
    if gguf.ok:
        if records.take("gguf", gguf.checks):
            records.save_quietly()
    else:
        ensure_gguf(c, progress, need_after=c.spec.fp32_bytes)
    _convert_into_place(c, progress)


def _convert_into_place(c: ModelCache, progress: bool) -> None:
    """Convert the GGUF, replace any earlier conversion with it, record its files.

    The conversion is written to a temporary folder beside the model folder; its files are
    then renamed into place and hashed. The previous conversion's files, recorded or not, are
    deleted first, so no stray file of it is loaded with the new one. Exclusive lock held, the
    GGUF verified.
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
        for rel in {*records.names("fp32"), *c.files("fp32")}:
            (c.directory / rel).unlink(missing_ok=True)
            records.files.pop(rel, None)
        records.save()
        for rel in new:
            (c.directory / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / rel, c.directory / rel)
        records.add_settled("fp32", new, progress=progress)
        records.save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
