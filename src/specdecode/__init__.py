"""specdecode: speculative decoding for Hugging Face models, lossless and batched.

The public names load on first use (PEP 562): importing any submodule imports this package
first, and the command line must be able to check its arguments and print its help without
paying for torch and transformers.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.api import GenerationOutput, SpeculativeDecoder
    from specdecode.core.config import DecodeConfig, SamplingConfig

_PUBLIC = {
    "DecodeConfig": "specdecode.core.config",
    "GenerationOutput": "specdecode.api",
    "SamplingConfig": "specdecode.core.config",
    "SpeculativeDecoder": "specdecode.api",
}

__all__ = ["DecodeConfig", "GenerationOutput", "SamplingConfig", "SpeculativeDecoder"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
