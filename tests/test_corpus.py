"""The Bible corpus: OSIS cleaning, verse alignment, book split, pinned .debs, `data` CLI.

Everything runs on hand-written fixtures: no network, no SWORD modules. The OSIS strings copy
the shapes found in the real modules (RV1909, WEB, KJV), including the ones that once broke the
cleaner: notes flush against a closing quote, RV1909's added words flush against the next word,
and chapter openings in capitals that hide a proper noun.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
from pathlib import Path

import pytest

from specdecode.cli import data as data_cli
from specdecode.cli.main import build_parser, main
from specdecode.seq2seq import corpus
from specdecode.seq2seq.corpus import (
    CorpusError,
    DebPackage,
    Verse,
    align,
    clean_osis,
    corpus_dir,
    download_debs,
    fix_chapter_caps,
    read_split,
    split_by_book,
    usual_casing,
    write_splits,
)

# -- markup -------------------------------------------------------------------------------------


def test_note_is_removed_and_leaves_a_word_boundary() -> None:
    raw = 'God<note placement="foot"><reference type="annotateRef">1:1 </reference>x</note>created'
    assert clean_osis(raw) == "God created"


def test_note_before_punctuation_or_closing_quote_leaves_no_space() -> None:
    # WEB 2 Samuel 4:8 and Galatians 3:16: the footnote sits between the word and its quote.
    assert clean_osis('offspring.<note placement="foot">or, seed</note>”') == "offspring.”"
    raw = "“To descendants<note>or, seeds</note>”, as of many"
    assert clean_osis(raw) == "“To descendants”, as of many"
    assert clean_osis("him<note>n</note>, and<note>m</note>.") == "him, and."


def test_canonical_title_kept_other_titles_dropped() -> None:
    raw = (
        '<title canonical="true" type="psalm">A Psalm by David.</title> '
        "<w>Yahweh</w> is my shepherd"
    )
    assert clean_osis(raw) == "A Psalm by David. Yahweh is my shepherd"
    raw = '<title type="section">The Creation</title>In the beginning'
    assert clean_osis(raw) == "In the beginning"


def test_word_and_inline_tags_stripped_keeping_text() -> None:
    raw = (
        '<w lemma="strong:H0430" morph="x">God</w> <w lemma="strong:H1254">created</w> '
        '<divineName type="x-yhwh">Lord</divineName> <transChange type="added">it</transChange> '
        '<q marker="" who="Jesus">“Come</q><milestone type="x-extra-p"/> '
        '<div type="x-milestone" subType="x-preverse" sID="pv1"/>now.'
    )
    assert clean_osis(raw) == "God created Lord it “Come now."


def test_entities_pilcrow_and_whitespace() -> None:
    raw = "¶ Fish &amp; loaves,\n\t&quot;five&quot;   &lt;two&gt; caf&#233;\u00a0 ¶"
    assert clean_osis(raw) == 'Fish & loaves, "five" <two> café'


def test_no_space_before_closing_punctuation_or_after_opening() -> None:
    raw = "dijo , y ; así : ¡ Oh Jehová ! ¿ quién es ? ( él ) ."
    assert clean_osis(raw) == "dijo, y; así: ¡Oh Jehová! ¿quién es? (él)."


def test_added_word_flush_against_words_is_separated() -> None:
    # RV1909 Genesis 2:12: <transChange> written flush on both sides used to glue three words.
    raw = (
        '<w lemma="strong:H8033">hay allí</w><transChange type="added">también</transChange>'
        '<w lemma="strong:H0916">bdelio</w>'
    )
    assert clean_osis(raw) == "hay allí también bdelio"
    # An added phrase wrapping words of its own (2 Chronicles 3:3).
    raw = (
        '<w>Estas</w><transChange type="added"><w>son las medidas</w> <w>de que</w>'
        "</transChange><w>Salomón</w>"
    )
    assert clean_osis(raw) == "Estas son las medidas de que Salomón"


def test_added_enclitic_pronoun_stays_on_its_verb() -> None:
    raw = '<w>guárda</w><transChange type="added">lo</transChange>, <w>díjo</w>'
    assert clean_osis(raw) == "guárdalo, díjo"
    raw = '<w>díjo</w><transChange type="added">le</transChange><w>Dios</w>:'
    assert clean_osis(raw) == "díjole Dios:"
    raw = 'preguntándo<transChange type="added">le</transChange>, y'
    assert clean_osis(raw) == "preguntándole, y"


def test_chapter_caps_fixed_only_at_chapter_start() -> None:
    assert clean_osis("EN el principio", chapter_start=True) == "En el principio"
    assert clean_osis("Y DESPUÉS movió", chapter_start=True) == "Y después movió"
    assert clean_osis('<w lemma="strong:H7225">EN el principio</w>', chapter_start=True) == (
        "En el principio"
    )
    assert clean_osis("EN el principio") == "EN el principio"
    assert clean_osis("Y DESPUÉS movió") == "Y DESPUÉS movió"


def test_chapter_caps_keeps_punctuation_and_handles_any_accent() -> None:
    assert fix_chapter_caps("¿QUIÉN ha creído") == "¿Quién ha creído"
    assert fix_chapter_caps("EMPERO, la serpiente") == "Empero, la serpiente"
    # Circumflex (RV1909 "EZECHÎAS") is a capital too, not only the acute accents.
    assert fix_chapter_caps("Y EZECHÎAS comenzó") == "Y ezechîas comenzó"


def test_chapter_caps_touches_only_the_leading_capitals() -> None:
    # A capitalised word after the opening is meant: the KJV's LORD at every chapter start.
    assert fix_chapter_caps("And the LORD said unto Moses") == "And the LORD said unto Moses"
    assert fix_chapter_caps("Y dijo DIOS") == "Y dijo DIOS"
    assert fix_chapter_caps("In the beginning") == "In the beginning"
    assert fix_chapter_caps("“I will bring one more") == "“I will bring one more"


def test_chapter_caps_restores_usual_case_of_proper_nouns() -> None:
    casing = {"jehová": "Jehová", "después": "después", "lord": "LORD"}
    assert fix_chapter_caps("Y JEHOVÁ dijo á Noé", casing) == "Y Jehová dijo á Noé"
    assert fix_chapter_caps("Y DESPUÉS movió", casing) == "Y después movió"
    assert fix_chapter_caps("LORD, how are they increased", casing) == (
        "LORD, how are they increased"
    )
    assert fix_chapter_caps("O LORD our Lord", casing) == "O LORD our Lord"


def test_usual_casing_ignores_sentence_openings() -> None:
    texts = [
        "Después de esto habló Jehová á Moisés.",
        "Y vino. Después fué, y después volvió: Entonces Jehová dijo",
        "Jehová es mi pastor",
    ]
    casing = usual_casing(texts)
    assert casing["jehová"] == "Jehová"
    # Both capitalised "Después" open a verse or a sentence; the free one is lower case.
    assert casing["después"] == "después"
    assert "entonces" not in casing  # only ever after ":", where RV1909 capitalises speech


# -- alignment ----------------------------------------------------------------------------------

NAMES = {"Gen": "Genesis", "John": "John", "1John": "I John", "Jonah": "Jonah"}


def test_align_keeps_only_keys_present_on_both_sides() -> None:
    src = {("Gen", 1, 1): "En el principio crió Dios", ("Tob", 1, 1): "Libro de las palabras"}
    tgt = {("Gen", 1, 1): "In the beginning God created", ("Sir", 1, 1): "All wisdom is"}
    pairs = align(src, tgt, {}, NAMES)
    assert [p.ref for p in pairs] == ["Genesis 1:1"]


def test_align_never_pairs_an_empty_side() -> None:
    src = {("Gen", 1, 1): "", ("Gen", 1, 2): "Y la tierra", ("Gen", 1, 3): "   "}
    tgt = {("Gen", 1, 1): "In the beginning", ("Gen", 1, 2): "", ("Gen", 1, 3): "God said"}
    assert align(src, tgt, {}, NAMES) == []


def test_align_length_filter() -> None:
    n = 10
    longest, shortest = math.floor(n * corpus.RATIO[1]), math.ceil(n * corpus.RATIO[0])
    src = {("Gen", 1, v): " ".join(["palabra"] * n) for v in range(1, 5)}
    src[("Gen", 1, 5)] = " ".join(["palabra"] * (corpus.MAX_WORDS + 1))
    src[("Gen", 1, 6)] = " ".join(["palabra"] * corpus.MAX_WORDS)
    words = {1: longest, 2: longest + 1, 3: shortest, 4: shortest - 1}
    words |= {5: corpus.MAX_WORDS + 1, 6: corpus.MAX_WORDS}
    tgt = {("Gen", 1, v): " ".join(["word"] * k) for v, k in words.items()}
    kept = [p.ref for p in align(src, tgt, {}, NAMES)]
    assert kept == ["Genesis 1:1", "Genesis 1:3", "Genesis 1:6"]


def test_align_matches_by_key_so_a_gap_does_not_shift_later_verses() -> None:
    src = {("Jonah", 1, 1): "uno a b", ("Jonah", 1, 3): "tres a b", ("Jonah", 1, 4): "cuatro a b"}
    tgt = {("Jonah", 1, v): f"{w} a b" for v, w in enumerate(["one", "two", "three", "four"], 1)}
    ref2 = {("Jonah", 1, 3): "kjv three a b"}
    pairs = {p.ref: p for p in align(src, tgt, ref2, NAMES)}
    assert list(pairs) == ["Jonah 1:1", "Jonah 1:3", "Jonah 1:4"]
    assert pairs["Jonah 1:3"] == Verse("Jonah 1:3", "tres a b", "three a b", "kjv three a b")
    assert pairs["Jonah 1:4"].tgt == "four a b"
    assert pairs["Jonah 1:1"].ref2 == ""  # no second reference for that key


def test_align_ref_uses_full_book_name() -> None:
    src = {("1John", 3, 16): "En esto", ("Odes", 1, 1): "Oda uno"}
    tgt = {("1John", 3, 16): "By this", ("Odes", 1, 1): "Ode one"}
    assert [p.ref for p in align(src, tgt, {}, NAMES)] == ["I John 3:16", "Odes 1:1"]
    assert corpus.book_of("I John 3:16") == "I John"


# -- split --------------------------------------------------------------------------------------


def _verses(books: dict[str, int]) -> list[Verse]:
    return [
        Verse(f"{book} 1:{v}", f"es {book} {v}", f"en {book} {v}", "")
        for book, n in books.items()
        for v in range(1, n + 1)
    ]


def test_split_holds_out_whole_books() -> None:
    verses = _verses({"Genesis": 5, "Ruth": 3, "John": 4, "I John": 2, "Song of Solomon": 2})
    splits = split_by_book(verses, valid_books=["Ruth"], test_books=["John"])
    books = {name: {corpus.book_of(v.ref) for v in rows} for name, rows in splits.items()}
    assert books == {
        "train": {"Genesis", "I John", "Song of Solomon"},
        "valid": {"Ruth"},
        "test": {"John"},
    }
    assert len(splits["valid"]) == 3 and len(splits["test"]) == 4
    assert sum(len(rows) for rows in splits.values()) == len(verses)


def test_split_refuses_a_book_in_both_valid_and_test() -> None:
    with pytest.raises(ValueError, match="John"):
        split_by_book(_verses({"John": 1}), valid_books=["Ruth", "John"], test_books=["John"])


def test_default_held_out_books_use_the_names_pysword_gives() -> None:
    # A misspelt name would silently leave that book in training.
    from pysword.canons import canons

    kjv = {book[0] for testament in canons["kjv"].values() for book in testament}
    assert set(corpus.VALID_BOOKS) <= kjv and set(corpus.TEST_BOOKS) <= kjv
    assert not set(corpus.VALID_BOOKS) & set(corpus.TEST_BOOKS)


def test_write_and_read_splits_round_trip(tmp_path: Path) -> None:
    splits = split_by_book(
        [*_verses({"Genesis": 2}), Verse("John 3:16", "¿Porque de tal manera?", "“For God”", "x")],
        valid_books=["Ruth"],
        test_books=["John"],
    )
    write_splits(splits, corpus_dir(tmp_path))
    for name in corpus.SPLITS:
        assert read_split(name, tmp_path) == splits[name]
    raw = (corpus_dir(tmp_path) / "test.jsonl").read_text(encoding="utf-8")
    assert "¿Porque" in raw  # stored as UTF-8, not \u escapes
    assert not list(corpus_dir(tmp_path).glob("*.tmp"))


def test_read_split_names_the_fetch_command_when_missing(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="specdecode data fetch bible-es-en"):
        read_split("train", tmp_path)


# -- pinned packages ----------------------------------------------------------------------------


def test_download_debs_refuses_a_deb_with_the_wrong_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"nothing should be downloaded: {args}")

    monkeypatch.setattr(subprocess, "run", no_download)
    pkg = corpus.SOURCE
    (tmp_path / pkg.filename).write_bytes(b"not the pinned package")
    with pytest.raises(CorpusError, match=pkg.filename.replace(".", r"\.")) as err:
        download_debs(tmp_path, [pkg])
    assert pkg.sha256 in str(err.value)


def test_download_debs_accepts_a_deb_matching_its_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("no download expected"))
    data = b"a tiny stand-in package"
    pkg = DebPackage("sword-text-x", "1.0-1", hashlib.sha256(data).hexdigest(), "X")
    (tmp_path / pkg.filename).write_bytes(data)
    assert download_debs(tmp_path, [pkg]) == [tmp_path / "sword-text-x_1.0-1_all.deb"]


# -- `specdecode data` --------------------------------------------------------------------------


def test_parser_accepts_data_fetch_of_a_known_corpus() -> None:
    args = build_parser().parse_args(["data", "fetch", "bible-es-en"])
    assert (args.name, args.cache_dir, args.force) == ("bible-es-en", None, False)
    assert args.func is data_cli.cmd_fetch
    args = build_parser().parse_args(
        ["data", "fetch", "bible-es-en", "--cache-dir", "d", "--force"]
    )
    assert (args.cache_dir, args.force) == ("d", True)


def test_parser_refuses_an_unknown_corpus(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["data", "fetch", "nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_data_fetch_prints_split_sizes_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = []

    def fake_fetch(cache_dir: str | None, *, force: bool = False) -> Path:
        calls.append((cache_dir, force))
        out = corpus_dir(cache_dir)
        write_splits(
            {"train": _verses({"Genesis": 3}), "valid": [], "test": _verses({"John": 1})}, out
        )
        return out

    monkeypatch.setitem(data_cli.CORPORA, corpus.CORPUS, fake_fetch)
    assert main(["data", "fetch", "bible-es-en", "--cache-dir", str(tmp_path), "--force"]) == 0
    assert calls == [(str(tmp_path), True)]
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["train: 3 pairs", "valid: 0 pairs", "test: 1 pairs", str(corpus_dir(tmp_path))]
