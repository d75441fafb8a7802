"""Drafting `auto` as a user gets it (the decoder of `from_pretrained`: the standard library
corpus, the plan judged by measured outcomes) against drafting off, in one process on the
default pair (llama.cpp, 2 threads), interleaved, `--passes` passes each, every request run to
64 tokens (no end id), rows joining as others end: HumanEval 0-7 and MT-Bench 81-88 at one,
four and eight rows. Prints decoding seconds (after each run's first round), the drafting
figures, the judge's worth and corrections; then each cell's ratio over off, with the spread of
the passes.

    python benchmarks/studies/auto-any-machine/in_process.py [--passes 2] [--cells ...]

`--busy SECONDS`: a second process starts that many seconds into every run (auto and off
alike, so both meet the same machine) and stops at its end (another process on the machine):
spinning on one core, or with `--busy-kind memory` copying 512 MiB arrays over and over (a
competitor for memory bandwidth, which slows a step that streams the weights more than it
slows the extra tokens of a pass). The judge's corrections and the changes its plain rounds
show are printed as they come.
"""

import argparse
import collections
import logging
import subprocess
import sys
import time

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--passes", type=int, default=2)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument(
    "--cells", nargs="+", default=["code 1", "code 4", "code 8", "chat 1", "chat 4", "chat 8"]
)
parser.add_argument("--busy", type=float, default=None)
parser.add_argument("--busy-kind", choices=("core", "memory"), default="core")
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s", stream=sys.stdout)

BUSY = {
    "core": "while True: pass",
    "memory": "import numpy as np\na = np.ones(1 << 26)\nb = np.empty_like(a)\n"
    "while True: np.copyto(b, a)",
}
decoder = SpeculativeDecoder.from_pretrained(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="llama.cpp", threads=2
)
decoder.settle()  # the move to 2 MiB pages made now, as a server makes it: no cell meets it
sets = {"code": load_prompts("humaneval", limit=8), "chat": load_prompts("mtbench", limit=8)}
summary = []
for cell in args.cells:
    kind, rows = cell.split()[0], int(cell.split()[1])
    ids = [decoder.encode(p.text)[0] for p in sets[kind]]
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(args.passes):
        for mode in ("off", "auto") if rep % 2 == 0 else ("auto", "off"):
            kw = {"use_drafter": False} if mode == "off" else {"drafting": "auto"}
            loop = decoder.loop(max_rows=rows, prefill_chunk=256, **kw)
            for p in ids:
                loop.add(RowRequest(p, args.tokens, stop_token_ids=()))
            loop.step()
            busy = None
            start, rounds = time.perf_counter(), 0
            while len(loop):
                due = args.busy is not None
                if due and busy is None and time.perf_counter() - start > args.busy:
                    busy = subprocess.Popen([sys.executable, "-c", BUSY[args.busy_kind]])
                    print(f"  a busy process starts after {rounds} rounds", flush=True)
                loop.step()
                rounds += 1
            if busy is not None:
                busy.kill()
            wall = time.perf_counter() - start
            seconds[mode].append(wall)
            figures = loop.stats.summary().split(";")[3].strip()
            judge = decoder.outcomes
            worth = judge.snapshot() if judge is not None else {}
            print(
                f"{cell} | {rep} {mode}: {wall:.2f} s, {rounds} rounds, {figures}"
                + (
                    f"; worth { ({r: round(v, 2) for r, v in worth.items()}) }"
                    if mode == "auto"
                    else ""
                ),
                flush=True,
            )
    ratios = [o / a for o, a in zip(seconds["off"], seconds["auto"], strict=True)]
    pooled = sum(seconds["off"]) / sum(seconds["auto"])
    line = (
        f"{cell}: auto over off {pooled:.3f}x (passes {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"seconds off {sum(seconds['off']):.1f}, auto {sum(seconds['auto']):.1f}"
    )
    summary.append(line)
    print(line, flush=True)
judge = decoder.outcomes
print(
    "corrections:", [(c.rows, c.round, round(c.old, 3), round(c.new, 3)) for c in judge.corrections]
)
print("machine changes:", [(s.rows, s.round, round(s.ratio, 2)) for s in judge.shifts])
print("explored rounds:", judge.explored)
print("\n".join(summary))
