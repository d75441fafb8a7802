"""The `specdecode` command line: one console script, one subcommand family per module.

Each family registers itself through an `add_subcommands(subparsers)` function; this module only
gathers them and turns the errors a user can fix into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from specdecode.cli import bench as bench_cli
    from specdecode.cli import bench_serve as bench_serve_cli
    from specdecode.cli import data as data_cli
    from specdecode.cli import generate as generate_cli
    from specdecode.cli import head as head_cli
    from specdecode.cli import models as models_cli
    from specdecode.cli import seq2seq as seq2seq_cli
    from specdecode.cli import serve as serve_cli

    parser = argparse.ArgumentParser(
        prog="specdecode", description="Speculative decoding for Hugging Face models."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate_cli.add_subcommands(subparsers)
    models_cli.add_subcommands(subparsers)
    bench_cli.add_subcommands(subparsers)
    bench_serve_cli.add_subcommands(subparsers)
    head_cli.add_subcommands(subparsers)
    data_cli.add_subcommands(subparsers)
    seq2seq_cli.add_subcommands(subparsers)
    serve_cli.add_subcommands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as error:
        print(f"specdecode {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
