"""The backends by name, as the command line, the loading module and the facade spell them.

Apart from `loading` (which imports torch) so that the command line can offer and check them
before torch is imported, and apart from the catalogue so that reading them costs no import.
"""

from __future__ import annotations

TORCH = "torch"
TORCH_STATIC = "torch-static"
LLAMA_CPP = "llama.cpp"
BACKENDS = (TORCH, TORCH_STATIC, LLAMA_CPP)
TORCH_BACKENDS = (TORCH, TORCH_STATIC)  # transformers modules, the heads and peers read them
