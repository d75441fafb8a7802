"""llama-cpp-python's library, loaded once per process, and what it tells without a context.

Why apart from the backend: the library's start (a module global that keeps llama.cpp quiet),
the machine's physical cores and a GGUF's end-of-generation ids serve callers that load no
model for decoding (a bench sizing its threads, the peers' stop ids), as well as the backend.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any


class LlamaCppUnavailableError(RuntimeError):
    """llama-cpp-python is not installed (or failed to build) in this environment."""


class LlamaCppLoadError(ValueError):
    """llama.cpp could not load a model file or create its context."""


def load_library() -> Any:
    """llama-cpp-python's module, its backend started once per process (`_init_once`)."""
    try:
        import llama_cpp
    except ImportError as error:  # missing, or a build that failed to produce its library
        raise LlamaCppUnavailableError(
            "the llama.cpp backend needs llama-cpp-python: install it with "
            '`pip install -e ".[llamacpp]"` (it compiles llama.cpp, several minutes on 2 cores), '
            f"or use `--backend torch` ({error})"
        ) from error
    _init_once(llama_cpp)
    return llama_cpp


_QUIET = None


def _init_once(lib: Any) -> None:
    """Start llama.cpp's backend and route its log lines to nowhere (they would flood stderr
    with every tensor it loads); errors still surface as our own exceptions."""
    global _QUIET
    if _QUIET is None:
        _QUIET = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_QUIET, ctypes.c_void_p())
        lib.llama_backend_init()


def physical_cores() -> int:
    """Physical cores this process may use: llama.cpp's matrix kernels gain nothing from a
    core's second hyperthread and lose to the contention, so threads default to these."""
    allowed = os.sched_getaffinity(0)
    cores: set[tuple[str, str]] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return len(allowed)
    cpu, phys = None, "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            cpu = int(value)
        elif key == "physical id":
            phys = value
        elif key == "core id" and cpu in allowed:
            cores.add((phys, value))
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def end_of_generation_ids(lib: Any, vocab: Any, vocab_size: int) -> tuple[int, ...]:
    """Every id llama.cpp ends a generation at (`llama_vocab_is_eog`), not only the GGUF's eos
    and eot: an instruct model's eos is its end of turn (Qwen2.5's `<|im_end|>`), yet it also
    writes `<|endoftext|>` or `<|file_sep|>` after a completed file, where llama-server and
    llama-cpp-python stop. One call per id (a tenth of a second for 152k ids)."""
    return tuple(i for i in range(vocab_size) if lib.llama_vocab_is_eog(vocab, i))


def gguf_stop_ids(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """`LlamaCppModel(path).stop_token_ids()` without the weights: a vocabulary-only load."""
    lib = load_library()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise LlamaCppLoadError(f"llama.cpp could not read the vocabulary of {path}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        return end_of_generation_ids(lib, vocab, int(lib.llama_vocab_n_tokens(vocab)))
    finally:
        lib.llama_model_free(model)
