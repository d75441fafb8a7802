"""The Bible parallel corpus (Reina-Valera 1909 -> World English Bible), from Debian packages.

No translation corpus ships in a PyPI package, but Debian carries public-domain Bibles as SWORD
modules, and any fresh machine reaches the Debian archive. The packages are fetched with
``apt-get download`` (no root needed once apt's lists exist), checked against pinned SHA-256
hashes, unpacked with ``dpkg-deb -x`` and read with ``pysword``.

What goes wrong when reading them naively, and what this module does about it:

- pysword decompresses a whole block again for every verse; the block is cached (minutes -> s).
- ``get_iter`` silently skips empty verses, shifting every later verse: verses are keyed by
  (book, chapter, verse) and read one index at a time.
- pysword's own cleaner glues words where a footnote is removed and drops canonical psalm titles:
  the markup is cleaned here (``clean_osis``).
- The two texts use different versifications (KJV and NRSVA): only keys present in both are kept,
  and a length filter drops pairs whose lengths disagree (most off-by-one verses).
- A random verse split flatters BLEU through parallel passages: whole books are held out.

Layout: ``<cache>/data/bible-es-en/{train,valid,test}.jsonl``, one object per verse with ``ref``,
``src`` (Spanish), ``tgt`` (WEB English) and ``ref2`` (KJV English, a second reference).
"""

from __future__ import annotations

import functools
import hashlib
import html
import itertools
import json
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from specdecode.models.packages import cache_root


@dataclass(frozen=True)
class DebPackage:
    """A Debian package pinned by version and by the SHA-256 of its .deb file."""

    name: str
    version: str
    sha256: str
    module: str  # the SWORD module key inside it

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_all.deb"


SOURCE = DebPackage(
    "sword-text-sparv",
    "2.60-1",
    "5c87f9b2bc97457e8a872f5bae7ea7ce59cb3de1dcee73e4d4740451863694cf",
    "spaRV1909eb",
)
TARGET = DebPackage(
    "sword-text-web",
    "426.0-1",
    "930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1",
    "engWEB2015eb",
)
SECOND_REFERENCE = DebPackage(
    "sword-text-kjv",
    "14.3-1",
    "9f463f28ce665f6f528fc723179722bced880a4c5485f7a41bf742838315de57",
    "engKJV2006eb",
)
PACKAGES = (SOURCE, TARGET, SECOND_REFERENCE)

# Whole books held out. John and Hebrews have few verbatim parallels elsewhere (unlike the
# synoptic Gospels or Kings/Chronicles), so test BLEU measures translation, not recall.
VALID_BOOKS = ("Ruth", "Jonah", "Nahum", "Galatians", "Titus", "Philemon")
TEST_BOOKS = ("John", "Hebrews")
MAX_WORDS = 120
RATIO = (0.5, 2.0)
CORPUS = "bible-es-en"
SPLITS = ("train", "valid", "test")


class CorpusError(RuntimeError):
    """The corpus could not be fetched, verified or read."""


@dataclass(frozen=True)
class Verse:
    ref: str  # "John 3:16"
    src: str
    tgt: str
    ref2: str


def corpus_dir(cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / "data" / CORPUS


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_debs(dest: Path, packages: Iterable[DebPackage] = PACKAGES) -> list[Path]:
    """``apt-get download`` each pinned package into ``dest`` and check its hash."""
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for pkg in packages:
        path = dest / pkg.filename
        if not path.exists():
            cmd = ["apt-get", "download", f"{pkg.name}={pkg.version}"]
            if shutil.which("apt-get") is None:
                raise CorpusError("apt-get is not available: the corpus comes from Debian packages")
            done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
            if done.returncode != 0 and "Unable to locate" in done.stderr:
                # A fresh container has no package lists yet.
                subprocess.run(["apt-get", "update"], capture_output=True, text=True)
                done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
            if done.returncode != 0 or not path.exists():
                raise CorpusError(
                    f"`{' '.join(cmd)}` failed (exit {done.returncode}): "
                    f"{done.stderr.strip()[-400:]}"
                )
        got = sha256(path)
        if got != pkg.sha256:
            raise CorpusError(
                f"{path.name} has SHA-256 {got}, expected {pkg.sha256}; delete it and fetch again"
            )
        paths.append(path)
    return paths


def unpack_debs(debs: Iterable[Path], dest: Path) -> Path:
    """Unpack the .deb files into ``dest``; return the SWORD library root inside it."""
    for deb in debs:
        cmd = ["dpkg-deb", "-x", str(deb), str(dest)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise CorpusError(f"dpkg-deb -x {deb.name} failed: {done.stderr.strip()[-400:]}")
    return dest / "usr" / "share" / "sword"


# -- markup -------------------------------------------------------------------------------------

_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.DOTALL)
_CANONICAL_TITLE = re.compile(r"<title\b[^>]*canonical=\"true\"[^>]*>(.*?)</title>", re.DOTALL)
_OTHER_TITLE = re.compile(r"<title\b[^>]*>.*?</title>", re.DOTALL)
_TAG = re.compile(r"<[^>]+>")
# RV1909 often writes a word added in translation flush against its neighbours
# ("hay allí</w><transChange>también</transChange><w>bdelio"): the tag boundary is the only word
# boundary there, so stripping the tags would glue three words. An added enclitic pronoun
# ("díjo</w><transChange>le</transChange>") belongs to the verb before it and stays glued.
_CLITIC = r"(?:me|te|se|nos|os|le|les|lo|los|la|las)"
_WORD_BEFORE_ADDED = re.compile(rf"</w>(?=<transChange\b[^>]*>(?!{_CLITIC}</transChange>))")
_ADDED_BEFORE_WORD = re.compile(r"</transChange>(?=<w\b)")
# Closing quotes are included: a note removed between a word and its quote leaves a space there.
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?)\]»”’])")
_SPACE_AFTER_OPEN = re.compile(r"([¡¿(\[«])\s+")
_EDGE = "¡¿,.;:!?\"'()“”‘’«»"
_SENTENCE_END = ".!?:"


def clean_osis(text: str, *, chapter_start: bool = False) -> str:
    """OSIS markup -> plain text, keeping canonical titles and the spaces around removed notes."""
    text = _WORD_BEFORE_ADDED.sub("</w> ", text)
    text = _ADDED_BEFORE_WORD.sub("</transChange> ", text)
    text = _NOTE.sub(" ", text)
    text = _CANONICAL_TITLE.sub(r" \1 ", text)
    text = _OTHER_TITLE.sub(" ", text)
    text = _TAG.sub("", text)
    text = html.unescape(text).replace("¶", " ")
    text = " ".join(text.split())
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    text = _SPACE_AFTER_OPEN.sub(r"\1", text)
    return fix_chapter_caps(text) if chapter_start else text


def fix_chapter_caps(text: str, casing: Mapping[str, str] | None = None) -> str:
    """The all-caps opening of a chapter ("EN el principio", "Y DESPUÉS movió") -> normal case.

    Only the leading run of capitals is touched (single letters such as "Y" continue it): a
    capitalised word later on is meant ("And the LORD said" in the KJV). A word in ``casing``
    (lower case -> usual written form, see ``usual_casing``) takes its usual form, so a proper
    noun keeps its capital ("Y JEHOVÁ dijo" -> "Y Jehová dijo"); others are lowered.
    """
    words = text.split(" ")
    for i, word in enumerate(words[:4]):
        core = word.strip(_EDGE)
        if len(core) == 1 and core.isupper():
            continue
        if len(core) < 2 or not (core.isalpha() and core.isupper()):
            break
        fixed = (casing or {}).get(core.lower(), core.lower())
        if i == 0:
            fixed = fixed[0].upper() + fixed[1:]
        words[i] = word.replace(core, fixed, 1)
    return " ".join(words)


def usual_casing(texts: Iterable[str]) -> dict[str, str]:
    """Lower-cased word -> its most frequent form where case is free (not opening a sentence)."""
    forms: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for text in texts:
        words = text.split()
        for before, word in itertools.pairwise(words):
            core = word.strip(_EDGE)
            if core and before[-1] not in _SENTENCE_END:
                forms[core.lower()][core] += 1
    return {word: counts.most_common(1)[0][0] for word, counts in forms.items()}


# -- reading ------------------------------------------------------------------------------------


def read_module(sword_dir: Path, module: str) -> dict[tuple[str, int, int], str]:
    """Every verse of a module, keyed by (OSIS book, chapter, verse); empty verses are dropped."""
    from pysword.modules import SwordModules

    modules = SwordModules(str(sword_dir))
    found = modules.parse_modules()
    if module not in found:
        raise CorpusError(
            f"SWORD module {module} not found under {sword_dir} (found {sorted(found)})"
        )
    bible = modules.get_bible_from_module(module)
    # pysword re-decompresses a whole block for every verse; verses are read in order, so a
    # small cache of decompressed blocks turns a minute per module into seconds.
    bible._decompressed_text = functools.lru_cache(maxsize=8)(bible._decompressed_text)
    structure = bible.get_structure()
    verses: dict[tuple[str, int, int], str] = {}
    chapter_starts = []
    for testament, books in structure.get_books().items():
        for book in books:
            for chapter, length in enumerate(book.chapter_lengths, start=1):
                indices = book.get_indicies(
                    chapters=[chapter], offset=structure._book_offset(book.name)
                )
                for verse, index in enumerate(indices, start=1):
                    raw = bible._text_for_index(testament, index)
                    if isinstance(raw, bytes):
                        raw = raw.decode("utf-8", "replace")
                    text = clean_osis(raw or "")
                    if text:
                        verses[(book.osis_name, chapter, verse)] = text
                        if verse == 1:
                            chapter_starts.append((book.osis_name, chapter, verse))
                assert len(indices) == length
    # Chapter openings are set in capitals; each word's usual case is learnt from the other verses.
    casing = usual_casing(text for key, text in verses.items() if key[2] != 1)
    for key in chapter_starts:
        verses[key] = fix_chapter_caps(verses[key], casing)
    return verses


def align(
    src: dict[tuple[str, int, int], str],
    tgt: dict[tuple[str, int, int], str],
    ref2: dict[tuple[str, int, int], str],
    book_names: dict[str, str],
) -> list[Verse]:
    """Pairs present in both texts and of plausible relative length (drops versification slips)."""
    pairs = []
    for key, s in src.items():
        t = tgt.get(key)
        if t is None:
            continue
        ns, nt = len(s.split()), len(t.split())
        if not ns or not nt:  # an empty side is no pair (and would divide by zero)
            continue
        if nt > MAX_WORDS or ns > MAX_WORDS or not RATIO[0] <= nt / ns <= RATIO[1]:
            continue
        book, chapter, verse = key
        ref = f"{book_names.get(book, book)} {chapter}:{verse}"
        pairs.append(Verse(ref, s, t, ref2.get(key, "")))
    return pairs


def book_of(ref: str) -> str:
    return ref.rsplit(" ", 1)[0]


def split_by_book(
    verses: Iterable[Verse],
    valid_books: Iterable[str] = VALID_BOOKS,
    test_books: Iterable[str] = TEST_BOOKS,
) -> dict[str, list[Verse]]:
    """Whole books go to validation or test, so no verse of a held-out book is seen in training."""
    valid, test = set(valid_books), set(test_books)
    if valid & test:
        raise ValueError(f"books in both validation and test: {sorted(valid & test)}")
    out: dict[str, list[Verse]] = {name: [] for name in SPLITS}
    for v in verses:
        book = book_of(v.ref)
        out["valid" if book in valid else "test" if book in test else "train"].append(v)
    return out


def write_splits(splits: dict[str, list[Verse]], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        tmp = directory / f"{name}.jsonl.tmp"
        with tmp.open("w", encoding="utf-8") as f:
            for v in rows:
                f.write(json.dumps(v.__dict__, ensure_ascii=False) + "\n")
        tmp.replace(directory / f"{name}.jsonl")


def read_split(name: str, cache_dir: str | Path | None = None) -> list[Verse]:
    path = corpus_dir(cache_dir) / f"{name}.jsonl"
    if not path.exists():
        raise CorpusError(f"{path} does not exist: run `specdecode data fetch {CORPUS}` first")
    return list(_read_jsonl(path))


def _read_jsonl(path: Path) -> Iterator[Verse]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield Verse(**json.loads(line))


def fetch_corpus(cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Download, verify, read, clean, align and split; idempotent."""
    out = corpus_dir(cache_dir)
    if not force and all((out / f"{s}.jsonl").exists() for s in SPLITS):
        return out
    debs = download_debs(out / "debs")
    sword = unpack_debs(debs, out / "unpacked")
    from pysword.modules import SwordModules

    bible = SwordModules(str(sword))
    bible.parse_modules()
    structure = bible.get_bible_from_module(SOURCE.module).get_structure()
    names = {b.osis_name: b.name for bs in structure.get_books().values() for b in bs}
    texts = [read_module(sword, pkg.module) for pkg in PACKAGES]
    write_splits(split_by_book(align(*texts, names)), out)
    return out
