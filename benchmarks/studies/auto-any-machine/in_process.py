"""Drafting `auto` as a user gets it (the decoder of `from_pretrained`: the standard library
corpus, the plan judged by measured outcomes) against drafting off, in one process on the
default pair (llama.cpp, 2 threads), `--passes` passes, every request run to 64 tokens (no end
id), rows joining as others end: HumanEval 0-7 and MT-Bench 81-88 at one, four and eight rows.

The two modes run turn about, round by round: two decoders of the same pair (the weights of
each settled in 2 MiB pages), one drafting auto and one plain, each loop stepping once in turn
until both are done. On a shared VM whose steps slow by a third for tens of seconds and recover
(measured on the 2-core EPYC), modes run a pass apart meet different machines; modes run a
round apart meet the same one. Each decoder is timed by its own clock, the wall clock less the
other decoder's rounds, so its judge, prices and rests see the machine as if it ran alone.
A mode's seconds are the sum of its rounds after its first; the first mover alternates by pass.
Both are given with and without the rounds that feed a prompt: those are the same work in both
modes (about a second each at one row) but run at different moments, since auto reaches each
next prompt sooner, so they carry the machine's wandering and nothing of drafting.
Prints each pass's seconds (and those outside llama.cpp's decode: the host's work around the
passes), the drafting figures, the judge's worth and corrections; then each cell's ratio over
off, pooled and per pass.

    python benchmarks/studies/auto-any-machine/in_process.py [--passes 2] [--cells ...]

`--busy SECONDS`: a second process starts that many seconds into every pass (both modes meet
it, turn about) and stops at its end (another process on the machine): spinning on one core,
or with `--busy-kind memory` copying 512 MiB arrays over and over (a competitor for memory
bandwidth, which slows a step that streams the weights more than it slows the extra tokens of
a pass). The judge's corrections and the changes its plain rounds show are printed as they
come.
"""

import argparse
import collections
import logging
import subprocess
import sys
import time

import specdecode.backends.llamacpp as llamacpp
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


now = {"mode": "off"}  # the mode whose round runs
decoding: dict[str, float] = collections.defaultdict(float)  # seconds inside llama_decode
decode = llamacpp.LlamaCppModel._decode


def timed_decode(self, count: int) -> None:
    start = time.perf_counter()
    decode(self, count)
    decoding[now["mode"]] += time.perf_counter() - start


llamacpp.LlamaCppModel._decode = timed_decode


class OwnClock:
    """The wall clock less the seconds the other decoder's rounds took."""

    def __init__(self) -> None:
        self.away = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.away


MODES = ("off", "auto")
decoders, clocks = {}, {}
for mode in MODES:
    decoders[mode] = SpeculativeDecoder.from_pretrained(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="llama.cpp", threads=2
    )
    decoders[mode].settle()  # the move to 2 MiB pages made now, as a server makes it
    clocks[mode] = decoders[mode].clock = OwnClock()
decoder = decoders["auto"]
sets = {"code": load_prompts("humaneval", limit=8), "chat": load_prompts("mtbench", limit=8)}
summary = []
for cell in args.cells:
    kind, rows = cell.split()[0], int(cell.split()[1])
    ids = [decoder.encode(p.text)[0] for p in sets[kind]]
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    decoding_only: dict[str, list[float]] = collections.defaultdict(list)
    outside: dict[str, float] = collections.defaultdict(float)
    for rep in range(args.passes):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        loops, rounds, spent = {}, dict.fromkeys(MODES, 0), dict.fromkeys(MODES, 0.0)
        host = dict.fromkeys(MODES, 0.0)  # seconds of its rounds outside llama.cpp's decode
        decoded = dict.fromkeys(MODES, 0.0)  # seconds of its rounds that feed no prompt
        for mode in order:
            kw = {"use_drafter": False} if mode == "off" else {"drafting": "auto"}
            loops[mode] = decoders[mode].loop(max_rows=rows, prefill_chunk=256, **kw)
            for p in ids:
                loops[mode].add(RowRequest(p, args.tokens, stop_token_ids=()))
        busy, began = None, time.perf_counter()
        for mode in order:  # each loop's first round (its first prompts' prefill): not timed
            now["mode"] = mode
            t = time.perf_counter()
            loops[mode].step()
            clocks["off" if mode == "auto" else "auto"].away += time.perf_counter() - t
        while any(len(loop) for loop in loops.values()):
            if args.busy is not None and busy is None and time.perf_counter() - began > args.busy:
                busy = subprocess.Popen([sys.executable, "-c", BUSY[args.busy_kind]])
                print(f"  a busy process starts after {rounds['auto']} rounds", flush=True)
            for mode in order:
                if not len(loops[mode]):
                    continue
                now["mode"] = mode
                inside = decoding[mode]
                loop = loops[mode]
                t = time.perf_counter()
                loop.step()
                took = time.perf_counter() - t
                spent[mode] += took
                if loop.decoding:  # the round fed no prompt
                    decoded[mode] += took
                host[mode] += took - (decoding[mode] - inside)
                rounds[mode] += 1
                clocks["off" if mode == "auto" else "auto"].away += took
        if busy is not None:
            busy.kill()
        judge = decoder.outcomes
        worth = judge.snapshot() if judge is not None else {}
        for mode in MODES:
            seconds[mode].append(spent[mode])
            decoding_only[mode].append(decoded[mode])
            outside[mode] += host[mode]
            figures = loops[mode].stats.summary().split(";")[3].strip()
            print(
                f"{cell} | {rep} {mode}: {spent[mode]:.2f} s ({decoded[mode]:.2f} s in rounds "
                f"that feed no prompt, {host[mode]:.2f} s outside llama.cpp's decode), "
                f"{rounds[mode]} rounds, {figures}"
                + (
                    f"; worth { ({r: round(v, 2) for r, v in worth.items()}) }"
                    if mode == "auto"
                    else ""
                ),
                flush=True,
            )
    parts = []
    for name, measured in (("all rounds", seconds), ("rounds that feed no prompt", decoding_only)):
        ratios = [o / a for o, a in zip(measured["off"], measured["auto"], strict=True)]
        pooled = sum(measured["off"]) / sum(measured["auto"])
        parts.append(
            f"{name} {pooled:.3f}x (passes {', '.join(f'{r:.3f}' for r in ratios)}; seconds "
            f"off {sum(measured['off']):.1f}, auto {sum(measured['auto']):.1f})"
        )
    line = (
        f"{cell}: auto over off, {'; '.join(parts)}; outside llama.cpp's decode off "
        f"{outside['off']:.2f} s, auto {outside['auto']:.2f} s"
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
