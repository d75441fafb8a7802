"""The `specdecode` console script: one parser, a module per command family, `common` below them."""

from specdecode.cli.main import main

__all__ = ["main"]
