"""What a server adds to a decoding step and to a prompt's prefill: the time per streamed token,
and to the first token, of our `--no-draft` server and of llama-server, beside the bare
`llama_decode` passes of the same weights in this process, once in 2 MiB pages (as our server
holds them) and once in llama.cpp's file mapping (4 KiB pages, as llama-server holds them).
All four take turns prompt by prompt in a shuffled order, so the machine's drift falls on each
alike; the first pass is a warm-up.

The prompts: MT-Bench questions 81-88 as one-turn chats and HumanEval 0-7 as completions, a
fresh tag in front of each text so none of it is reused, 64 tokens (ignore_eos), greedy. A server's
time per token is from its first token to the end of its stream over the 63 after it; its
first-token time is the client's, from sending to the first text (set beside a bare prefill
for the completions only: both servers keep a chat template's opening system turn cached, so a
chat's first token follows a prefill of the rest). The bare passes run a prompt
of the length the server reported (one pass, its last token's logits out), then 63 one-token
steps, on a context shaped as the server's (2,048 tokens a row, 8 rows, 2 threads). Server
minus bare pass is all a server spends outside `llama_decode`: per token the token's choice,
the round's bookkeeping, the hand-off, the event loop or HTTP threads taking a core; per
request the HTTP exchange, the tokenizer, the queue and the prefix cache's bookkeeping.

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


async def served(client: Client, text: str, chat: bool) -> tuple[float, float, int]:
    """Seconds to the first token, seconds per token after it, and the prompt's tokens, of one
    streamed chat or completion."""
    if chat:
        done = await client.chat([{"role": "user", "content": text}])
    else:
        done = await client.complete(text)
    if "error" in done:
        raise RuntimeError(f"{client.server.label}: {done['error']}")
    per_token = (done["e2e_s"] - done["ttft_s"]) / (done["completion_tokens"] - 1)
    return done["ttft_s"], per_token, done["prompt_tokens"]


def bare(
    model: LlamaCppModel, batch, prompt_tokens: int, steps: int = TOKENS - 1
) -> tuple[float, float]:
    """Seconds of the prefill `llama_decode` of `prompt_tokens` (random ids), and per one-token
    `llama_decode` of the `steps` after it."""
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(model.ctx), 0, -1, -1)
    for i in range(prompt_tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = random.randrange(1000, 20000), i, 1
        batch.seq_id[i][0], batch.logits[i] = 0, i == prompt_tokens - 1
    batch.n_tokens = prompt_tokens
    start = time.perf_counter()
    assert llama_cpp.llama_decode(model.ctx, batch) == 0
    prefilled = time.perf_counter()
    for step in range(steps):
        batch.token[0], batch.pos[0], batch.logits[0] = 1234, prompt_tokens + step, True
        batch.n_tokens = 1
        assert llama_cpp.llama_decode(model.ctx, batch) == 0
    return prefilled - start, (time.perf_counter() - prefilled) / steps


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
    prompts = [(p.text, True) for p in load_prompts("mtbench", limit=8)]
    prompts += [(p.text, False) for p in load_prompts("humaneval", limit=8)]
    lengths = [80] * len(prompts)  # the server's count, from the first pass on
    # (first token, per token after it) by variant and prompt kind
    seconds: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    http = httpx.AsyncClient(timeout=300)
    clients = {
        name: Client(http, Server(name, f"http://127.0.0.1:{port}"), MODEL, TOKENS, ignore_eos=True)
        for name, port in ((OURS, ours), (PEER, peer))
    }
    variants = [OURS, PEER, *models]
    random.seed(0)
    for repeat in range(passes + 1):
        for i, (text, chat) in enumerate(prompts):
            tagged = f"# {uuid.uuid4().hex[:8]}\n{text}"
            for name in random.sample(variants, len(variants)):
                if name in models:
                    value = bare(models[name], batch, lengths[i])
                else:
                    first, per_token, count = await served(clients[name], tagged, chat)
                    value = first, per_token
                    lengths[i] = count if name == OURS else lengths[i]
                if repeat:
                    seconds.setdefault((name, chat), []).append(value)
    await http.aclose()
    for chat, kind in ((True, "MT-Bench chats"), (False, "HumanEval completions")):
        mean = {
            name: [statistics.mean(v[part] for v in seconds[name, chat]) for part in (0, 1)]
            for name in variants
        }
        print(f"{kind}: {passes} passes x 8 prompts, {TOKENS} tokens, mean ms")
        print(f"  {'':24s} {'first token':>12s} {'a token after':>14s}")
        for name in variants:
            print(f"  {name:24s} {1e3 * mean[name][0]:12.1f} {1e3 * mean[name][1]:14.2f}")
        # a chat's template opens with the same system turn, which both servers keep cached:
        # its first token follows a prefill of the rest, so only completions match a bare one
        for part, what in ((1, "a token"), (0, "a first token"))[: 1 if chat else 2]:
            ours_adds = 1e3 * (mean[OURS][part] - mean[HUGE][part])
            peer_adds = 1e3 * (mean[PEER][part] - mean[SMALL][part])
            pages = 1e3 * (mean[SMALL][part] - mean[HUGE][part])
            print(
                f"  {what}: ours adds {ours_adds:.2f} ms to its pass, llama-server "
                f"{peer_adds:.2f}; 2 MiB pages save {pages:.2f} ms; ours over llama-server "
                f"{mean[PEER][part] / mean[OURS][part]:.3f}x"
            )


if __name__ == "__main__":
    asyncio.run(main())
