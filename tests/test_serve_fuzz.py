"""Hundreds of generated malformed or out-of-range requests against the real server process over
the fake engine (tests/serve_fake_worker.py): wrong JSON types in every field, nested
structures, lone surrogates, huge and negative numbers, unknown and unsupported fields, bad
messages, broken bodies and wrong content types. None may be answered 500 (or break a stream
with a server error), every refusal has OpenAI's error body, and afterwards the server is up
and answers a valid request with its normal text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_fake import expected_text  # noqa: E402

MODEL = "fake"
NAMED = {"role": "user", "content": "x", "name": "n"}
ROUTES = ("/v1/completions", "/v1/chat/completions")
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stream", "stream_options", "ignore_eos", "user", "n",
    "best_of", "presence_penalty", "logit_bias", "logprobs", "echo", "suffix", "tools",
    "response_format", "metadata", "temprature", "\ud800", "",
)  # fmt: skip
CONTENT_TYPES = (
    None,
    "application/json",
    "application/json; charset=utf-8",
    "application/vnd.api+json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "",
    "\x7f/\x01",
)


@pytest.fixture(scope="module")
def server(live_server):
    """The server process, over the fake engine, on a free port of 127.0.0.1."""
    worker = Path(__file__).with_name("serve_fake_worker.py")
    s = live_server(lambda port: [sys.executable, str(worker), str(port), "0"], ready_s=60)
    with httpx.Client(base_url=s.url, timeout=30) as client:
        yield s.proc, client
    s.stop()


def strings() -> st.SearchStrategy[str]:
    """Text, with lone surrogates, NULs and long runs among it."""
    return st.one_of(
        st.text(max_size=12),
        st.sampled_from(["a\ud800b", "\udfff", "\ud83d", "\x00", "fake", "user", "#"]),
        st.integers(1000, 20_000).map(lambda n: "x" * n),
    )


def numbers() -> st.SearchStrategy[int | float]:
    return st.one_of(
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, -1, 1, 2**63, 2**63 - 1, -(2**63), 10**30, 10**4000]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e-38, 5e-324, -0.0, 1e308, 0.5]),
    )


def values() -> st.SearchStrategy:
    """Any JSON value (and NaN or Infinity, which Python's encoder writes), nested a little."""
    scalars = st.one_of(st.none(), st.booleans(), numbers(), strings())
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings(), inner, max_size=4),
        max_leaves=8,
    )


def messages() -> st.SearchStrategy:
    role = st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"]) | values()
    part = st.fixed_dictionaries({"type": st.just("text"), "text": strings()})
    content = strings() | values() | st.lists(part | values(), max_size=3)
    message = st.fixed_dictionaries(
        {"role": role, "content": content},
        optional={"name": values(), "tool_calls": values(), "refusal": st.none()},
    )
    return st.lists(message | values(), max_size=4) | values()


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes, str | None]:
    """(route, body, content type): a valid request with some fields replaced, removed or added,
    or bytes that are not one."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "raw", "nested"]))
    if kind == "raw":
        body = draw(
            st.binary(max_size=64)
            | st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"{}", b'{"model": "fake",'])
            | st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass"))
        )
    elif kind == "nested":
        depth = draw(st.integers(1, 20_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        where = draw(st.sampled_from(FIELDS))
        inner = opener * depth + "1" + closer * depth
        body = f'{{"model": "fake", {json.dumps(where)}: {inner}}}'.encode()
    else:
        fields: dict = {"model": MODEL, "max_tokens": 4}
        if route == ROUTES[0]:
            fields["prompt"] = "hello"
        else:
            fields["messages"] = [{"role": "user", "content": "hello"}]
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
            if draw(st.booleans()) and name in fields:
                del fields[name]
            elif name == "messages":
                fields[name] = draw(messages())
            else:
                fields[name] = draw(values())
        body = json.dumps(fields).encode()  # surrogates as escapes, NaN and Infinity as such
    return (
        route,
        body,
        draw(st.none() | st.sampled_from(CONTENT_TYPES[1:2]) | st.sampled_from(CONTENT_TYPES)),
    )


def check(response: httpx.Response) -> None:
    """Not a 500, nor a stream ended by a server error; a refusal has OpenAI's error body."""
    assert response.status_code != 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [x[6:] for x in response.text.split("\n\n") if x.startswith("data: {")]
            assert all(json.loads(e).get("error") is None for e in events), response.text
        else:
            assert "choices" in response.json()
        return
    assert response.status_code in (400, 404, 413, 415), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=bodies())
@example(case=(ROUTES[0], b'{"model": "fake", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None))
@example(case=(ROUTES[0], b'{"model": "fake", "prompt": "a\\ud800b"}', "application/json"))
@example(case=(ROUTES[0], b'{"model": "fake", "prompt": "x", "temperature": 1e-38}', None))
@example(case=(ROUTES[1], json.dumps({"model": MODEL, "messages": [NAMED]}).encode(), None))
@example(case=(ROUTES[0], b'{"model": "fake", "prompt": "' + b"y" * (5 << 20) + b'"}', None))
@example(case=(ROUTES[0], b'{"model": "gpt-5", "prompt": "x"}', None))
def test_no_generated_request_is_answered_500(server, case):
    _, client = server
    route, body, content_type = case
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post(route, content=body, headers=headers)
    event(f"status {response.status_code}")
    check(response)


def test_the_server_is_up_and_answers_normally_afterwards(server):
    proc, client = server
    assert proc.poll() is None
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "after all that ", "max_tokens": 30}
    )
    assert r.json()["choices"][0]["text"] == expected_text("after all that ", 30)[0]
