"""The serving load driver against a fake OpenAI-compatible server run in this process.

The fake (Starlette under uvicorn, on a free 127.0.0.1 port) streams a fixed token sequence, a
usage chunk with speculative metrics, and keeps a log of what it was sent and served, so every
count the driver records can be checked against what was actually served. Its gate holds each
request's first token until `gate` requests are in flight (or a second passes), so the most
requests it ever saw at once is the concurrency the driver honoured, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from specdecode.bench.serving import (  # noqa: E402
    FOLLOW_UPS,
    ServeBenchConfig,
    Server,
    percentiles,
    run_serving_bench,
    serving_table,
    write_serving_report,
)
from specdecode.cli.main import main  # noqa: E402

PIECES = ("def", " f", "(x", "):", "\n ", " return", " x")  # one token each
DRAFTED, ACCEPTED, STEPS = 4, 3, 2  # per request, in the usage chunk's metrics


@dataclass
class FakeState:
    gate: int = 1
    usage: bool = True
    in_flight: int = 0
    max_in_flight: int = 0
    log: list[dict] = field(default_factory=list)  # per request: route, body, tokens, text


class Fake:
    """The app and what it saw; `reset` between tests (the server runs for the whole module)."""

    def __init__(self) -> None:
        self.state = FakeState()
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    def reset(self, gate: int = 1, usage: bool = True) -> None:
        self.state = FakeState(gate=gate, usage=usage)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(self, request: Request):
        return await self.stream(request, chat=False)

    async def chat(self, request: Request):
        return await self.stream(request, chat=True)

    async def stream(self, request: Request, chat: bool):
        body = await request.json()
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in text:
            error = {"message": "refused by the fake", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        state = self.state
        cut = "CUT" in text  # a stream broken off: [DONE] after 2 tokens, no finish_reason
        pieces = PIECES[: 2 if cut else body["max_tokens"]]
        entry = {"chat": chat, "body": body, "tokens": len(pieces), "text": "".join(pieces)}
        state.log.append(entry)

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                deadline = time.monotonic() + 1.0
                while state.in_flight < state.gate and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                for i, piece in enumerate(pieces):
                    reason = "length" if i == len(pieces) - 1 and not cut else None
                    choice = (
                        {"index": 0, "delta": {"content": piece}, "finish_reason": reason}
                        if chat
                        else {"index": 0, "text": piece, "finish_reason": reason}
                    )
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    await asyncio.sleep(0.002)
                wants_usage = body.get("stream_options", {}).get("include_usage")
                if state.usage and wants_usage and not cut:
                    usage = {
                        "choices": [],
                        "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces)},
                        "metrics": {
                            "speculative_decoding": {
                                "num_spec_steps": STEPS,
                                "num_draft_tokens": DRAFTED,
                                "num_accepted_tokens": ACCEPTED,
                            }
                        },
                    }
                    yield f"data: {json.dumps(usage)}\n\n"
            finally:  # before the end: the client starts its next request once it sees it
                state.in_flight -= 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake_server():
    fake = Fake()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the fake server did not start"
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def prompts_file(tmp_path: Path):
    def write(*texts: str) -> str:
        path = tmp_path / "prompts.txt"
        path.write_text("\n".join(texts) + "\n")
        return str(path)

    return write


@pytest.fixture
def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def config(url: str, prompts: str, **kwargs) -> ServeBenchConfig:
    settings = {"concurrency": (2,), "max_tokens": 5, "modes": ("new",), "limit": 16} | kwargs
    return ServeBenchConfig(servers=(Server.parse(f"fake={url}"),), prompts=prompts, **settings)


def all_requests(record: dict) -> list[dict]:
    """Every request the record holds: the servers' warm-ups, the passes' and the measured."""
    warm = [r for s in record["servers"] for r in s["warmup"]]
    return warm + [r for p in record["passes"] for r in p["warmup"] + p["requests"]]


def quiet(line: str) -> None:
    pass


def test_counts_equal_what_was_served(fake_server, prompts_file):
    fake, url = fake_server
    fake.reset()
    prompts = prompts_file("alpha", "beta", "gamma")
    record = run_serving_bench(
        config(url, prompts, modes=("new", "seen", "chat"), turns=2, repeats=2), log=quiet
    )
    served = fake.state.log
    assert len(all_requests(record)) == len(served)
    assert sum(r["completion_tokens"] for r in all_requests(record)) == sum(
        e["tokens"] for e in served
    )
    assert record["ok"]
    for cell in record["cells"]:
        passes = [
            p
            for p in record["passes"]
            if (p["server"], p["mode"], p["concurrency"])
            == (cell["server"], cell["mode"], cell["concurrency"])
        ]
        assert len(passes) == 2  # the repeats, pooled
        assert cell["requests"] == sum(len(p["requests"]) for p in passes)
        assert cell["requests"] == 3 * 2 * (2 if cell["mode"] == "chat" else 1)
        assert cell["completion_tokens"] == sum(
            r["completion_tokens"] for p in passes for r in p["requests"]
        )
        # each pass's rate, and the pooled rate between the slowest and the fastest pass
        each = [sum(r["completion_tokens"] for r in p["requests"]) / p["wall_s"] for p in passes]
        assert cell["pass_tok_per_s"] == pytest.approx(each)
        assert min(each) <= cell["output_tok_per_s"] <= max(each)
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert cell[key]["p50"] <= cell[key]["p99"]
        assert cell["acceptance"]["drafted"] == DRAFTED * cell["requests"]
        assert cell["acceptance"]["rate"] == pytest.approx(ACCEPTED / DRAFTED)
        assert cell["acceptance"]["mean_acceptance_length"] == pytest.approx(1 + ACCEPTED / STEPS)
        assert cell["tokens_from"] == ["usage"]
    table = serving_table(record)
    assert "| fake | seen | 2 | 6 |" in table
    seen = next(c for c in record["cells"] if c["mode"] == "seen")
    low, high = min(seen["pass_tok_per_s"]), max(seen["pass_tok_per_s"])
    assert f"| {seen['output_tok_per_s']:.2f} [{low:.2f}, {high:.2f}] |" in table
    assert "chat: 2 turns" in table


@pytest.mark.parametrize("waves", [False, True])
def test_waves_take_turns_between_servers_and_join_into_one_pass(fake_server, prompts_file, waves):
    """With waves, the servers take turns every `concurrency` prompts (the first of each wave
    alternating) and each server's waves join into one pass of all its requests; without,
    each server runs its whole pass in turn."""
    fake, url = fake_server
    fake.reset()
    words = ("alpha", "beta", "gamma")
    servers = (Server.parse(f"a={url}"), Server.parse(f"b={url}"))
    cfg = replace(config(url, prompts_file(*words), concurrency=(1,), waves=waves), servers=servers)
    record = run_serving_bench(cfg, log=quiet)
    sent = [next(w for w in words if w in e["body"]["prompt"]) for e in fake.state.log[2:]]
    assert sent == (sorted(words * 2) if waves else list(words) * 2)
    assert [p["server"] for p in record["passes"]] == ["a", "b"]
    for p in record["passes"]:
        assert len(p["requests"]) == 3
        starts = [r["sent_s"] for r in p["requests"]]
        assert starts == sorted(starts) and starts[-1] < p["wall_s"]


def test_chunks_counted_where_the_stream_has_no_usage(fake_server, prompts_file):
    """llama-cpp-python's server streams no usage: each chunk with text is then one token."""
    fake, url = fake_server
    fake.reset(usage=False)
    record = run_serving_bench(config(url, prompts_file("one", "two")), log=quiet)
    (cell,) = record["cells"]
    assert cell["tokens_from"] == ["chunks"]
    assert cell["completion_tokens"] == 2 * 5
    assert cell["acceptance"] is None


@pytest.mark.parametrize("level", [1, 3])
def test_concurrency_is_honoured(fake_server, prompts_file, level):
    fake, url = fake_server
    fake.reset(gate=level)
    prompts = prompts_file(*(f"prompt {i}" for i in range(6)))
    record = run_serving_bench(config(url, prompts, concurrency=(level,)), log=quiet)
    assert fake.state.max_in_flight == level
    assert record["cells"][0]["concurrency"] == level


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_is_asked_of_every_request_only_when_set(fake_server, prompts_file, ignore_eos):
    fake, url = fake_server
    fake.reset()
    record = run_serving_bench(
        config(url, prompts_file("alpha", "beta"), ignore_eos=ignore_eos), log=quiet
    )
    asked = [e["body"].get("ignore_eos") for e in fake.state.log]
    assert asked == [True if ignore_eos else None] * len(asked) and len(asked) >= 3
    header = serving_table(record).splitlines()[2]
    assert ("exactly 5 tokens each (ignore_eos)" in header) == ignore_eos
    assert ("at most 5 tokens each" in header) != ignore_eos


def test_new_prompts_are_all_distinct(fake_server, prompts_file):
    fake, url = fake_server
    fake.reset()
    texts = ("same", "same", "other")
    run_serving_bench(config(url, prompts_file(*texts), concurrency=(1, 2)), log=quiet)
    sent = [e["body"]["prompt"] for e in fake.state.log]
    assert len(sent) == 1 + 2 * len(texts)  # the server's warm-up, then a pass per level
    assert len(set(sent)) == len(sent)
    assert sorted(s.split("\n", 1)[1] for s in sent[1:]) == sorted(texts * 2)


def test_seen_sends_its_warmup_first_and_does_not_count_it(fake_server, prompts_file):
    fake, url = fake_server
    fake.reset()
    texts = ["one", "two", "three"]
    record = run_serving_bench(config(url, prompts_file(*texts), modes=("seen",)), log=quiet)
    sent = [e["body"]["prompt"] for e in fake.state.log][1:]  # after the server's warm-up
    assert sorted(sent[:3]) == sorted(texts)  # the warm-up pass, untagged
    assert sorted(sent[3:]) == sorted(texts)  # then the same prompts, measured
    (done,) = record["passes"]
    assert len(done["warmup"]) == 3
    assert (
        max(r["sent_s"] for r in done["warmup"]) < 0 <= min(r["sent_s"] for r in done["requests"])
    )
    (cell,) = record["cells"]
    assert cell["requests"] == 3
    assert cell["completion_tokens"] == 3 * 5


def test_chat_turns_extend_the_last(fake_server, prompts_file):
    fake, url = fake_server
    fake.reset()
    turns = 3
    record = run_serving_bench(
        config(url, prompts_file("first", "second"), modes=("chat",), turns=turns), log=quiet
    )
    chats = [e for e in fake.state.log if e["chat"]]
    assert len(chats) == 2 * turns
    conversations: dict[str, list[dict]] = {}
    for e in chats:
        conversations.setdefault(e["body"]["messages"][0]["content"], []).append(e)
    assert len(conversations) == 2
    for opening, sent in conversations.items():
        assert opening.startswith("# ") and opening.endswith(("first", "second"))
        sent.sort(key=lambda e: len(e["body"]["messages"]))
        for turn in range(1, turns):
            before, now = sent[turn - 1], sent[turn]
            assert now["body"]["messages"] == [
                *before["body"]["messages"],
                {"role": "assistant", "content": before["text"]},
                {"role": "user", "content": FOLLOW_UPS[turn - 1]},
            ]
    (cell,) = record["cells"]
    assert cell["requests"] == 2 * turns
    assert sorted(r["turn"] for r in record["passes"][0]["requests"]) == [0, 0, 1, 1, 2, 2]


def test_refused_requests_are_counted_and_fail_the_command(fake_server, prompts_file, tmp_path):
    fake, url = fake_server
    fake.reset()
    prompts = prompts_file("fine", "FAIL here", "also fine", "CUT here")
    out = tmp_path / "run"
    argv = ["bench-serve", "--label", f"fake={url}", "--prompts", prompts, "--concurrency", "2"]
    argv += ["--max-tokens", "4", "--modes", "new", "--out", str(out), "--quiet"]
    assert main(argv) == 1
    record = json.loads((out / "record.json").read_text())
    (cell,) = record["cells"]
    assert (cell["requests"], cell["errors"]) == (2, 2)
    assert cell["completion_tokens"] == 2 * 4  # the measured figures leave the failed out
    refused, cut = sorted(
        (r for r in record["passes"][0]["requests"] if "error" in r), key=lambda r: r["error"]
    )
    assert refused["error"].startswith("HTTP 400") and "refused by the fake" in refused["error"]
    assert "cut off" in cut["error"]
    assert cut["completion_tokens"] == 2  # what it was served is still recorded
    assert not record["ok"]
    assert (out / "table.md").read_text().startswith("# specdecode bench-serve")
    assert (out / "serving.png").stat().st_size > 0


def test_report_without_plots_writes_record_and_table(fake_server, prompts_file, tmp_path):
    fake, url = fake_server
    fake.reset()
    record = run_serving_bench(config(url, prompts_file("x"), concurrency=(1,)), log=quiet)
    written = write_serving_report(record, tmp_path / "r", plots=False)
    assert [p.name for p in written] == ["record.json", "table.md"]
    assert json.loads(written[0].read_text())["cells"] == record["cells"]


def test_an_unreachable_server_is_named(prompts_file, closed_port):
    port = closed_port
    with pytest.raises(RuntimeError, match="cannot reach server 'fake'"):
        run_serving_bench(
            config(f"http://127.0.0.1:{port}", prompts_file("x"), concurrency=(1,)), log=quiet
        )


def test_more_in_flight_than_prompts_is_refused(prompts_file):
    with pytest.raises(ValueError, match="concurrency 4 needs at least as many prompts"):
        run_serving_bench(config("http://127.0.0.1:1", prompts_file("a", "b"), concurrency=(1, 4)))


def test_server_specs():
    assert Server.parse("ours=http://127.0.0.1:8080/v1/") == Server("ours", "http://127.0.0.1:8080")
    assert Server.parse("http://localhost:8081").label == "localhost:8081"
    for bad in ("localhost:8081", "http://localhost:port", "ours=http://", "ours=ftp://x:1"):
        with pytest.raises(ValueError, match="expected http://HOST:PORT"):
            Server.parse(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"modes": ("new", "old")}, "unknown mode"),
        ({"concurrency": (0,)}, "concurrency levels must be >= 1"),
        ({"max_tokens": 0}, "max-tokens must be >= 1"),
        ({"turns": 0}, "turns must be between"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config("http://127.0.0.1:1", "humaneval", **kwargs)
    with pytest.raises(ValueError, match="labels must differ"):
        ServeBenchConfig(servers=(Server("a", "http://x:1"), Server("a", "http://x:2")))


def test_percentiles_are_ordered_and_within_the_values():
    values = [0.3, 0.1, 2.5, 0.2, 0.9, 0.15, 0.4]
    got = percentiles(values)
    assert min(values) <= got["p50"] <= got["p99"] <= max(values)
    assert got["p50"] == sorted(values)[3]
    assert percentiles([]) is None
    assert percentiles([0.5]) == {"p50": 0.5, "p99": 0.5}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "no server to drive"),
        (["--url", "localhost:8081"], "expected http://HOST:PORT"),
        (["--url", "http://127.0.0.1:{port}"], "cannot reach server '127.0.0.1:"),
        (["--url", "http://127.0.0.1:1", "--concurrency", "0"], "levels must be >= 1"),
        (["--url", "http://127.0.0.1:1", "--modes", "old"], r"unknown mode\(s\) \['old'\]"),
    ],
)
def test_cli_bad_input_is_one_named_error_exit_2(prompts_file, closed_port, capsys, extra, message):
    port = closed_port
    argv = ["bench-serve", "--prompts", prompts_file("a"), "--concurrency", "1", "--quiet"]
    assert main(argv + [a.format(port=port) for a in extra]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("specdecode bench-serve: error: ")
    assert re.search(message, captured.err), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
