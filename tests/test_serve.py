"""The server over a fake engine loop (tests/serve_fake.py): routes, OpenAI shapes, streaming,
stop strings, metrics, faults, queueing, cancellation and the SIGTERM drain, in seconds.

The same behaviour against real models is tests/test_serve_live.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from serve_fake import EOS, MODEL, ByteTokenizer, FakeDecoder, Live, expected_text, free_port  # noqa: E402

from specdecode.serve.app import warm_tokenizer  # noqa: E402
from specdecode.serve.protocol import parse_completion  # noqa: E402
from specdecode.serve.server import ServeConfig, loopback, ready_after, serve  # noqa: E402
from specdecode.serve.text import RowText, longest_partial_stop  # noqa: E402


@pytest.fixture(scope="module")
def live():
    with Live() as server:
        yield server


# ------------------------------------------------------------------ text: pure


def test_multibyte_text_is_never_shown_broken():
    text = "añb€c😀d"
    ids = list(text.encode())
    row = RowText(ByteTokenizer())
    pieces = [row.feed([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + row.feed([], final=True) == text


def test_stop_string_across_feeds_is_cut_and_held_back():
    row = RowText(ByteTokenizer(), stops=("STOP", "xyz"))
    shown = [row.feed(list(b"abcST")), row.feed(list(b"O")), row.feed(list(b"Pdef"))]
    assert shown == ["abc", "", ""]  # "ST", "STO" could begin STOP: held back
    assert row.stopped and row.emitted == "abc"
    assert row.tokens_used == len(b"abcSTOP")  # the stop string's last token, not the round's


def test_partial_stop_is_released_when_it_does_not_match():
    row = RowText(ByteTokenizer(), stops=("STOP",))
    assert row.feed(list(b"aST")) == "a"
    assert row.feed(list(b"Ob")) == "STOb"
    assert not row.stopped
    assert longest_partial_stop("xxSTO", ("STOP", "OPQ")) == 3


def test_end_id_is_not_text_and_counts_as_a_token():
    row = RowText(ByteTokenizer(), stop_ids=(EOS,))
    assert row.feed([*b"hi", EOS], final=True) == "hi"
    assert row.tokens_used == 3


# ------------------------------------------------------------------ routes


def test_health_models_and_shapes(live):
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    out = live.client().completions.create(
        model=MODEL, prompt="abcdef", max_tokens=10, temperature=0
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    text, reason = expected_text("abcdef", 10)
    assert out.choices[0].text == text and out.choices[0].finish_reason == reason == "length"
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 10
    assert out.usage.total_tokens == 16
    spec = out.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_spec_steps"]
    )


def test_end_id_finishes_with_stop(live):
    out = live.client().completions.create(model=MODEL, prompt="ab#", max_tokens=50)
    assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 3  # the end id counts


def test_ignore_eos_runs_to_max_tokens(live):
    """vLLM's and llama-server's extension: the end id no longer ends the row."""
    body = {"ignore_eos": True}
    out = live.client().completions.create(model=MODEL, prompt="ab#", max_tokens=7, extra_body=body)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 7
    assert out.choices[0].text.replace("<eos>", "") == "ababa"  # a b end a b end a


def test_list_of_prompts_and_token_ids(live):
    prompts = ["one two ", "three ", "fourfour"]
    out = live.post("/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 7})
    body = out.json()
    assert out.status_code == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [expected_text(p, 7)[0] for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    ids = list(b"xyz")
    out = live.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4})
    assert out.json()["choices"][0]["text"] == "xyzx"


def test_stream_joins_to_the_whole_text_with_usage(live):
    client = live.client()
    prompt = "héllo wörld €uro 😀 "
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 3 and all("\ufffd" not in t for t in texts)
    assert "".join(texts) == whole.choices[0].text == expected_text(prompt, 40)[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    spec = chunks[-1].model_extra["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0


def test_chat_and_its_stream(live):
    client = live.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    rendered = "[system]be brief\n[user]hi\n[assistant]"
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(rendered, 12)[0]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True)
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_the_context(live):
    out = live.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x#"}]
    )
    assert out.choices[0].finish_reason == "stop"  # the echo reaches '#' long before the context


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_across_chunks(live, stream):
    client = live.client()
    prompt = "the quick brown fox "
    kw = dict(model=MODEL, prompt=prompt, max_tokens=60, stop=["k br", "zzz"])
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    else:
        out = client.completions.create(**kw)
        text = out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == len("the quick br")
    assert text == "the quic"


def test_a_row_stopped_early_in_a_streamed_request_of_several_ends_alone(live):
    """The rows of a request share one inbox: a row that a stop string ends while the engine
    still runs it gets one last chunk and no text from the updates still on their way, and the
    other row streams on to its end."""
    client = live.client()
    prompts = ["ab zz cd ", "qrstuvwxy "]
    texts, finishes = ["", ""], [[], []]
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=30, stop=["zz"], stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == ["ab ", expected_text(prompts[1], 30)[0]]
    assert finishes == [["stop"], ["length"]]


def test_metrics_rise_by_the_responses_counts(live):
    before = {
        n: live.metric(n)
        for n in (
            "spec_decode_num_drafts_total",
            "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total",
            "prompt_tokens_total",
            "generation_tokens_total",
        )
    }
    pos0 = live.metric("spec_decode_num_accepted_tokens_per_pos_total", '{position="0"}')
    out = live.post("/v1/completions", {"model": MODEL, "prompt": "metrics!", "max_tokens": 30})
    body = out.json()
    spec = body["metrics"]["speculative_decoding"]
    assert (
        live.metric("spec_decode_num_drafts_total") - before["spec_decode_num_drafts_total"]
        == spec["num_spec_steps"]
    )
    assert (
        live.metric("spec_decode_num_draft_tokens_total")
        - before["spec_decode_num_draft_tokens_total"]
        == spec["num_draft_tokens"]
    )
    assert (
        live.metric("spec_decode_num_accepted_tokens_total")
        - before["spec_decode_num_accepted_tokens_total"]
        == spec["num_accepted_tokens"]
    )
    assert live.metric("prompt_tokens_total") - before["prompt_tokens_total"] == 8
    assert live.metric("generation_tokens_total") - before["generation_tokens_total"] == 30
    rounds_accepting = sum(spec["acceptance_histogram"][1:])
    assert (
        live.metric("spec_decode_num_accepted_tokens_per_pos_total", '{position="0"}') - pos0
        == rounds_accepting
    )
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "time_to_first_token_seconds_bucket",
        "time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_sum",
    ):
        assert f"specdecode:{name}" in text


def test_concurrent_clients_get_their_own_texts(live):
    prompts = [f"client {i} says {'ab' * i}# " for i in range(12)]

    def ask(p: str):
        out = live.client().completions.create(model=MODEL, prompt=p, max_tokens=25)
        return out.choices[0].text, out.choices[0].finish_reason

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [expected_text(p, 25) for p in prompts]


def test_disconnect_mid_stream_cancels_the_row():
    with Live(FakeDecoder(step_delay=0.02)) as live:
        body = {"model": MODEL, "prompt": "a long answer ", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 10
        while live.loop.cancelled == [] or live.metric("num_requests_running") != 0:
            assert time.monotonic() < deadline, "the row was not cancelled"
            time.sleep(0.05)
        assert len(live.loop) == 0


def test_a_client_gone_before_a_whole_answer_cancels_its_row():
    with Live(FakeDecoder(step_delay=0.02)) as live:
        body = {"model": MODEL, "prompt": "a long answer ", "max_tokens": 400}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while live.loop.cancelled == [] or live.metric("num_requests_running") != 0:
            assert time.monotonic() < deadline, "the row was not cancelled"
            time.sleep(0.05)


# ------------------------------------------------------------------ faults


def bad_requests():
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    yield "not json", b"{nope", None
    yield "not an object", b"[1, 2]", None
    yield "no model", {"prompt": "hi"}, "model"
    yield "no prompt", {"model": MODEL}, "prompt"
    yield "prompt type", {**ok, "prompt": 3}, "prompt"
    yield "empty prompt", {**ok, "prompt": ""}, "prompt"
    yield "token out of vocabulary", {**ok, "prompt": [1, 99999]}, "prompt"
    yield "max_tokens 0", {**ok, "max_tokens": 0}, "max_tokens"
    yield "max_tokens type", {**ok, "max_tokens": "4"}, "max_tokens"
    yield "temperature < 0", {**ok, "temperature": -0.1}, "temperature"
    yield "top_p 0", {**ok, "top_p": 0}, "top_p"
    yield "top_p > 1", {**ok, "top_p": 1.5}, "top_p"
    yield "stop type", {**ok, "stop": 5}, "stop"
    yield "five stops", {**ok, "stop": list("abcde")}, "stop"
    yield "over the context", {**ok, "max_tokens": 511}, "max_tokens"
    yield "stream type", {**ok, "stream": "yes"}, "stream"
    yield "ignore_eos type", {**ok, "ignore_eos": 1}, "ignore_eos"
    for name, value in [
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
        ("logit_bias", {"1": 5}),
        ("n", 2),
        ("best_of", 3),
        ("logprobs", 2),
        ("echo", True),
        ("suffix", "x"),
        ("repetition_penalty", 1.2),
        ("tools", [{}]),
        ("response_format", {"type": "json_object"}),
    ]:
        yield f"unsupported {name}", {**ok, name: value}, name
    yield "unknown field", {**ok, "temprature": 0}, "temprature"


@pytest.mark.parametrize(
    ("what", "body", "param"), list(bad_requests()), ids=[b[0] for b in bad_requests()]
)
def test_bad_requests_are_400_with_the_field_named(live, what, body, param):
    r = live.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


def test_neutral_values_of_unsupported_fields_are_accepted(live):
    body = {
        "model": MODEL,
        "prompt": "ok",
        "max_tokens": 3,
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "echo": False,
        "user": "u1",
    }
    assert live.post("/v1/completions", body).status_code == 200


def test_bad_chat_requests(live):
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for body, param in [
        ({"model": MODEL}, "messages"),
        ({**ok, "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
        ({**ok, "tools": [{"type": "function"}]}, "tools"),
        ({**ok, "max_tokens": -1}, "max_tokens"),
    ]:
        r = live.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_api_key():
    with Live(api_key="sesame") as live:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        r = live.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        out = live.client(api_key="sesame").completions.create(
            model=MODEL, prompt="x", max_tokens=2
        )
        assert out.choices[0].text == "xx"
        # the metrics count every client's requests: the key guards them too
        assert httpx.get(live.url + "/metrics").status_code == 401
        key = {"authorization": "Bearer sesame"}
        assert httpx.get(live.url + "/metrics", headers=key).status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200  # load balancers: no key


def test_a_failing_row_fails_alone_and_a_crash_resets_the_loop(live, caplog):
    def ask(p: str) -> httpx.Response:
        return live.post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 20})

    with ThreadPoolExecutor(3) as pool:
        fail, good = pool.map(ask, ["please FAIL", "fine fine "])
    assert fail.status_code == 500 and fail.json()["error"]["type"] == "server_error"
    # the client learns a request id only; the engine's words are logged under it
    message = fail.json()["error"]["message"]
    assert re.fullmatch(r"internal error \(request id req-[0-9a-f]+\)", message), message
    request_id = message.split()[-1].rstrip(")")
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1 and "could not decode" in logged[0]
    assert (
        good.status_code == 200
        and good.json()["choices"][0]["text"] == expected_text("fine fine ", 20)[0]
    )
    resets = live.loop.resets
    crash = ask("CRASH now")
    assert crash.status_code == 500 and crash.json()["error"]["type"] == "server_error"
    assert live.loop.resets == resets + 1
    assert ask("after ").json()["choices"][0]["text"] == expected_text("after ", 20)[0]


def test_health_is_503_while_loading():
    release = threading.Event()
    decoder = FakeDecoder()

    def load():
        release.wait(20)
        return decoder

    with Live(decoder, load=load) as live:
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = live.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        release.set()
        live.scheduler.loaded.wait(10)
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}


def test_load_test_every_request_answered_once_or_refused():
    """200 short requests at concurrency 16 against a queue of 4: each is answered in full or
    refused with 429 and Retry-After; none is lost, none answered twice (distinct texts)."""
    with Live(FakeDecoder(step_delay=0.003), max_batch=4, max_queue=4) as live:
        prompts = [f"req{i:03d} " for i in range(200)]

        async def main():
            limits = httpx.Limits(max_connections=16)
            async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as c:
                gate = asyncio.Semaphore(16)

                async def one(p):
                    async with gate:
                        return await c.post(
                            "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 12}
                        )

                return await asyncio.gather(*(one(p) for p in prompts))

        responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and 200 in codes
    for p, r in zip(prompts, responses, strict=True):
        if r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["choices"][0]["text"] == expected_text(p, 12)[0]
    ids = [r.json()["id"] for r in responses if r.status_code == 200]
    assert len(set(ids)) == len(ids)


def fake_server(live_server, *delays: float):
    """The real server process over the fake engine (`serve_fake_worker.py`'s delays)."""
    worker = Path(__file__).with_name("serve_fake_worker.py")
    args = [str(d) for d in delays]
    return live_server(lambda port: [sys.executable, str(worker), str(port), *args], 60)


def test_sigterm_drains_then_exits_zero(live_server):
    server = fake_server(live_server, 0.02)
    proc, url = server.proc, server.url
    try:
        body = {"model": "fake", "prompt": "drain me ", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(
                url + "/v1/completions", json={"model": "fake", "prompt": "late", "max_tokens": 2}
            )
            rest = [x for x in [first, *lines] if x]
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert rest[-1] == "data: [DONE]"
        pieces = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
        text = "".join(p["choices"][0]["text"] for p in pieces if p.get("choices"))
        assert text == expected_text("drain me ", 60)[0]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_drain_answers_a_kept_connection_then_closes_it(live_server):
    """A client whose stream has just ended sends its next request down the same connection:
    the draining server answers it (503, closing the connection), not resets it by exiting,
    and refuses new connections by then; its last words count what it answered."""
    server = fake_server(live_server, 0.02)
    proc = server.proc
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            body = {"model": "fake", "prompt": "last one ", "max_tokens": 30, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                proc.send_signal(signal.SIGTERM)
                assert [x for x in lines if x][-1] == "data: [DONE]"
            time.sleep(0.2)  # past the tick that finds the drain done
            late = client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert late.headers["connection"] == "close"
            with pytest.raises(httpx.ConnectError):  # the listener is closed
                client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        assert proc.wait(30) == 0
        assert "[serve] drained: 1 request(s) answered since the start" in server.log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_drain_waits_for_a_request_still_being_tokenized(live_server):
    """A request admitted just before the signal and still being tokenized is in no queue yet:
    the drain waits for it too, past uvicorn's own 5 s grace, and it is answered in full."""
    server = fake_server(live_server, 0.25, 1.0)
    proc = server.proc
    try:
        body = {"model": "fake", "prompt": "slow one ", "max_tokens": 60}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while "tokenizing a slow prompt" not in server.log.read_text():  # admitted
                assert time.monotonic() < deadline and not answer.done()
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            r = answer.result()
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == expected_text("slow one ", 60)[0]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------ requests and limits


class RecordingTokenizer(ByteTokenizer):
    """The fake's tokenizer, noting the thread of each encoding and rendering; a conversation
    whose turns do not alternate is refused by its template, as many real templates do."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = True):
        self.threads.append(threading.current_thread().name)
        return super().__call__(text, add_special_tokens)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        import jinja2

        self.threads.append(threading.current_thread().name)
        roles = [m["role"] for m in messages]
        if any(a == b for a, b in itertools.pairwise(roles)):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


@pytest.fixture(scope="module")
def recording():
    decoder = FakeDecoder(step_delay=0.002)
    decoder.tokenizer = RecordingTokenizer()
    with Live(decoder, max_batch=2, max_queue=3, max_body_bytes=64 << 10) as server:
        yield server


def test_unknown_model_is_404_model_not_found(live):
    with pytest.raises(openai.NotFoundError) as raised:
        live.client().completions.create(model="gpt-5", prompt="hi", max_tokens=2)
    error = raised.value.body
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and error["param"] == "model"
    messages = [{"role": "user", "content": "hi"}]
    r = live.post("/v1/chat/completions", {"model": "gpt-5", "messages": messages})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def malformed_bodies():
    """(what, body, the param named): JSON written by hand, as a client library would not."""
    ok = '{"model": "fake", "prompt": "x", '
    yield "lone surrogate in the prompt", '{"model": "fake", "prompt": "a\\ud800b"}', "prompt"
    yield "in a list of prompts", '{"model": "fake", "prompt": ["ok", "\\udfff"]}', "prompt[1]"
    yield "in the user", ok + '"user": "\\udc00"}', "user"
    yield "in a key", ok + '"\\ud800": 1}', "\\ud800"
    yield "nested 5,000 deep", ok + '"metadata": ' + "[" * 5000 + "]" * 5000 + "}", None
    yield "NaN", ok + '"temperature": NaN}', None
    yield "an integer of 5,000 digits", ok + '"seed": ' + "9" * 5000 + "}", None
    yield "an integer past int64", ok + '"top_k": 9223372036854775808}', "top_k"
    yield "not UTF-8", b'{"model": "fake", "prompt": "\xff"}', None
    yield "a long stop", {"model": MODEL, "prompt": "x", "stop": "s" * 257}, "stop"


@pytest.mark.parametrize(
    ("what", "body", "param"), list(malformed_bodies()), ids=[b[0] for b in malformed_bodies()]
)
def test_malformed_bodies_are_400_naming_the_field(live, what, body, param):
    r = live.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert len(error["message"]) < 300  # nothing sent is repeated at length
    assert "\ud800" not in r.text


def test_a_paired_surrogate_escape_is_a_character(live):
    r = live.post(
        "/v1/completions", '{"model": "fake", "prompt": "\\ud83d\\ude00!", "max_tokens": 5}'
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "😀!"


def test_bad_messages_are_400_naming_the_field(recording):
    user = {"role": "user", "content": "hi"}
    for messages, param in [
        ([{**user, "name": "alice"}], "messages[0].name"),
        ([user, {**user, "role": "assistant", "tool_calls": [{}]}], "messages[1].tool_calls"),
        ([{"role": "user", "content": "a\ud800"}], "messages[0].content"),
        ([user, user], "messages"),  # the chat template's own refusal
    ]:
        body = json.dumps({"model": MODEL, "messages": messages})
        r = recording.post("/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = recording.post("/v1/chat/completions", {"model": MODEL, "messages": [user, user]})
    assert "roles must alternate" in r.json()["error"]["message"]
    neutral = [{**user, "name": None}, {"role": "assistant", "content": "ok", "refusal": None}]
    body = {"model": MODEL, "messages": [*neutral, user], "max_tokens": 3}
    assert recording.post("/v1/chat/completions", body).status_code == 200


def test_a_tiny_temperature_runs_greedy():
    """Dividing the logits by 1e-38 overflows them (the row's law would be NaN): below 1e-5
    the request is greedy, as in vLLM."""
    body = {"model": MODEL, "prompt": "x", "temperature": 1e-38}
    assert parse_completion(body).sampling.temperature == 0.0
    assert parse_completion({**body, "temperature": 1e-5}).sampling.temperature == 1e-5


def test_tokenizing_and_templates_run_off_the_event_loop(recording):
    tokenizer = recording.decoder.tokenizer
    tokenizer.threads.clear()
    recording.post("/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 2})
    recording.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert len(tokenizer.threads) == 3
    assert all(name.startswith("specdecode-requests") for name in tokenizer.threads)


def test_limits_are_checked_before_the_work(recording):
    tokenizer = recording.decoder.tokenizer
    tokenizer.threads.clear()
    # more characters than the context could hold at 32 a token: refused untokenized
    chars = 512 * 32 + 1
    r = recording.post("/v1/completions", {"model": MODEL, "prompt": "x" * chars})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    messages = [{"role": "user", "content": "y" * chars}]
    r = recording.post("/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = recording.post("/v1/completions", {"model": MODEL, "prompt": [65] * 513})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # more prompts than the batch and the queue hold (2 + 3): the cap is said
    r = recording.post("/v1/completions", {"model": MODEL, "prompt": ["a"] * 6, "max_tokens": 1})
    assert r.status_code == 400 and "at most 5 per request" in r.json()["error"]["message"]
    assert tokenizer.threads == []
    # a body over the limit (64 KiB here), by its declared length or as it streams in
    big = json.dumps({"model": MODEL, "prompt": "z" * (65 << 10)}).encode()
    r = recording.post("/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunks = (big[i : i + 4096] for i in range(0, len(big), 4096))  # no Content-Length
    r = recording.post("/v1/completions", chunks)
    assert r.status_code == 413
    r = recording.post(
        "/v1/completions",
        b'{"model": "fake", "prompt": "x"}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert tokenizer.threads == []
    r = recording.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "ok"


def test_a_client_gone_before_its_body_is_no_server_error(recording, caplog):
    with socket.create_connection(("127.0.0.1", recording.port)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": "fake", '
        )
    time.sleep(0.3)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    r = recording.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "ok"


def test_an_unforeseen_failure_is_500_with_a_request_id_only(caplog):
    class Broken(ByteTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True):
            raise RuntimeError("secret internal state")

    decoder = FakeDecoder()
    decoder.tokenizer = Broken()
    with Live(decoder) as live:
        r = live.post("/v1/completions", {"model": MODEL, "prompt": "x"})
        assert r.status_code == 500
        error = r.json()["error"]
        assert re.fullmatch(r"internal error \(request id (req-[0-9a-f]+)\)", error["message"])
        assert error["type"] == "server_error" and "secret" not in r.text
        request_id = error["message"].split()[-1].rstrip(")")
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert len(logged) == 1 and "secret internal state" in str(logged[0].exc_info[1])
        assert httpx.get(live.url + "/health").status_code == 200


def test_a_server_settles_its_models_once_before_it_answers():
    decoder = FakeDecoder()
    assert ready_after(lambda: decoder)() is decoder
    assert decoder.settled == 1


def test_the_tokenizer_is_ready_before_the_first_request(tmp_path):
    """A saved tokenizer loads `transformers` and its chat template at its first chat
    rendering, a second or more: the server does it while loading the models."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    from specdecode.models.tokenizer import SavedTokenizer

    backend = Backend(tokenizer_models.BPE({"a": 0, "b": 1, "<eos>": 2}, []))
    saved = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    saved.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    saved.save_pretrained(str(tmp_path))
    tokenizer = SavedTokenizer.read(tmp_path)
    assert tokenizer is not None and tokenizer._full is None
    warm_tokenizer(tokenizer)
    assert tokenizer._full is not None


def test_a_reachable_address_without_a_key_warns(capsys):
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("example.org")

    def load():
        raise RuntimeError("no model here")

    config = ServeConfig(model_name=MODEL, host="0.0.0.0", port=free_port(), log_level="error")
    assert serve(load, config) == 2
    assert "with no API key" in capsys.readouterr().err
    serve(load, replace(config, api_key="k"))
    assert "with no API key" not in capsys.readouterr().err


def test_the_api_key_is_read_from_the_environment(monkeypatch, capsys):
    """Out of the command line, which every user of the machine reads in `ps`."""
    from specdecode.cli.main import build_parser
    from specdecode.serve import server

    seen = []
    monkeypatch.setattr(server, "serve", lambda load, config: seen.append(config) or 0)
    monkeypatch.setenv("SPECDECODE_API_KEY", "from-env")
    parser = build_parser("serve")
    args = parser.parse_args(["serve", "--no-draft", "--max-body-mib", "1.5"])
    assert args.func(args) == 0
    assert seen[0].api_key == "from-env" and seen[0].max_body_mib == 1.5
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "SPECDECODE_API_KEY" in capsys.readouterr().out
