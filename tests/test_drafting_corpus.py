"""The corpus index drafting auto reads where a row's own text has no match."""

from __future__ import annotations

import argparse
import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import corpora as corpus_module
from specdecode.cli.common import checked_corpus
from specdecode.core.config import DEFAULT_CORPUS, LOOKUP_ALONE
from specdecode.core.drafting.corpus import CHAIN_SHARE, ORDERS, CorpusIndex, share_band
from specdecode.core.drafting.mixed import corpus_key
from specdecode.corpora import STDLIB, corpus_files, corpus_index, load_index, save_index


def brute_next(documents: list[list[int]], context: list[int], min_count: int = 2):
    """The longest context (up to ORDERS) ending `context` seen min_count times in one document,
    its most frequent next token (the smallest id among ties) and that token's share."""
    for n in range(min(ORDERS, len(context)), 0, -1):
        tail = context[-n:]
        after = collections.Counter(
            d[i + n] for d in documents for i in range(len(d) - n) if d[i : i + n] == tail
        )
        total = sum(after.values())
        if total >= min_count:
            most = max(after.values())
            return min(t for t, c in after.items() if c == most), most / total
    return None


def test_the_most_frequent_next_token_of_the_longest_known_context() -> None:
    docs = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [5, 1, 2, 3]]
    index = CorpusIndex.build(docs)
    token, share = index.next_token([9, 1, 2])
    assert token == 3 and share == pytest.approx(3 / 4)  # after 1 2: 3, 4, 3, 3
    # 2 3 is followed by 1 once only in the first document: a single occurrence is no law,
    # so the shorter context 3 (followed by 1 once, too) and nothing is known
    assert index.next_token([2, 3]) is None
    assert index.next_token([7]) is None
    assert index.next_token([]) is None


def test_no_context_spans_two_documents() -> None:
    index = CorpusIndex.build([[1, 2], [3, 4], [1, 2], [3, 4]])
    assert index.next_token([2]) is None  # 2 ends a document both times
    assert index.next_token([1]) == (2, 1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
    st.lists(st.integers(0, 4), min_size=1, max_size=8),
)
def test_lookups_match_counting_by_hand(documents, context) -> None:
    found = CorpusIndex.build(documents).next_token(context)
    expected = brute_next(documents, context)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found[0] == expected[0]
        assert found[1] == pytest.approx(expected[1], rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
    st.lists(st.integers(0, 4), min_size=0, max_size=40),
)
def test_evidence_counts_the_choices_a_text_would_have_met(documents, text) -> None:
    """Per share band, the positions of a text where the index had a choice and how many of
    those choices were the text's next token: the same as asking `next_token` at each."""
    index = CorpusIndex.build(documents)
    counts = [[0, 0] for _ in range(3)]
    for p in range(1, len(text)):
        found = index.next_token(text[:p])
        if found is not None:
            counts[share_band(found[1])][0] += 1
            counts[share_band(found[1])][1] += found[0] == text[p]
    assert index.evidence(text) == [tuple(c) for c in counts]


def test_a_draft_chains_clear_choices_and_reports_its_first_band() -> None:
    docs = [[1, 2, 3, 4, 5]] * 3 + [[1, 9]]
    index = CorpusIndex.build(docs)
    drafted, band = index.continuation([1], 8)
    assert drafted == [2, 3, 4, 5] and band == share_band(3 / 4)  # 5 ends every document
    assert index.continuation([1], 2) == ([2, 3], share_band(3 / 4))
    assert index.continuation([8], 4) == ([], -1)
    # a later token whose context is split evenly stops the draft
    split = CorpusIndex.build([[1, 2, 3], [1, 2, 3], [7, 3, 5], [7, 3, 6], [8, 3, 9]])
    assert split.next_token([1, 2, 3])[1] < CHAIN_SHARE or split.next_token([1, 2, 3]) is None
    assert split.continuation([1], 4)[0] == [2, 3]


def test_share_bands_and_keys_sit_past_the_match_lengths() -> None:
    assert [share_band(s) for s in (1.0, 0.8, 0.7, 0.6, 0.3)] == [0, 0, 1, 1, 2]
    assert corpus_key(LOOKUP_ALONE, 0) == LOOKUP_ALONE.max_ngram + 1


def test_an_index_is_saved_and_read_back(tmp_path) -> None:
    docs = [[3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 3, 5]]
    index = CorpusIndex.build(docs)
    save_index(index, tmp_path / "i.npz")
    again = load_index(tmp_path / "i.npz")
    for context in ([3], [3, 1], [1, 4, 1], [1, 5], [4]):
        assert again.next_token(context) == index.next_token(context)


def test_corpus_files_refuse_what_is_not_there(tmp_path) -> None:
    with pytest.raises(ValueError, match="no corpus 'nowhere'"):
        corpus_files("nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        corpus_files(str(tmp_path / "empty"))
    (tmp_path / "code" / ".git").mkdir(parents=True)
    (tmp_path / "code" / ".git" / "HEAD").write_text("ref")
    (tmp_path / "code" / "a.py").write_text("x = 1\n")
    assert corpus_files(str(tmp_path / "code")) == [tmp_path / "code" / "a.py"]
    stdlib = corpus_files(STDLIB)
    assert any(p.name == "functools.py" for p in stdlib)
    assert not any("test" in p.parts or "site-packages" in p.parts for p in stdlib)


def test_a_named_corpus_is_indexed_once_then_read(tmp_path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "c.txt").write_text("abab abab abab")
    (docs / "bin").write_bytes(b"\xff\xfe\x00")  # not UTF-8 text: left out
    calls = []

    def encode(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return [[ord(c) for c in t] for t in texts]

    first = corpus_index(str(docs), encode, "chars", tmp_path / "cache")
    again = corpus_index(str(docs), encode, "chars", tmp_path / "cache")
    assert len(calls) == 1 and calls[0] == ["abab abab abab"]
    assert first.next_token([ord("a")]) == again.next_token([ord("a")]) == (ord("b"), 1.0)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_missing_corpus_is_refused_before_anything_loads(command, tmp_path, capsys) -> None:
    from specdecode.cli.main import main

    argv = [command, "--corpus", str(tmp_path / "none-here")]
    if command == "generate":
        argv += ["--prompt", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"specdecode {command}: error: no corpus" in err and "Traceback" not in err


def test_a_decoder_indexes_a_named_corpus_with_its_tokenizer(
    tiny_llama, word_tokenizer, tmp_path
) -> None:
    from specdecode import SpeculativeDecoder

    tokenizer = word_tokenizer()
    decoder = SpeculativeDecoder(tiny_llama(seed=0), tokenizer)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("t5 t6 t7 t8 t5 t6 t7 t9")
    decoder.use_corpus(str(docs), cache_dir=tmp_path / "cache")
    context = tokenizer("t5 t6", add_special_tokens=False)["input_ids"]
    assert decoder.corpus.next_token(context) == (tokenizer.convert_tokens_to_ids("t7"), 1.0)
    assert list((tmp_path / "cache" / "corpora").glob("corpus-*.npz"))
    with pytest.raises(ValueError, match="no corpus"):
        decoder.use_corpus(str(tmp_path / "missing"))
    decoder.use_corpus(None)
    assert decoder.corpus is None


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, STDLIB),
        ({"corpus": "none"}, None),
        ({"drafting": "model"}, None),
        ({"no_draft": True}, None),
    ],
)
def test_drafting_auto_reads_the_standard_library_by_default(options, expected) -> None:
    """Left out, the corpus is the standard library where drafting auto reads one, and none
    where another drafting or --no-draft would not."""
    assert DEFAULT_CORPUS == STDLIB
    args = argparse.Namespace(**{"drafting": "auto", "corpus": None, "no_draft": False, **options})
    assert checked_corpus(args) == expected


def test_a_python_without_sources_drafts_without_the_default_corpus(monkeypatch, capsys) -> None:
    """The default corpus where this Python holds no sources: none, and said so; asked for by
    name, refused."""
    monkeypatch.setattr(corpus_module, "stdlib_sources", lambda: [])
    args = argparse.Namespace(drafting="auto", corpus=None, no_draft=False)
    assert checked_corpus(args) is None
    assert "without a corpus" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"no \.py sources"):
        checked_corpus(argparse.Namespace(drafting="auto", corpus=STDLIB, no_draft=False))
