"""Loading a pair by name or path: which backend, which files, what is checked before any weights
are read, and the backends built over them.

A model is resolved once (`resolve`: a known model's GGUF file is fetched and checked, a local
folder found) and the `ModelSource` passed along, so that a command which reads the tokenizer
before the weights (`fitted_tokenizer`, to refuse a prompt that cannot fit in a fraction of a
second) does not resolve it again when the weights load (`load_pair`). The facade
(`api.SpeculativeDecoder.from_pretrained`) pairs what is built here; the command line and the
server call this module and the facade, never the backends or the model files themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from specdecode.backend_names import BACKENDS, LLAMA_CPP, TORCH, TORCH_STATIC
from specdecode.backends.base import ModelBackend
from specdecode.core.checks import check_prompts
from specdecode.core.config import PROMPT_LOOKUP, PromptLookup
from specdecode.prompts import encode_prompts

DRAFT_PRECISIONS = ("auto", "int8", "fp32")  # `int8_draft_wanted`'s choices


def as_backend(model: Any, role: str) -> ModelBackend:
    """A `transformers` decoder gets the PyTorch backend; a backend is taken as it is."""
    if isinstance(model, torch.nn.Module):
        from specdecode.backends.torch_eager import CachedModel

        return CachedModel(model.eval(), role)
    if isinstance(model, ModelBackend):
        return model
    raise TypeError(
        f"{role} must be a transformers causal LM or a model backend (e.g. "
        f"backends.llamacpp.LlamaCppModel), got {type(model).__name__}"
    )


def default_backend(name_or_path: str, device: str) -> str:
    """llama.cpp for what is a GGUF (a known model, a .gguf file) on the CPU; else torch."""
    from specdecode.models.catalogue import MODELS

    is_gguf = name_or_path in MODELS or str(name_or_path).endswith(".gguf")
    return LLAMA_CPP if is_gguf and str(device) == "cpu" else TORCH


def gguf_path(name_or_path: str) -> Path:
    """The GGUF file of a known model (fetched and checked) or a local .gguf path."""
    from specdecode.models.catalogue import MODELS

    if name_or_path in MODELS:
        from specdecode.models.store import gguf_file

        return gguf_file(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(
            f"{name_or_path!r} is neither a known model nor a .gguf file: the llama.cpp backend "
            f"runs GGUF files (known models: {', '.join(MODELS)}); a transformers model "
            "directory runs with --backend torch"
        )
    return path


@dataclass(frozen=True)
class ModelSource:
    """A target named once and found: its name as given, the backend it runs on, and its files
    (llama.cpp: the GGUF file; torch: the local model folder; None: a known model, converted
    at its load)."""

    name: str
    backend: str
    path: Path | None


def resolve(name_or_path: str, backend: str) -> ModelSource:
    """Find a model's files for `backend`: a known model's GGUF is fetched and checked here,
    the one time it is."""
    if backend == LLAMA_CPP:
        return ModelSource(name_or_path, backend, gguf_path(name_or_path))
    from specdecode.models.catalogue import MODELS

    if name_or_path in MODELS:
        return ModelSource(name_or_path, backend, None)
    from specdecode.models.store import resolve_model

    return ModelSource(name_or_path, backend, resolve_model(name_or_path))


def fitted_tokenizer(
    source: ModelSource, prompts: list[str], chat: bool, max_new_tokens: int
) -> Any:
    """The target's tokenizer, loaded before its weights, with every prompt and its new tokens
    checked against the target's context: a prompt that cannot fit fails before gigabytes are
    read. None where the tokenizer comes only with the weights (a known model on torch, which
    is checked once loaded)."""
    if source.backend == LLAMA_CPP:
        from specdecode.backends.llamacpp import gguf_context
        from specdecode.models.tokenizer import gguf_tokenizer

        tokenizer, context = gguf_tokenizer(source.path), gguf_context(source.path)
    else:
        if source.path is None:
            return None
        from transformers import AutoConfig, AutoTokenizer

        from specdecode.backends.torch_eager import context_length

        folder = str(source.path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError):
            return None  # the load says what is wrong with the folder, in its own words
        context = context_length(SimpleNamespace(config=config))  # reads the config alone
    check_prompts(encode_prompts(tokenizer, prompts, chat), max_new_tokens, context)
    return tokenizer


def int8_draft_wanted(choice: str, device: str, dtype: torch.dtype) -> bool:
    """The command lines' `--draft-precision`: "auto" drafts in int8 where it runs (fp32 models
    on the CPU), the fastest setting measured on CPU for both pairs; "int8" insists on it."""
    if choice not in DRAFT_PRECISIONS:
        raise ValueError(f"draft precision must be one of {DRAFT_PRECISIONS}, got {choice!r}")
    from specdecode.backends.kernels import cpu_fp32

    fits = cpu_fp32(device, dtype)
    if choice == "int8" and not fits:
        raise ValueError(
            f"an int8 drafter needs float32 models on the CPU; got {dtype} on {device}"
        )
    return choice == "int8" or (choice == "auto" and fits)


class DeferredModel:
    """A drafter model not loaded yet: what its prices are keyed by (its kind, files and
    threads, as `pricebook.model_identity` reads them), and how to load it. Drafting `auto` on
    a machine where the model cannot pay never loads it."""

    def __init__(
        self,
        load: Callable[[], ModelBackend],
        kind: str,
        path: Path,
        threads: int,
        context_length: int | None = None,
    ) -> None:
        self.load, self.backend_kind, self.path, self.threads = load, kind, path, threads
        self.context_length = context_length  # tokens per row the loaded model will have
        self.device = torch.device("cpu")


class LoadedPair(NamedTuple):
    """What `SpeculativeDecoder` is made of: the target's backend and tokenizer, the drafter
    (a backend, a `DeferredModel`, `PromptLookup` or None) and its tokenizer."""

    target: ModelBackend
    tokenizer: Any
    drafter: ModelBackend | DeferredModel | PromptLookup | None = None
    drafter_tokenizer: Any = None


def load_pair(
    target: str | ModelSource,
    drafter: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    prepack: bool | None = None,
    drafter_int8: bool = False,
    backend: str | None = None,
    threads: int | None = None,
    compile: bool | None = None,
    tokenizer: Any = None,
    context: int | None = None,
    prefix_cache_mib: int = 0,
    passes: int | None = None,
) -> LoadedPair:
    """The backends of `SpeculativeDecoder.from_pretrained`, every setting checked before any
    weights are read.

    `backend`: "llama.cpp" runs GGUF files as shipped (4-bit, an eighth of fp32's memory
    and bytes per step); "torch" runs `transformers` models (a known model is converted to
    fp32 safetensors once); "torch-static" runs them over a static per-row cache in fixed
    shapes (`backends.torch_static`), its passes captured as CUDA graphs on a GPU (`compile`:
    through `torch.compile` instead, minutes of compiling first). None: llama.cpp for known
    models and `.gguf` files on the CPU, torch otherwise.
    `threads`: llama.cpp's threads (default: the physical cores). `tokenizer`: the
    target GGUF's tokenizer where the caller loaded it already (the command line does, to
    check the prompts against the context before the weights load). `context`: llama.cpp's
    tokens per row (prompt plus new tokens; default 4096, at most the trained context): its
    cache is sized rows x context up front, so a server of 8 rows of 2048 holds half the
    cache of the default. `prefix_cache_mib`: llama.cpp only, host memory per model for the
    cells of prompts whose sequence a later row takes over, restored when a prompt sharing
    their prefix comes back (a server's seen prompts; `LlamaCppModel`).
    `passes`: llama.cpp only, the most target passes the caller will run (a generation's
    new tokens), where it knows: the target's weights are then moved to 2 MiB pages only if
    so many passes repay the move (`LlamaCppModel`).

    torch only: `prepack` gives the target's linear layers oneDNN-packed copies for
    products of 2+ rows (`kernels.prepack_linears`): on CPUs where the default fp32 kernel
    runs a few rows at two to three times the cost of one, a verify pass otherwise costs
    that much more than a decoding step. None (the default): on for fp32 on the CPU where
    this torch build has the kernels; it doubles the target's linear weights in memory, and
    an fp32 drafter gets the same packing. `drafter_int8` drafts with an int8 dynamically
    quantized copy of the drafter (CPU) instead: cheaper drafts, the same output law.
    """
    source = target if isinstance(target, ModelSource) else None
    name = source.name if source is not None else target
    if backend is None:
        backend = source.backend if source is not None else default_backend(name, device)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if source is not None and source.backend != backend:
        raise ValueError(f"{name!r} was resolved for the {source.backend} backend, not {backend}")
    if compile is not None and backend != TORCH_STATIC:
        raise ValueError(
            "compile is an option of the torch-static backend (--backend torch-static)"
        )
    if backend == LLAMA_CPP:
        if device != "cpu" or dtype != torch.float32 or prepack or drafter_int8:
            raise ValueError(
                "the llama.cpp backend runs a GGUF's own weights on the CPU: dtype, device, "
                "prepack and int8 drafting are options of the torch backend (--backend torch)"
            )
        path = source.path if source is not None else gguf_path(name)
        return _gguf_pair(path, drafter, threads, tokenizer, context, prefix_cache_mib, passes)
    if context is not None or prefix_cache_mib:
        raise ValueError(
            "context and prefix_cache_mib size llama.cpp's cache; the torch backends grow "
            "theirs as rows do (--backend llama.cpp, or leave them out)"
        )
    from specdecode.backends.kernels import (
        cpu_fp32,
        prepack_available,
        prepack_linears,
        quantize_int8,
    )
    from specdecode.models.store import load_causal_lm

    fits = cpu_fp32(device, dtype)
    if prepack and not (fits and prepack_available()):
        raise ValueError(
            "prepack needs float32 on the CPU and a torch build with oneDNN kernels; got "
            f"{dtype} on {device}"
        )
    if drafter_int8 and not fits:
        raise ValueError(f"an int8 drafter needs float32 on the CPU; got {dtype} on {device}")
    if drafter_int8 and drafter in (None, PROMPT_LOOKUP):
        raise ValueError("drafter_int8 needs a drafter model")
    files = source.path if source is not None and source.path is not None else name
    target_model, tokenizer = load_causal_lm(files, dtype=dtype, device=device)
    pack = prepack or (prepack is None and fits and prepack_available())
    if pack:
        prepack_linears(target_model)
    wrap = as_backend
    if backend == TORCH_STATIC:
        from specdecode.backends.torch_static import StaticCachedModel

        def wrap(model: Any, role: str) -> ModelBackend:
            return StaticCachedModel(model.eval(), role, compile=bool(compile))

    target_lm = wrap(target_model, "target")
    if drafter is None:
        return LoadedPair(target_lm, tokenizer)
    if drafter == PROMPT_LOOKUP:
        return LoadedPair(target_lm, tokenizer, PromptLookup())
    draft_model, draft_tokenizer = load_causal_lm(drafter, dtype=dtype, device=device)
    if drafter_int8:
        draft_model = quantize_int8(draft_model)
    if pack:  # an int8 copy has no fp32 Linear left, so packing leaves it as it is
        prepack_linears(draft_model)
    return LoadedPair(target_lm, tokenizer, wrap(draft_model, "drafter"), draft_tokenizer)


def _gguf_pair(
    path: Path,
    drafter: str | None,
    threads: int | None,
    tokenizer: Any = None,
    context: int | None = None,
    prefix_cache_mib: int = 0,
    passes: int | None = None,
) -> LoadedPair:
    from specdecode.backends.llamacpp import DEFAULT_CONTEXT, LlamaCppModel, gguf_context
    from specdecode.models.tokenizer import gguf_tokenizer

    tokenizer = tokenizer if tokenizer is not None else gguf_tokenizer(path)
    sized = {
        "prefix_cache_mib": prefix_cache_mib,
        "context": DEFAULT_CONTEXT if context is None else context,
    }
    target_lm = LlamaCppModel(path, role="target", threads=threads, passes=passes, **sized)
    if drafter is None:
        return LoadedPair(target_lm, tokenizer)
    if drafter == PROMPT_LOOKUP:
        return LoadedPair(target_lm, tokenizer, PromptLookup())
    draft_path = gguf_path(drafter)
    draft_lm = DeferredModel(
        lambda: LlamaCppModel(draft_path, role="drafter", threads=threads, **sized),
        "LlamaCppModel",
        draft_path,
        target_lm.threads,
        gguf_context(draft_path, sized["context"]),  # its own: a drafter may know fewer
    )  # loaded where a drafting setting drafts with it (`SpeculativeDecoder.drafter_backend`)
    return LoadedPair(target_lm, tokenizer, draft_lm)
