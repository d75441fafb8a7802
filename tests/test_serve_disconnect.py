"""Clients that leave before their rows start cost no prefill: a request whose client
disconnected while it was queued, or while it was being tokenized, never reaches the engine
(the fake engine of tests/serve_fake.py, which keeps every request added to it).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("fastapi")
import httpx
from serve_fake import MODEL, ByteTokenizer, FakeDecoder, FakeLoop, Live

WAIT = 20.0  # seconds a condition may take on a loaded machine


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@dataclass
class GatedLoop(FakeLoop):
    """The fake loop, keeping the prompts added to it; a round waits for `gate`."""

    gate: threading.Event = field(default_factory=threading.Event)
    added: list[bytes] = field(default_factory=list)

    def add(self, request) -> int:
        self.added.append(bytes(t for t in request.prompt if t < 256))
        return super().add(request)

    def step(self):
        self.gate.wait()
        return super().step()


class GatedDecoder(FakeDecoder):
    def loop(self, max_rows: int = 8, prefill_chunk: int = 256, **drafting) -> GatedLoop:
        loop = GatedLoop(max_rows, self.step_delay)
        self.loops.append(loop)
        return loop


class SlowTokenizer(ByteTokenizer):
    """Tokenizing a text holding SLOW waits for `gate`."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self, text: str, add_special_tokens: bool = True):
        if "SLOW" in text:
            self.gate.wait(WAIT)
        return super().__call__(text, add_special_tokens)


def connections(live: Live) -> int:
    return len(live.server.server_state.connections)


def leave(live: Live, body: dict) -> None:
    """Send `body` and disconnect before its answer: a whole answer is waited for 0.3 s, a
    stream is closed once its headers came."""
    if body.get("stream"):
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=WAIT):
            pass
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)


def test_queued_requests_whose_clients_left_are_never_added():
    """One row, held by A (its rounds wait on the gate); B (whole answer) and C (a stream)
    queue behind it and their clients leave: both leave the queue, and once A's rounds run
    and A ends, neither was added to the loop."""
    with Live(GatedDecoder(), max_batch=1) as live:
        until(lambda: live.decoder.loops, "the loop was not made")
        gate = live.loop.gate
        try:
            first = {"model": MODEL, "prompt": "A says hi#", "max_tokens": 20, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=first, timeout=WAIT) as a:
                until(lambda: live.loop.added == [b"A says hi#"], "A was not admitted")
                for prompt, stream in (("B", False), ("C", True)):
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": stream}
                    worker = threading.Thread(target=leave, args=(live, body))
                    worker.start()
                    if not stream:  # a stream's headers come once it is queued: it leaves then
                        until(lambda: live.metric("num_requests_waiting") == 1, "B not queued")
                    worker.join(WAIT)
                    until(lambda: live.metric("num_requests_waiting") == 0, f"{prompt} stayed")
                gate.set()
                text = "".join(a.iter_text())
            assert '"finish_reason":"stop"' in text.replace(" ", "")
            until(lambda: live.scheduler.busy() == 0, "the scheduler kept a request")
            assert live.loop.added == [b"A says hi#"]
        finally:
            gate.set()


def test_a_request_whose_client_left_while_it_was_tokenized_is_never_queued():
    """Rows are free; a client leaves while its prompt is being tokenized: its request is not
    submitted, so no row is added for it, and the next request is answered as usual."""
    decoder = FakeDecoder(step_delay=0.001)
    decoder.tokenizer = SlowTokenizer()
    with Live(decoder) as live:
        try:
            leave(live, {"model": MODEL, "prompt": "SLOW prompt#", "max_tokens": 5})
            until(lambda: connections(live) == 0, "the server did not see the client leave")
            decoder.tokenizer.gate.set()
            r = live.post("/v1/completions", {"model": MODEL, "prompt": "next#", "max_tokens": 9})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "next"
            assert live.loop.next_key == 1  # one row added: the second request's
        finally:
            decoder.tokenizer.gate.set()
