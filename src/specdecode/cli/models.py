"""`specdecode models`: fetch, list, verify and remove the real models in the cache.

    specdecode models list                            # each known model: state, size, where
    specdecode models fetch qwen2.5-coder-1.5b        # GGUF + fp32 copy for the torch backend
    specdecode models fetch qwen2.5-coder-1.5b --gguf-only   # the GGUF alone (llama.cpp)
    specdecode models fetch smollm2-135m --force      # delete and make again (a damaged copy)
    specdecode models verify [NAME]                   # hash every cached file in full
    specdecode models remove NAME                     # free the space

The work is done in `specdecode.models.store`; errors a user can act on (disk space, pip, a
damaged file) are ValueError / OSError / RuntimeError subclasses, which `cli.main` prints as one
line with exit status 2. `verify` exits 1 when it finds a damaged or partial model, so that a
script can tell "the cache is bad" from "the command was wrong".
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from specdecode.models import store
from specdecode.models.packages import cache_root

CACHE_HELP = "cache root (default: $SPECDECODE_CACHE or ~/.cache/specdecode)"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**7 else f"{n / 1e6:.2f} MB" if n else "-"


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch (and unless --gguf-only, convert) a model; print the path to use."""
    progress = not args.quiet
    if args.gguf_only:
        path = store.gguf_file(args.name, args.cache_dir, progress, force=args.force)
    else:
        path = store.fetch_model(args.name, args.cache_dir, progress, force=args.force)
    print(path)
    return 0


def _describe(state: store.ModelState) -> list[str]:
    """Indented lines under a model's row: what is wrong and what to do."""
    lines = [f"    {p.path}: {p.detail}" for p in state.problems]
    lines += [f"    {p}: left by an interrupted fetch or conversion" for p in state.leftovers]
    if state.note:
        lines.append(f"    {state.note}")
    if state.state == "damaged":
        lines.append(f"    fix: specdecode models fetch {state.name} --force")
    elif state.state == "partial":
        lines.append(
            f"    the next use re-creates what it needs; or: specdecode models fetch "
            f"{state.name} --force"
        )
    return lines


def cmd_list(args: argparse.Namespace) -> int:
    """Every catalogue model: role, state (checked as a load checks it), size on disk."""
    print(f"cache: {cache_root(args.cache_dir)}")
    rows = [("name", "role", "state", "cached", "on disk", "GGUF", "fp32", "path")]
    notes: dict[str, list[str]] = {}
    for spec in store.MODELS.values():
        state = store.inspect_model(spec.name, args.cache_dir)
        rows.append(
            (
                spec.name,
                spec.role,
                state.state,
                "+".join(state.artefacts) or "-",
                _size(state.bytes),
                _gb(spec.gguf_bytes),
                _gb(spec.fp32_bytes),
                str(state.path) if state.state != "not cached" else "",
            )
        )
        notes[spec.name] = _describe(state)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        for line in notes.get(row[0], []):
            print(line)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Hash every cached file of one model (or all) in full; exit 1 if any is bad."""
    names = [args.name] if args.name else list(store.MODELS)
    bad = 0
    for name in names:
        state = store.inspect_model(
            name, args.cache_dir, full=True, wait=True, progress=not args.quiet
        )
        if state.state == "not cached":
            print(f"{name}: not cached")
            bad += args.name is not None
            continue
        what = "+".join(state.artefacts) or "nothing usable"
        print(f"{name}: {state.state} ({what}; {state.hashed} file(s) hashed; {state.path})")
        for line in _describe(state):
            print(line)
        bad += state.state != "ok"
    return 1 if bad else 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Delete everything cached for a model; say how much was freed."""
    freed = store.remove_model(args.name, args.cache_dir)
    print(f"{args.name}: removed, {_size(freed)} freed" if freed else f"{args.name}: not cached")
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``models fetch|list|verify|remove``.

    Every parser sets ``func`` (``callable(args) -> int``, the exit status) via ``set_defaults``.
    The model names are read from the catalogue when the parser is built.
    """
    names = list(store.MODELS)
    known = f"one of: {', '.join(names)}"
    models = subparsers.add_parser(
        "models", help="fetch, list, verify and remove the known real models"
    )
    models.set_defaults(func=_help_of(models))
    sub = models.add_subparsers(dest="models_command", metavar="{fetch,list,verify,remove}")

    fetch = sub.add_parser(
        "fetch", help="download, verify and convert a known model into the cache"
    )
    fetch.add_argument("name", choices=names, metavar="NAME", help=known)
    fetch.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    fetch.add_argument(
        "--force",
        action="store_true",
        help="delete everything cached for the model first, then fetch it again",
    )
    fetch.add_argument(
        "--gguf-only",
        action="store_true",
        help="join and verify the GGUF without converting it to fp32 safetensors (what the "
        "llama.cpp backend runs; the torch backend converts on first use)",
    )
    fetch.set_defaults(func=cmd_fetch)

    listing = sub.add_parser("list", help="known models, their state and size in the cache")
    listing.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    listing.set_defaults(func=cmd_list)

    verify = sub.add_parser(
        "verify", help="hash every cached file in full against its record (exit 1 if bad)"
    )
    verify.add_argument("name", nargs="?", choices=names, metavar="NAME", help=known)
    verify.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    verify.add_argument("--quiet", action="store_true", help="no progress bars")
    verify.set_defaults(func=cmd_verify)

    remove = sub.add_parser("remove", help="delete a model's cached files")
    remove.add_argument("name", choices=names, metavar="NAME", help=known)
    remove.add_argument("--cache-dir", default=None, help=CACHE_HELP)
    remove.set_defaults(func=cmd_remove)


def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show_help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return show_help
