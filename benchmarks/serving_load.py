"""Load and soak test of `specdecode serve`: under sustained overload nothing is lost.

A real server (SmolLM2-135M as target and drafter, llama.cpp) is started on a free loopback
port and driven with httpx at a concurrency well past its rows and queue, so it refuses much of
what it is sent. Every request carries a unique tag (its `user` field and its prompt's first
words), so each can be followed to exactly one end:

- answered in full: a finish_reason, and `completion_tokens == max_tokens` where it says
  "length" (at most max_tokens where it says "stop"); a stream also ends with its usage chunk
  and `[DONE]`, with no error event;
- refused: 429 with a Retry-After, after which the client retries (so a refusal delays an
  answer, it does not replace it);
- disconnected by the client: about one in ten clients goes away on purpose, a stream after its
  first chunk, a non-streamed request after a short timeout.

Lost (neither an answer nor a refusal) and duplicated (two answers for one tag, or one response
id twice) must both be 0. The server's `/metrics` counters must equal the sums over the answers:
the server counts a request in `request_success_total`, `prompt_tokens_total` and
`generation_tokens_total` only when its row ends (a cancelled row is not counted at all), so a
disconnected request adds nothing there. Disconnecting clients ask for many more tokens
(`DISCONNECT_TOKENS`, `ignore_eos`, no stop string) than can be made before the server notices
them gone, so none of them can end on the server's side first. What a cancelled row drafted
before it left is still counted in `spec_decode_num_draft_tokens_total` (rounds are counted as
they are delivered); that excess is recorded, not asserted equal.

The server's RSS is read after warm-up and after the run: a bounded cache that fills while
serving would read as drift, so the prefix cache is kept small (`--prefix-cache-mib`, filled
during warm-up) and the figure measures everything else. Last, a second burst is sent and
SIGTERM arrives while it runs: every request of it must be answered in full or refused cleanly
(429, 503 shutting_down, or a connection the server closed or reset before answering), the
server must exit 0, and the answers it counts in its last log line must be those its clients
received.

`tests/test_serve_load.py` runs a short version through the same functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m"
PROMPTS = (
    "def add(a, b):",
    "The capital of France is",
    "Once upon a time",
    "import numpy as np\n",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "SELECT * FROM",
    "Dear Sir,",
)
CHAT_LINES = (
    "Say hello.",
    "Name a colour.",
    "Write one line of Python.",
    "What is two plus two?",
)
# Far more tokens than a row makes before its client's disconnect is seen, so a disconnected
# request never ends on the server's side (where it would be counted) before it is cancelled.
DISCONNECT_TOKENS = 400
COUNTERS = (
    "request_success_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


@dataclass(frozen=True)
class Plan:
    """One request as the client means to send it, decided up front from a seeded generator
    so that a run can be repeated."""

    tag: str
    chat: bool
    stream: bool
    sampled: bool
    max_tokens: int
    disconnect: bool
    stop: str | None = None
    timeout: float = 0.0  # a non-streamed disconnecting client's patience, in seconds

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "user": self.tag,
            "temperature": 0.8 if self.sampled else 0.0,
        }
        seed = int(self.tag.rsplit("-", 1)[-1])
        if self.sampled:
            body["seed"] = seed
        if self.chat:
            line = CHAT_LINES[seed % len(CHAT_LINES)]
            body["messages"] = [{"role": "user", "content": f"[{self.tag}] {line}"}]
        else:
            body["prompt"] = f"[{self.tag}] {PROMPTS[seed % len(PROMPTS)]}"
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if self.stop:
            body["stop"] = [self.stop]
        if self.disconnect:
            body["ignore_eos"] = True
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def plans(
    count: int,
    prefix: str,
    rng: random.Random,
    disconnect_share: float = 0.1,
    tokens: tuple[int, int] = (4, 24),
) -> list[Plan]:
    """`count` requests: completions and chat, streamed or not, greedy or seeded-sampled, a
    fifth with a stop string, `disconnect_share` of them leaving early."""
    out = []
    for i in range(count):
        disconnect = rng.random() < disconnect_share
        stream = rng.random() < 0.5
        out.append(
            Plan(
                tag=f"{prefix}-{i}",
                chat=rng.random() < 0.4,
                stream=stream,
                sampled=rng.random() < 0.5,
                max_tokens=DISCONNECT_TOKENS if disconnect else rng.randint(*tokens),
                disconnect=disconnect,
                # no stop string for a leaver: one could end its row before it leaves
                stop="\n\n" if rng.random() < 0.2 and not disconnect else None,
                timeout=rng.uniform(0.2, 0.8) if disconnect and not stream else 0.0,
            )
        )
    return out


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    tag: str
    stream: bool
    chat: bool
    max_tokens: int
    started: bool = False  # a 200's headers arrived: a connection error after is a loss
    end: str = "lost"  # answered | disconnected | refused | lost
    detail: str = ""  # why it was refused or lost
    refusals: int = 0  # 429s before the end
    refusals_without_retry_after: int = 0
    answers: int = 0  # complete answers received for this tag (must be at most 1)
    ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0
    ended_at: float = 0.0  # time.monotonic() at the end


def _take_answer(out: Outcome, plan: Plan, body: dict[str, Any], finish: str | None) -> None:
    """Record a complete answer's counts; an answer that is not complete is lost."""
    usage = body.get("usage") or {}
    spec = (body.get("metrics") or {}).get("speculative_decoding") or {}
    out.answers += 1
    out.ids.append(body.get("id", ""))
    out.finish_reason = finish
    out.prompt_tokens = int(usage.get("prompt_tokens", 0))
    out.completion_tokens = int(usage.get("completion_tokens", -1))
    out.draft_tokens = int(spec.get("num_draft_tokens", 0))
    out.accepted_tokens = int(spec.get("num_accepted_tokens", 0))
    out.spec_steps = int(spec.get("num_spec_steps", 0))
    full = (finish == "length" and out.completion_tokens == plan.max_tokens) or (
        finish == "stop" and 0 <= out.completion_tokens <= plan.max_tokens
    )
    if full and usage:
        out.end = "answered"
    else:
        out.end, out.detail = "lost", f"incomplete answer: {finish=} {usage=}"


async def _streamed(client: httpx.AsyncClient, plan: Plan, out: Outcome) -> httpx.Response | None:
    """A streamed request: None when it ended (answered, disconnected or lost), else the
    non-200 response to act on."""
    async with client.stream("POST", plan.path, json=plan.body()) as r:
        if r.status_code != 200:
            await r.aread()
            return r
        out.started = True
        finish, last, done, seen = None, None, False, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            seen += 1
            if plan.disconnect:  # leave after the first chunk: closing drops the connection
                out.end = "disconnected"
                return None
            if line == "data: [DONE]":
                done = True
                break
            piece = json.loads(line[6:])
            if "error" in piece:
                out.end, out.detail = "lost", f"error event: {piece['error']}"
                return None
            for choice in piece.get("choices", []):
                finish = choice.get("finish_reason") or finish
            last = piece
        if not done or last is None or last.get("choices"):
            out.end, out.detail = "lost", f"the stream ended without usage and [DONE] ({seen})"
            return None
        _take_answer(out, plan, last, finish)
        return None


async def _whole(client: httpx.AsyncClient, plan: Plan, out: Outcome) -> httpx.Response | None:
    """A non-streamed request, given up after `plan.timeout` by a disconnecting client."""
    send = client.post(plan.path, json=plan.body())
    try:
        r = await (asyncio.wait_for(send, plan.timeout) if plan.disconnect else send)
    except TimeoutError:  # cancelled mid-request: httpx closes the connection
        out.end = "disconnected"
        return None
    if r.status_code != 200:
        return r
    body = r.json()
    _take_answer(out, plan, body, body["choices"][0].get("finish_reason"))
    return None


async def send(
    client: httpx.AsyncClient, plan: Plan, retry: bool = True, patience: float = 600.0
) -> Outcome:
    """One request to its end. A 429 is retried after its Retry-After while `retry` holds; any
    other answer than 200 or 429 ends it (as refused where it is a clean 503 shutting_down,
    else as lost), as does an error of the connection: refused where the server closed or reset
    it before any answer began (a draining server may, with a request it had not read), lost
    where a stream had begun. A non-streamed request's answer begins only when it is whole, so
    its client cannot tell a request the server never read from one it dropped: the drain's
    check against the server's own count of answers tells them apart."""
    out = Outcome(plan.tag, plan.stream, plan.chat, plan.max_tokens)
    deadline = time.monotonic() + patience
    while True:
        try:
            r = await (_streamed if plan.stream else _whole)(client, plan, out)
        except (
            httpx.ConnectError,
            httpx.RemoteProtocolError,
            httpx.ReadError,
            httpx.WriteError,
        ) as error:
            if out.started:
                out.end, out.detail = "lost", f"cut mid-answer: {type(error).__name__}"
            else:
                out.end, out.detail = "refused", f"closed unanswered: {type(error).__name__}"
            break
        except httpx.HTTPError as error:
            out.end, out.detail = "lost", f"{type(error).__name__}: {error}"
            break
        if r is None:
            break
        if r.status_code == 429:
            out.refusals += 1
            wait = r.headers.get("retry-after")
            if wait is None:
                out.refusals_without_retry_after += 1
            if retry and time.monotonic() < deadline:
                await asyncio.sleep(float(wait or 1))
                continue
            out.end, out.detail = "refused", "429"
            break
        code = _error_code(r)
        if r.status_code == 503 and code == "shutting_down":
            out.end, out.detail = "refused", "503 shutting_down"
        else:
            out.end, out.detail = "lost", f"{r.status_code} {code}: {r.text[:200]}"
        break
    out.ended_at = time.monotonic()
    return out


def _error_code(r: httpx.Response) -> str | None:
    try:
        return (r.json().get("error") or {}).get("code")
    except ValueError:
        return None


async def drive(url: str, batch: list[Plan], concurrency: int, retry: bool = True) -> list[Outcome]:
    """Every plan through `concurrency` clients, each holding its place while it waits out a
    Retry-After (a client that is told to wait is still a client)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(plan: Plan) -> Outcome:
            async with gate:
                return await send(client, plan, retry)

        return list(await asyncio.gather(*(one(p) for p in batch)))


def tally(outcomes: list[Outcome]) -> dict[str, Any]:
    """The counts a run is judged by."""
    ends = {e: sum(o.end == e for o in outcomes) for e in ("answered", "disconnected", "refused")}
    answered = [o for o in outcomes if o.end == "answered"]
    ids = [i for o in outcomes for i in o.ids]
    return {
        "sent": len(outcomes),
        **ends,
        "lost": sum(o.end == "lost" for o in outcomes),
        "lost_examples": [f"{o.tag}: {o.detail}" for o in outcomes if o.end == "lost"][:5],
        "refusals_429": sum(o.refusals for o in outcomes),
        "requests_refused_at_least_once": sum(o.refusals > 0 for o in outcomes),
        "refusals_without_retry_after": sum(o.refusals_without_retry_after for o in outcomes),
        "refused_detail": sorted({o.detail for o in outcomes if o.end == "refused"}),
        "duplicated": sum(max(0, o.answers - 1) for o in outcomes) + len(ids) - len(set(ids)),
        "streamed": sum(o.stream for o in outcomes),
        "chat": sum(o.chat for o in outcomes),
        "answered_finish_stop": sum(o.finish_reason == "stop" for o in answered),
        "answered_finish_length": sum(o.finish_reason == "length" for o in answered),
        "answered_prompt_tokens": sum(o.prompt_tokens for o in answered),
        "answered_completion_tokens": sum(o.completion_tokens for o in answered),
        "answered_draft_tokens": sum(o.draft_tokens for o in answered),
        "answered_accepted_tokens": sum(o.accepted_tokens for o in answered),
        "answered_spec_steps": sum(o.spec_steps for o in answered),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specdecode serve` in a subprocess on a free loopback port, its stderr in a file (a
    pipe nobody reads would fill and stall it under load)."""

    def __init__(
        self,
        max_batch: int,
        max_queue: int,
        threads: int = 1,
        prefix_cache_mib: int = 8,
        context: int = 512,
        drain_seconds: float = 60.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable, "-m", "specdecode.cli", "serve", "--target", MODEL, "--draft", MODEL,
            "--port", str(self.port), "--max-batch", str(max_batch), "--max-queue",
            str(max_queue), "--drafting", "model", "--length-policy", "constant",
            "--num-draft-tokens", "3", "--context", str(context), "--prefix-cache-mib",
            str(prefix_cache_mib), "--drain-seconds", str(drain_seconds),
            "--log-level", "warning", "--threads", str(threads),
        ]  # fmt: skip
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed with the server)
        self.proc = subprocess.Popen(self.command, stderr=self.log, text=True)

    def wait_ready(self, limit: float = 300.0) -> None:
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.stderr()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready in {limit:g} s")
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """Every `specdecode:` sample, labels kept in the name as Prometheus writes them."""
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("specdecode:"):
                name, value = line.rsplit(" ", 1)
                out[name.removeprefix("specdecode:")] = float(value)
        return out

    def counters(self) -> dict[str, float]:
        """The counters compared with the answers' sums, labelled ones summed over labels."""
        samples = self.metrics()
        out = {n: sum(v for k, v in samples.items() if k.split("{")[0] == n) for n in COUNTERS}
        for reason in ("stop", "length"):
            out[f"request_success_total[{reason}]"] = samples.get(
                f'request_success_total{{finished_reason="{reason}"}}', 0.0
            )
        return out

    def settle(self, limit: float = 60.0) -> dict[str, float]:
        """Wait until no request runs or waits (cancelled rows leave at the next round)."""
        deadline = time.monotonic() + limit
        while True:
            samples = self.metrics()
            idle = samples.get("num_requests_running") == 0 == samples.get("num_requests_waiting")
            if idle or time.monotonic() > deadline:
                return {
                    k: samples.get(k, -1.0)
                    for k in ("num_requests_running", "num_requests_waiting")
                }
            time.sleep(0.2)

    def rss_kib(self) -> int:
        """The server's resident memory (VmRSS), from /proc."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def check_metrics(before: dict[str, float], after: dict[str, float], t: dict[str, Any]) -> dict:
    """Each counter's rise beside the answers' sum. The finished-request and token counters
    must equal them; the drafting counters rise by at least them (what disconnected rows
    drafted before they left is counted too)."""
    rise = {k: after[k] - before[k] for k in after}
    pairs = {
        "request_success_total": t["answered"],
        "request_success_total[stop]": t["answered_finish_stop"],
        "request_success_total[length]": t["answered_finish_length"],
        "prompt_tokens_total": t["answered_prompt_tokens"],
        "generation_tokens_total": t["answered_completion_tokens"],
    }
    at_least = {
        "spec_decode_num_drafts_total": t["answered_spec_steps"],
        "spec_decode_num_draft_tokens_total": t["answered_draft_tokens"],
        "spec_decode_num_accepted_tokens_total": t["answered_accepted_tokens"],
    }
    return {
        "equal": {k: {"metric": rise[k], "answers": v} for k, v in pairs.items()},
        "at_least": {k: {"metric": rise[k], "answers": v} for k, v in at_least.items()},
        "equal_ok": all(rise[k] == v for k, v in pairs.items()),
        "at_least_ok": all(rise[k] >= v for k, v in at_least.items()),
    }


def drain_under_load(
    server: Server, batch: list[Plan], concurrency: int, after_answers: int
) -> dict[str, Any]:
    """Send `batch` and SIGTERM the server once `after_answers` of it are answered (so rows
    are running and the queue is full when the signal lands); then every request must end
    answered in full or refused cleanly, the server exit 0, and the answers it counted in its
    last words be those its clients received."""
    start = server.counters()["request_success_total"]

    async def main() -> tuple[list[Outcome], float]:
        task = asyncio.create_task(drive(server.url, batch, concurrency, retry=True))
        # answers are counted from the outcomes' side: poll the server's finished counter
        while not task.done():
            done = await asyncio.to_thread(lambda: server.counters()["request_success_total"])
            if done - start >= after_answers:
                break
            await asyncio.sleep(0.05)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        return await task, signalled

    outcomes, signalled = asyncio.run(main())
    try:
        code = server.proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None
    t = tally(outcomes)
    late = [o for o in outcomes if o.end == "answered" and o.ended_at > signalled]
    last = re.findall(r"\[serve\] drained: (\d+) request\(s\) answered", server.stderr())
    return {
        **{k: t[k] for k in ("sent", "answered", "refused", "lost", "duplicated", "lost_examples")},
        # what the server says it answered of this burst (None: it did not say)
        "server_answered": int(last[-1]) - int(start) if last else None,
        "refused_detail": t["refused_detail"],
        "answered_after_sigterm": len(late),
        "exit_code": code,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole test: warm-up, the measured load, RSS, then the drain. Returns the record."""
    rng = random.Random(args.seed)
    server = Server(
        args.max_batch, args.max_queue, args.threads, args.prefix_cache_mib, args.context
    )
    began = time.monotonic()
    try:
        server.wait_ready()
        record: dict[str, Any] = {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_command": " ".join(["python", *sys.argv]),
            "server_command": " ".join(server.command[1:]),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "startup_s": round(time.monotonic() - began, 1),
        }
        warmup = plans(args.warmup, "warm", rng, 0.0, tuple(args.tokens))
        warm = asyncio.run(drive(server.url, warmup, args.max_batch))
        record["warmup"] = {k: tally(warm)[k] for k in ("sent", "answered", "lost")}
        server.settle()
        rss_warm = server.rss_kib()
        before = server.counters()
        batch = plans(args.requests, "load", rng, args.disconnect_share, tuple(args.tokens))
        t0 = time.monotonic()
        outcomes = asyncio.run(drive(server.url, batch, args.concurrency))
        load_s = time.monotonic() - t0
        idle = server.settle()
        after = server.counters()
        rss_after = server.rss_kib()
        t = tally(outcomes)
        record["load"] = {**t, "seconds": round(load_s, 1), "idle_after": idle}
        record["metrics"] = check_metrics(before, after, t)
        drift = 100 * (rss_after - rss_warm) / rss_warm
        record["rss"] = {
            "after_warmup_kib": rss_warm,
            "after_load_kib": rss_after,
            "drift_percent": round(drift, 2),
        }
        drain = plans(args.drain_requests, "drain", rng, 0.0, tuple(args.tokens))
        record["drain"] = drain_under_load(server, drain, args.concurrency, args.max_batch)
        log = server.stderr()  # read before `stop` closes it
        record["server_log"] = {
            "tracebacks": log.count("Traceback"),
            "error_lines": sum(" ERROR" in x or "ERROR:" in x for x in log.splitlines()),
            "tail": log.splitlines()[-5:],
        }
    finally:
        server.stop()
    d = record["drain"]
    record["checks"] = {
        "lost == 0": t["lost"] == 0,
        "duplicated == 0": t["duplicated"] == 0,
        "every 429 had Retry-After": t["refusals_without_retry_after"] == 0,
        "sent == answered + disconnected": t["sent"] == t["answered"] + t["disconnected"],
        "metrics equal the answers' sums": record["metrics"]["equal_ok"],
        "drafting metrics at least the answers' sums": record["metrics"]["at_least_ok"],
        "idle after the load": idle == {"num_requests_running": 0, "num_requests_waiting": 0},
        f"RSS drift within {args.rss_tolerance:g}%": abs(drift) <= args.rss_tolerance,
        "drain: nothing lost": d["lost"] == 0 and d["duplicated"] == 0,
        "drain: the server answered what its clients received": (
            d["server_answered"] == d["answered"]
        ),
        "drain: exit code 0": d["exit_code"] == 0,
    }
    record["ok"] = all(record["checks"].values())
    return record


def table(record: dict[str, Any]) -> str:
    """The record's figures as a short Markdown table."""
    t, r, d = record["load"], record["rss"], record["drain"]
    m = record["metrics"]["equal"]
    rows = [
        ("requests sent", t["sent"]),
        ("answered in full", t["answered"]),
        ("disconnected by the client", t["disconnected"]),
        ("429 refusals (requests refused at least once)",
         f"{t['refusals_429']} ({t['requests_refused_at_least_once']})"),
        ("429 without Retry-After", t["refusals_without_retry_after"]),
        ("lost", t["lost"]),
        ("duplicated", t["duplicated"]),
        ("request_success_total rise / answers",
         f"{m['request_success_total']['metric']:g} / {m['request_success_total']['answers']}"),
        ("generation_tokens_total rise / answers' completion_tokens",
         f"{m['generation_tokens_total']['metric']:g} / {m['generation_tokens_total']['answers']}"),
        ("prompt_tokens_total rise / answers' prompt_tokens",
         f"{m['prompt_tokens_total']['metric']:g} / {m['prompt_tokens_total']['answers']}"),
        ("load duration (s)", t["seconds"]),
        ("RSS after warm-up → after load (MiB)",
         f"{r['after_warmup_kib'] / 1024:.1f} → {r['after_load_kib'] / 1024:.1f} "
         f"({r['drift_percent']:+.2f}%)"),
        ("SIGTERM burst: sent / answered / refused / lost",
         f"{d['sent']} / {d['answered']} / {d['refused']} / {d['lost']}"),
        ("SIGTERM burst: answered after the signal", d["answered_after_sigterm"]),
        ("SIGTERM burst: answered by the server's count", d["server_answered"]),
        ("server exit code after the drain", d["exit_code"]),
    ]  # fmt: skip
    lines = ["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    checks = ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in record["checks"].items())
    return "\n".join([*lines, "", f"Checks: {checks}.", ""])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests of the measured load")
    p.add_argument("--concurrency", type=int, default=32, help="clients at once")
    p.add_argument("--max-batch", type=int, default=4, help="the server's rows")
    p.add_argument("--max-queue", type=int, default=8, help="the server's waiting requests")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    p.add_argument("--warmup", type=int, default=40, help="requests before RSS is first read")
    p.add_argument("--drain-requests", type=int, default=64, help="the SIGTERM burst's requests")
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument(
        "--tokens",
        type=int,
        nargs=2,
        default=(4, 24),
        metavar=("LOW", "HIGH"),
        help="max_tokens drawn from LOW..HIGH (disconnecting clients ask for more)",
    )
    p.add_argument(
        "--prefix-cache-mib", type=int, default=8, help="kept small: it fills during warm-up"
    )
    p.add_argument("--context", type=int, default=512, help="tokens per row")
    p.add_argument("--rss-tolerance", type=float, default=5.0, help="percent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving-load"))
    return p


def main() -> int:
    args = parser().parse_args()
    record = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "table.md").write_text(table(record))
    print(table(record))
    print(f"{'all checks passed' if record['ok'] else 'SOME CHECKS FAILED'}; record in {args.out}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
