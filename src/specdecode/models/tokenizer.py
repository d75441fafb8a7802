"""The tokenizer of a GGUF file, as a `transformers` tokenizer, built once and kept beside it.

The llama.cpp backend runs a GGUF as shipped, but prompts, chat templates and detokenization go
through the same `transformers` tokenizer as the torch backend, so both backends see the same
token ids for the same text (a precondition for comparing their outputs token for token).
Reading the tokenizer out of a GGUF means parsing its whole vocabulary and merges, far slower
than loading a saved copy, so the copy is made once: for a catalogue model inside its cache
folder (``model.tokenizer/``, recorded and checked like every cached file), for any other GGUF
beside the file.

Loading that copy through `transformers.AutoTokenizer` costs a second or more before the first
token (importing `transformers`, reading `tokenizer.json` twice); `SavedTokenizer` reads the same
`tokenizer.json` with the `tokenizers` library alone, which is what `transformers`' fast
tokenizer runs underneath: the same ids and text, in a fraction of the time. Chat templates are
rendered by the `transformers` tokenizer of the same folder, loaded only when one is asked for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specdecode.models.atomic import say_once
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
    folder and renamed, so a half-written copy is never read. A `SavedTokenizer` where the saved
    copy allows one (`saved_tokenizer`)."""
    model = cached_model_of(gguf) if cache is None else None
    if model is not None:
        with model.using("tokenizer", _make_cached_tokenizer, progress=False):
            return saved_tokenizer(model.directory / TOKENIZER_DIR)
    cache = cache if cache is not None else gguf.parent / f"{gguf.stem}.tokenizer"
    if (cache / "tokenizer_config.json").is_file():
        return saved_tokenizer(cache)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        scratch = Path(tempfile.mkdtemp(prefix=TOKENIZER_SCRATCH, dir=gguf.parent))
    except OSError as error:  # a read-only model folder: the tokenizer serves from memory
        _unsaved(gguf, error)
        return tokenizer
    try:
        tokenizer.save_pretrained(str(scratch))
        with contextlib.suppress(OSError):  # another process finished first: its copy serves
            scratch.rename(cache)
    except OSError as error:  # a full disk: as above
        _unsaved(gguf, error)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def _unsaved(gguf: Path, error: OSError) -> None:
    say_once(
        logger,
        ("tokenizer", gguf.parent),
        "the tokenizer of %s cannot be saved beside it (%s): read from the GGUF at each start",
        gguf,
        error,
    )


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


def saved_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in `folder`: a `SavedTokenizer` where its `tokenizer.json` is a BPE
    model (the GGUF tokenizers `transformers` reads are; for BPE, `transformers` decodes with no
    clean-up of spaces, as `tokenizers` does), else `transformers`' own."""
    saved = SavedTokenizer.read(folder)
    if saved is not None:
        return saved
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


class Encoding(dict):
    """What calling a tokenizer returns, as `transformers`' `BatchEncoding` is read here: the ids
    as `.input_ids` or `["input_ids"]`."""

    @property
    def input_ids(self) -> Any:
        return self["input_ids"]


class SavedTokenizer:
    """A tokenizer saved by `transformers` (`tokenizer.json`, `tokenizer_config.json`), read with
    the `tokenizers` library alone: encoding, decoding, the special tokens' ids and the
    vocabulary, as `transformers`' fast tokenizer gives them for the same folder. What else a
    caller reads (a chat template's rendering, `save_pretrained`, ...) comes from that
    `transformers` tokenizer, loaded at the first such read."""

    SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")

    @classmethod
    def read(cls, folder: Path) -> SavedTokenizer | None:
        """The tokenizer saved in `folder`; None where it is missing, unreadable or not BPE."""
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except Exception:  # OSError, ValueError, or `tokenizers`' own (a plain Exception)
            return None
        if type(tokenizer.model).__name__ != "BPE" or not isinstance(config, dict):
            return None
        return cls(folder, tokenizer, config)

    def __init__(self, folder: Path, tokenizer: Any, config: dict[str, Any]) -> None:
        self.name_or_path = str(folder)
        self._tokenizer = tokenizer
        self.special_tokens_map: dict[str, str] = {}
        for name in self.SPECIAL:
            token = config.get(name)
            if isinstance(token, dict):  # older configs write an added token's fields
                token = token.get("content")
            if isinstance(token, str):
                self.special_tokens_map[name] = token
            setattr(self, f"{name}_id", self.convert_tokens_to_ids(token))
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text(encoding="utf-8")
            if template.is_file()
            else config.get("chat_template")
            if isinstance(config.get("chat_template"), str)
            else None
        )
        self._full: Any = None

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        if isinstance(text, str):
            return Encoding(input_ids=self.encode(text, add_special_tokens))
        encoded = self._tokenizer.encode_batch(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in encoded])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """The text of `ids` (a list, or a tensor's values). `clean_up_tokenization_spaces` is
        taken and left unapplied, as `transformers` leaves it for a BPE tokenizer."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, rows: Any, skip_special_tokens: bool = False, **kwargs: Any
    ) -> list[str]:
        return [self.decode(row, skip_special_tokens, **kwargs) for row in rows]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as `transformers` counts it)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """Rendered by the `transformers` tokenizer of the same folder (its template engine,
        its globals, its handling of every argument)."""
        return self.full().apply_chat_template(*args, **kwargs)

    def full(self) -> Any:
        """The `transformers` tokenizer of this folder (loaded once, at the first call)."""
        if self._full is None:
            from transformers import AutoTokenizer

            self._full = AutoTokenizer.from_pretrained(self.name_or_path, local_files_only=True)
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never the transformers tokenizer's private parts (nor a
            # lookup during construction or unpickling, before `_full` exists)
            raise AttributeError(name)
        return getattr(self.full(), name)


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
