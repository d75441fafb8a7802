"""The tokenizer of a GGUF file, as a `transformers` tokenizer, built once and kept beside it.

The llama.cpp backend runs a GGUF as shipped, but prompts, chat templates and detokenization go
through the same `transformers` tokenizer as the torch backend, so both backends see the same
token ids for the same text (a precondition for comparing their outputs token for token).
Reading the tokenizer out of a GGUF means parsing its whole vocabulary and merges, far slower
than loading a saved copy, so the copy is made once: for a catalogue model inside its cache
folder (``model.tokenizer/``, recorded and checked like every cached file), for any other GGUF
beside the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specdecode.models.cache import (
    GGUF_FILE,
    TOKENIZER_DIR,
    TOKENIZER_SCRATCH,
    FileRecords,
    ModelCache,
    cached_model_of,
    ensure_gguf,
)

logger = logging.getLogger(__name__)


def gguf_tokenizer(gguf: Path, cache: Path | None = None) -> Any:
    """The tokenizer stored in `gguf`; saved into `cache` (default: beside the file, or in the
    model's cache folder for a catalogue model's GGUF) the first time, written to a temporary
    folder and renamed, so a half-written copy is never read."""
    from transformers import AutoTokenizer

    model = cached_model_of(gguf) if cache is None else None
    if model is not None:
        with model.using("tokenizer", _make_cached_tokenizer, progress=False):
            return AutoTokenizer.from_pretrained(
                str(model.directory / TOKENIZER_DIR), local_files_only=True
            )
    cache = cache if cache is not None else gguf.parent / f"{gguf.stem}.tokenizer"
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    scratch = Path(tempfile.mkdtemp(prefix=TOKENIZER_SCRATCH, dir=gguf.parent))
    try:
        tokenizer.save_pretrained(str(scratch))
        with contextlib.suppress(OSError):  # another process finished first: its copy serves
            scratch.rename(cache)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def _make_cached_tokenizer(c: ModelCache, progress: bool) -> None:
    """A checked copy of the GGUF's tokenizer in the model folder, re-created from the GGUF if
    need be (exclusive lock held)."""
    from transformers import AutoTokenizer

    records = FileRecords.load(c.directory)
    saved = c.check("tokenizer", records, progress=progress)
    if saved.ok:
        if records.take("tokenizer", saved.checks):
            records.save_quietly()
        return
    if not saved.absent:
        state = "damaged" if saved.damaged else "incomplete"
        logger.warning(
            "%s: the cached GGUF tokenizer is %s (%s); re-creating it from the GGUF",
            c.spec.name,
            state,
            saved.describe(),
        )
    ensure_gguf(c, progress)
    folder = c.directory / TOKENIZER_DIR
    scratch = Path(tempfile.mkdtemp(prefix=TOKENIZER_SCRATCH, dir=c.directory))
    try:
        alone = scratch / "gguf"  # the model folder's other files kept out of the load
        alone.mkdir()
        (alone / GGUF_FILE).symlink_to(c.gguf.absolute())
        tokenizer = AutoTokenizer.from_pretrained(str(alone), gguf_file=GGUF_FILE)
        tokenizer.save_pretrained(str(scratch / "out"))
        records = FileRecords.load(c.directory)
        for rel in {*records.names("tokenizer"), *c.files("tokenizer")}:
            records.files.pop(rel, None)
        records.save()
        shutil.rmtree(folder, ignore_errors=True)
        (scratch / "out").chmod(0o755)
        for path in (scratch / "out").rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(scratch / "out", folder)
        records.add_settled("tokenizer", c.files("tokenizer"), progress=progress)
        records.save()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def render_chat(tokenizer: Any, chat: str | list[dict[str, Any]], what: str = "a prompt") -> str:
    """A conversation (or one user turn, given as text) in the tokenizer's chat template,
    ready for the assistant's next turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat rendering was asked for {what}, but the tokenizer "
            f"({type(tokenizer).__name__}) has no chat template; use chat=False or a "
            f"tokenizer of an instruction-tuned model"
        )
    messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else list(chat)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
