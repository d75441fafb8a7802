"""`specdecode bench-serve`: the serving load driver (`bench.serving`) on running servers."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specdecode.bench.serving import (
        ServeBenchConfig,
        Server,
        run_serving_bench,
        serving_table,
        write_serving_report,
    )

    servers = [
        replace(Server.parse(spec), model=args.model)
        for spec in (args.label or []) + (args.url or [])
    ]
    cfg = ServeBenchConfig(
        servers=tuple(servers),
        prompts=args.prompts,
        limit=args.limit,
        skip=args.skip,
        concurrency=tuple(args.concurrency),
        max_tokens=args.max_tokens,
        modes=tuple(args.modes),
        turns=args.turns,
        repeats=args.repeats,
        api_key=args.api_key,
        timeout_s=args.timeout,
        ignore_eos=args.ignore_eos,
        waves=args.waves,
    )
    record = run_serving_bench(cfg, log=(lambda line: None) if args.quiet else None)
    out = Path(args.out)
    write_serving_report(record, out, plots=not args.no_plots)
    print(serving_table(record))
    print(f"record written to {out}/record.json")
    if not record["ok"]:
        print("FAILED: some requests were refused or broke off (see 'error' in the record)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-serve",
        help="drive OpenAI-compatible servers (ours, llama-server, llama-cpp-python) at "
        "fixed concurrency and compare them",
    )
    p.add_argument(
        "--url",
        action="append",
        metavar="URL",
        help="a server's root, http://HOST:PORT (repeat for several; labelled HOST:PORT)",
    )
    p.add_argument(
        "--label",
        action="append",
        metavar="NAME=URL",
        help="a server with its label in the table, e.g. ours=http://127.0.0.1:8080 (repeatable)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the model id sent (default: each server's first id in /v1/models)",
    )
    p.add_argument("--prompts", default="humaneval", help="humaneval, mtbench, or a file")
    p.add_argument("--limit", type=int, default=16, help="first N prompts (after --skip)")
    p.add_argument("--skip", type=int, default=0, help="drop the set's first N prompts")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16],
        help="requests in flight at once, one pass per level",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["new", "seen", "chat"],
        help="new: each prompt behind a fresh tag (no cache helps); seen: prompts sent once "
        "to warm, then measured (prefix reuse); chat: conversations, each turn extending the last",
    )
    p.add_argument("--turns", type=int, default=3, help="requests per conversation in chat")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes of each server per mode and level, interleaved A B A B",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask every server to run each request to --max-tokens (vLLM's extension, honoured "
        "by llama-server and ours): the same work on every server, whatever greedy text each "
        "serves",
    )
    p.add_argument(
        "--waves",
        action="store_true",
        help="cut each pass into waves of --concurrency prompts, the servers taking turns wave "
        "by wave: on a shared machine whose speed wanders over tens of seconds, every server "
        "meets the same stretches",
    )
    p.add_argument("--api-key", default=None, help="sent as a Bearer token to every server")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for the server's next bytes",
    )
    p.add_argument("--out", default="runs/bench-serve", help="folder for record, table and plot")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no line per pass on stderr")
    p.set_defaults(func=cmd_bench_serve)
