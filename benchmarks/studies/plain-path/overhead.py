"""What a server adds to a decoding step: the time per streamed token of our `--no-draft` server
and of llama-server, beside the bare `llama_decode` step of the same weights in this process,
once in 2 MiB pages (as our server holds them) and once in llama.cpp's file mapping (4 KiB
pages, as llama-server holds them). All four take turns prompt by prompt in a shuffled order,
so the machine's drift falls on each alike; the first pass is a warm-up.

Each prompt is an MT-Bench question (81-88, a fresh tag in front so no prefix is reused) as a
one-turn chat, 64 tokens (ignore_eos), greedy; a server's time per token is from its first
token to the end of its stream over the 63 after it. The bare step runs a prompt of the length
the server reported, then 63 one-token steps, on a context shaped as the server's (2,048
tokens a row, 8 rows, 2 threads). Server minus bare step is all a server spends per token
outside the step: the token's choice, the round's bookkeeping, the hand-off, the event loop
or HTTP threads taking a core.

    python benchmarks/studies/plain-path/overhead.py OURS_PORT LLAMA_SERVER_PORT [PASSES]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid

import httpx
import llama_cpp

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.bench.serving import Client, Server
from specdecode.models.store import gguf_file
from specdecode.prompts import load_prompts

TOKENS = 64
MODEL = "qwen2.5-coder-1.5b"
OURS, PEER = "ours --no-draft", "llama-server"
HUGE, SMALL = "bare step, 2 MiB pages", "bare step, 4 KiB pages"


async def served(client: Client, text: str) -> tuple[float, int]:
    """Seconds per token after the first, and the prompt's tokens, of one streamed chat."""
    done = await client.chat([{"role": "user", "content": text}])
    if "error" in done:
        raise RuntimeError(f"{client.server.label}: {done['error']}")
    return (done["e2e_s"] - done["ttft_s"]) / (done["completion_tokens"] - 1), done["prompt_tokens"]


def bare(model: LlamaCppModel, batch, prompt_tokens: int) -> float:
    """Seconds per one-token `llama_decode` after a prompt of `prompt_tokens` (random ids)."""
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(model.ctx), 0, -1, -1)
    for i in range(prompt_tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = random.randrange(1000, 20000), i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, i == prompt_tokens - 1
    batch.n_tokens = prompt_tokens
    assert llama_cpp.llama_decode(model.ctx, batch) == 0
    start = time.perf_counter()
    for step in range(TOKENS - 1):
        batch.token[0], batch.pos[0], batch.logits[0] = 1234, prompt_tokens + step, True
        batch.n_tokens = 1
        assert llama_cpp.llama_decode(model.ctx, batch) == 0
    return (time.perf_counter() - start) / (TOKENS - 1)


async def main() -> None:
    ours, peer = sys.argv[1], sys.argv[2]
    passes = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    path = gguf_file("qwen2.5-coder-1.5b", progress=False)
    shape = {"context": 2048, "threads": 2, "max_rows": 8}
    models = {
        HUGE: LlamaCppModel(path, role="2m", huge_pages=True, **shape),
        SMALL: LlamaCppModel(path, role="4k", huge_pages=False, **shape),
    }
    models[HUGE].settle()
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    prompts = [p.text for p in load_prompts("mtbench", limit=8)]
    lengths = [80] * len(prompts)  # the server's count, from the first pass on
    seconds: dict[str, list[float]] = {name: [] for name in (OURS, PEER, *models)}
    http = httpx.AsyncClient(timeout=300)
    clients = {
        name: Client(http, Server(name, f"http://127.0.0.1:{port}"), MODEL, TOKENS, ignore_eos=True)
        for name, port in ((OURS, ours), (PEER, peer))
    }
    random.seed(0)
    for repeat in range(passes + 1):
        for i, text in enumerate(prompts):
            tagged = f"# {uuid.uuid4().hex[:8]}\n{text}"
            for name in random.sample(list(seconds), len(seconds)):
                if name in models:
                    value = bare(models[name], batch, lengths[i])
                else:
                    value, count = await served(clients[name], tagged)
                    lengths[i] = count if name == OURS else lengths[i]
                if repeat:
                    seconds[name].append(value)
    await http.aclose()
    print(f"{passes} passes x {len(prompts)} prompts, {TOKENS} tokens; ms a token, mean [median]")
    for name, values in seconds.items():
        mean, median = statistics.mean(values), statistics.median(values)
        print(f"  {name:24s} {1e3 * mean:6.2f} [{1e3 * median:6.2f}]")
    mean = {name: statistics.mean(values) for name, values in seconds.items()}
    print(f"ours - bare step (2 MiB): {1e3 * (mean[OURS] - mean[HUGE]):.2f} ms")
    print(f"llama-server - bare step (4 KiB): {1e3 * (mean[PEER] - mean[SMALL]):.2f} ms")
    print(f"2 MiB pages save {1e3 * (mean[SMALL] - mean[HUGE]):.2f} ms a step")
    print(f"ours over llama-server, tokens/s after the first: {mean[PEER] / mean[OURS]:.3f}x")


if __name__ == "__main__":
    asyncio.run(main())
