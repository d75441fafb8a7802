"""Where a round of 8 decoding rows goes on llama.cpp, in process: 8 HumanEval prompts, one
prefill round, 5 warm rounds, then 40 rounds under cProfile (no end token ends a row).

    python benchmarks/studies/round-profile/round_profile.py auto   # drafting auto
    python benchmarks/studies/round-profile/round_profile.py off    # no drafter
"""

import cProfile
import io
import pstats
import sys
import time

from specdecode import SpeculativeDecoder
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

drafting = sys.argv[1] if len(sys.argv) > 1 else "auto"
dec = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", backend="llama.cpp", threads=2)
prompts = [dec.encode(p.text)[0] for p in load_prompts("humaneval", limit=8)]
kw = {"use_drafter": False} if drafting == "off" else {"drafting": drafting}
loop = dec.loop(max_rows=8, prefill_chunk=256, **kw)
for p in prompts:
    loop.add(RowRequest(p, 200, stop_token_ids=()))
loop.step()  # prefill
for _ in range(5):
    loop.step()
pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
for _ in range(40):
    loop.step()
pr.disable()
wall = time.perf_counter() - t
s = io.StringIO()
st = pstats.Stats(pr, stream=s).sort_stats("tottime")
st.print_stats(14)
print(drafting, "wall per round ms", 1000 * wall / 40)
print(s.getvalue()[:4000])
