"""What drafting `auto` costs where it drafts nothing, split into its search and the rest: in
one process on the default pair (llama.cpp, 2 threads), interleaved, `--passes` passes each,
every request run to 64 tokens (no end id), rows joining as others end:

* `off`: drafting off;
* `auto`: drafting auto as a user gets it;
* `resting`: drafting auto whose search rests every round (`MixedDrafter.rests` answers yes,
  so every round runs plain on the host with the drafter told, as a resting round does).

Prints each run's decoding seconds, then per mode the total, and the seconds inside the target's
one-token passes (`step_logits`: llama.cpp's own decode) against those outside them.

    python benchmarks/studies/auto-any-machine/search_cost.py [--cell "chat 1"] [--passes 3]
"""

import argparse
import collections
import statistics
import time

import specdecode.backends.llamacpp as llamacpp
from specdecode import SpeculativeDecoder
from specdecode.core.drafting.mixed import MixedDrafter
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--cell", default="chat 1")
parser.add_argument("--passes", type=int, default=3)
args = parser.parse_args()
kind, rows = args.cell.split()[0], int(args.cell.split()[1])

mode = {"now": "off"}
inside: dict[str, list[float]] = collections.defaultdict(list)
step_logits = llamacpp.LlamaCppModel.step_logits


def timed_step_logits(self, tokens):
    start = time.perf_counter()
    logits = step_logits(self, tokens)
    inside[mode["now"]].append(time.perf_counter() - start)
    return logits


rests = MixedDrafter.rests


def always_resting(self) -> bool:
    if mode["now"] != "resting":
        return rests(self)
    self.rest.begin()
    self.round = None
    return True


llamacpp.LlamaCppModel.step_logits = timed_step_logits
MixedDrafter.rests = always_resting
decoder = SpeculativeDecoder.from_pretrained(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", backend="llama.cpp", threads=2
)
decoder.settle()
prompts = load_prompts({"code": "humaneval", "chat": "mtbench"}[kind], limit=8)
ids = [decoder.encode(p.text)[0] for p in prompts]
seconds: dict[str, list[float]] = collections.defaultdict(list)
modes = ["off", "auto", "resting"]
for rep in range(args.passes):
    for name in modes if rep % 2 == 0 else modes[::-1]:
        mode["now"] = name
        kw = {"use_drafter": False} if name == "off" else {"drafting": "auto"}
        loop = decoder.loop(max_rows=rows, prefill_chunk=256, **kw)
        for p in ids:
            loop.add(RowRequest(p, 64, stop_token_ids=()))
        loop.step()
        start = time.perf_counter()
        while len(loop):
            loop.step()
        seconds[name].append(time.perf_counter() - start)
        print(f"{args.cell} | {rep} {name}: {seconds[name][-1]:.2f} s", flush=True)
for name in modes:
    total, passes = sum(seconds[name]), sum(inside[name])
    print(
        f"{name}: {total:.2f} s, over off {sum(seconds['off']) / total:.3f}x; in one-token "
        f"passes {passes:.2f} s (median {1e3 * statistics.median(inside[name]):.2f} ms), "
        f"outside them {total - passes:.2f} s"
    )
