"""The `specdecode` command line: one console script, one subcommand family per module.

Each family registers itself through an `add_subcommands(subparsers)` function; this module only
gathers them and turns the errors a user can fix into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

# the module of each command: a command builds only its own family's parser, so that
# `specdecode generate` checks its arguments before anything imports torch
FAMILIES = {
    "generate": "generate",
    "models": "models",
    "bench": "bench",
    "head": "head",
    "data": "data",
    "seq2seq": "seq2seq",
    "translate": "seq2seq",
    "serve": "serve",
    "bench-serve": "bench_serve",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command`'s family, or of every family (help, a mistyped command)."""
    parser = argparse.ArgumentParser(
        prog="specdecode", description="Speculative decoding for Hugging Face models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    every = list(dict.fromkeys(FAMILIES.values()))
    for family in [FAMILIES[command]] if command in FAMILIES else every:
        import_module(f"specdecode.cli.{family}").add_subcommands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        print(f"specdecode {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
