"""`specdecode data fetch CORPUS`: download and prepare a translation corpus into the cache.

    specdecode data fetch bible-es-en              # ~/.cache/specdecode/data/bible-es-en/
    specdecode data fetch bible-es-en --force      # rebuild after a change to the cleaning

Training reads the splits with `corpus.read_split`, which only points at this command when they
are missing; fetching is a separate step so that a training run never reaches the network.
Failures raise `CorpusError` (a RuntimeError), which the main CLI turns into one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from specdecode.seq2seq import corpus

# Corpus name -> builder(cache_dir, force=...) returning the directory of its splits. Argparse
# refuses any other name, so a typo fails before anything is downloaded.
CORPORA: dict[str, Callable[..., Path]] = {corpus.CORPUS: corpus.fetch_corpus}


def count_lines(path: Path) -> int:
    """Rows of a jsonl split (one verse per line)."""
    with path.open("rb") as f:
        return sum(1 for _ in f)


def cmd_fetch(args: argparse.Namespace) -> int:
    """Build (or find already built) the corpus; print each split's size, then the directory."""
    out = CORPORA[args.name](args.cache_dir, force=args.force)
    for split in corpus.SPLITS:
        path = out / f"{split}.jsonl"
        print(f"{split}: {count_lines(path)} pairs")
    print(out)
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``data fetch NAME [--cache-dir DIR] [--force]``."""
    data = subparsers.add_parser("data", help="fetch and prepare translation corpora")
    jobs = data.add_subparsers(dest="data_command", required=True)
    fetch = jobs.add_parser(
        "fetch", help="download, verify, clean, align and split a corpus into the cache"
    )
    fetch.add_argument("name", choices=list(CORPORA), help="the corpus to prepare")
    fetch.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $SPECDECODE_CACHE or ~/.cache/specdecode)",
    )
    fetch.add_argument(
        "--force", action="store_true", help="rebuild even if the splits already exist"
    )
    fetch.set_defaults(func=cmd_fetch)
