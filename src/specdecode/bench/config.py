"""What every bench is asked: the settings they share, each default written once.

Four benches (PyTorch, llama.cpp, the captured path's random-weight pairs, translation) are
measured by the one runner, so they share what the runner reads: the methods, the batch sizes,
the budget of new tokens, the repeats and the threads (`BenchConfig`). The two that decode a
prompt set with a target and a drafter share those too (`PromptBenchConfig`). Each bench's own
config adds only the fields that are its own; the command line passes what the user gave and
leaves the rest to these defaults, so that a default lives in one place.

Fields are keyword-only: a subclass adds fields without defaults (a pair's directory, a shape)
after the shared ones that have them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdecode.core.config import DEFAULT_MAX_NEW_TOKENS

REFERENCE = "ar"  # the baseline of every ratio and the text exact methods must reproduce
DEFAULT_PROMPTS = "humaneval"  # the prompt set a causal bench (and head collection) reads
DEFAULT_PROMPT_LIMIT = 20  # first N prompts: 20 HumanEval stubs are the README's figures
DEFAULT_SENTENCE_LIMIT = 200  # the translation bench: the split's first N sentences
DEFAULT_DRAFT_TOKENS = (4,)
DEFAULT_ACCEPTANCE = (0.8,)  # the captured bench: per-token acceptance the script holds
DEFAULT_BLOCK_SIZES = (25,)  # the translation bench: SpecDec's block drafter, k tokens
DEFAULT_RELAXED = ((5, 3.0),)  # the translation bench: SpecDec's top-beta/tau rule (beta, tau)
# each bench's methods where --methods is not given (`BenchConfig.DEFAULT_METHODS`)
DEFAULT_METHODS_OF = {
    "llama.cpp": (
        "ar",
        "specdecode",
        "sd-lookup",
        "llama-cpp-python",
        "llama-cpp-python-huge",
        "llama-cpp-python-lookup",
    ),
    "torch": ("ar", "hf", "hf-assisted", "sd", "sd-int8"),
    "captured": ("ar", "sd", "eager-ar", "eager-sd", "hf-static", "hf-assisted", "graph-ar"),
    "seq2seq": ("ar", "hf", "hf-beam5", "hf-assisted", "specdec"),
}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """The settings of any bench: what the runner (`runner.measure`) and the record need."""

    DEFAULT_METHODS: ClassVar[tuple[str, ...]] = (REFERENCE,)

    methods: tuple[str, ...] = ()  # empty: the bench's DEFAULT_METHODS
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    repeats: int = 1  # > 1: each batch's rotation runs this many times, fastest run kept
    threads: int | None = None  # None: the backend's own choice (physical cores)

    def __post_init__(self) -> None:
        if not self.methods:
            object.__setattr__(self, "methods", self.DEFAULT_METHODS)
        if REFERENCE not in self.methods:
            raise ValueError("the methods must include 'ar', the baseline of every ratio")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


@dataclass(frozen=True, kw_only=True)
class PromptBenchConfig(BenchConfig):
    """A causal bench over a prompt set: a target, a drafter, draft lengths and sampling."""

    target: str
    draft: str
    prompts: str = DEFAULT_PROMPTS
    limit: int | None = DEFAULT_PROMPT_LIMIT
    skip: int = 0  # prompts dropped from the set's start before `limit` is taken
    num_draft_tokens: tuple[int, ...] = DEFAULT_DRAFT_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(k < 1 for k in self.num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
