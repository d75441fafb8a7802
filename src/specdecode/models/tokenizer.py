"""The tokenizer of a GGUF file, as a `transformers` tokenizer, built once and cached beside it.

The llama.cpp backend runs a GGUF as shipped, but prompts, chat templates and detokenization go
through the same `transformers` tokenizer as the torch backend, so both backends see the same
token ids for the same text (a precondition for comparing their outputs token for token).
Reading the tokenizer out of a GGUF takes 20-40 s on 2 cores (151,936 tokens and their merges);
its saved copy loads in about a second.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

TOKENIZER_DIR = "tokenizer"


def gguf_tokenizer(gguf: Path, cache: Path | None = None) -> Any:
    """The tokenizer stored in `gguf`; saved into `cache` (default: beside the file) the first
    time, written to a temporary folder and renamed, so a half-written copy is never read."""
    from transformers import AutoTokenizer

    from specdecode.models import store

    managed = store.cached_model_of(gguf) if cache is None else None
    if managed is not None:  # a catalogue model's GGUF: its copy is recorded and checked there
        return store.gguf_tokenizer(managed[0], managed[1], progress=False)
    cache = cache if cache is not None else gguf.parent / f"{gguf.stem}.{TOKENIZER_DIR}"
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    scratch = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=gguf.parent))
    try:
        tokenizer.save_pretrained(str(scratch))
        with contextlib.suppress(OSError):  # another process finished first: its copy serves
            scratch.rename(cache)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def render_chat(tokenizer: Any, text: str, what: str = "a prompt") -> str:
    """One user turn in the tokenizer's chat template, ready for generation."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat rendering was asked for {what}, but the tokenizer "
            f"({type(tokenizer).__name__}) has no chat template; use chat=False or a "
            f"tokenizer of an instruction-tuned model"
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
