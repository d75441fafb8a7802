"""Time to the first answer: `specdecode generate` of 16 tokens against llama-cpp-python doing
the same, each a fresh process on a warm cache (weights, tokenizer, prices and the 2 MiB pages
verdict already kept), interleaved A B A B after one untimed run of each, and the stages of
ours timed inside one process (import, tokenizer and context check, loading, prices, decoding).

    python benchmarks/studies/first-answer/first_answer.py --out benchmarks/results/first-answer
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "def f(x):"
TOKENS = 16

OURS = [sys.executable, "-m", "specdecode.cli", "generate", "--prompt", PROMPT,
        "--max-new-tokens", str(TOKENS)]  # fmt: skip

PEER = f"""
import llama_cpp
from specdecode.models.store import gguf_file
llm = llama_cpp.Llama(str(gguf_file("qwen2.5-coder-1.5b", progress=False)), n_ctx=4096,
                      n_threads=2, verbose=False)
print(llm({PROMPT!r}, max_tokens={TOKENS}, temperature=0.0)["choices"][0]["text"])
"""

STAGES = f"""
import json, time
t0 = time.perf_counter()
from specdecode.api import SpeculativeDecoder
t1 = time.perf_counter()
decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
t2 = time.perf_counter()
decoder.prices()
t3 = time.perf_counter()
out = decoder.generate({PROMPT!r}, max_new_tokens={TOKENS})
t4 = time.perf_counter()
loaded = decoder._draft is not None and not hasattr(decoder._draft, "load")
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1, prices_s=t3 - t2, decode_s=t4 - t3,
                      drafter_loaded=loaded, text=out.texts[0])))
"""


def wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    peer = [sys.executable, "-c", PEER]
    wall(OURS), wall(peer)  # warm: the page cache, the kept prices and verdicts
    ours_s, peer_s = [], []
    for _ in range(args.repeats):
        ours_s.append(wall(OURS))
        peer_s.append(wall(peer))
    stages = json.loads(
        subprocess.run([sys.executable, "-c", STAGES], check=True, capture_output=True,
                       text=True).stdout.strip().splitlines()[-1]
    )  # fmt: skip
    ratio = statistics.median(ours_s) / statistics.median(peer_s)
    record = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": sys.version},
        "prompt": PROMPT,
        "max_new_tokens": TOKENS,
        "ours_wall_s": ours_s,
        "llama_cpp_python_wall_s": peer_s,
        "ratio_median": ratio,
        "ours_stages": stages,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    s = stages
    table = (
        f"# Time to the first answer ({record['date']})\n\n"
        f"`specdecode generate --prompt {PROMPT!r} --max-new-tokens {TOKENS}` against "
        "llama-cpp-python generating the same, each a fresh process on a warm cache, "
        f"interleaved, {args.repeats} runs each.\n\n"
        "| | median wall s | runs |\n|---|---|---|\n"
        f"| specdecode generate | {statistics.median(ours_s):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in ours_s)} |\n"
        f"| llama-cpp-python | {statistics.median(peer_s):.2f} | "
        f"{', '.join(f'{x:.2f}' for x in peer_s)} |\n\n"
        f"Ratio {ratio:.2f}x. Ours by stage (one process): import {s['import_s']:.2f} s, "
        f"loading {s['load_s']:.2f} s, prices {s['prices_s']:.2f} s, decoding "
        f"{s['decode_s']:.2f} s; drafter model loaded: {s['drafter_loaded']}.\n"
    )
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
