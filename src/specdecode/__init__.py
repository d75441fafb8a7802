"""specdecode: speculative decoding for Hugging Face models, lossless and batched."""

from specdecode.api import GenerationOutput, SpeculativeDecoder
from specdecode.core.config import DecodeConfig, SamplingConfig

__all__ = ["DecodeConfig", "GenerationOutput", "SamplingConfig", "SpeculativeDecoder"]
__version__ = "0.1.0"
