"""`specdecode bench-serve`: OpenAI-compatible servers driven over HTTP at fixed concurrency.

The same load goes to every server (ours, llama-server, llama-cpp-python's server): streamed,
greedy requests, so that the time to the first token is seen, and nothing a peer might not
honour: outputs end where each server's model ends them, and every figure counts the tokens
actually served. Greedy texts of a quantized model move with the batch's shape, so two servers
(or two passes of one) can serve texts of different lengths and tokens/s then weighs unequal
work: `ignore_eos` (vLLM's extension, honoured by llama-server and ours) runs every request to
`max_tokens`, the same work on every server. Three modes ask different questions of a server:

- `new`: every prompt begins with a random tag of its own, so no prompt cache helps; this
  measures batching alone.
- `seen`: the prompts are sent once to warm, at the same concurrency, then measured; this
  measures prefix reuse (llama-server keeps each slot's last prompt, ours its cached prefixes).
- `chat`: conversations on `/v1/chat/completions` where each turn is the last turn's messages,
  its answer and one more user line; the first message carries a fresh tag, so only reuse
  within a conversation helps.

Servers are interleaved at each concurrency level (A B A B over `repeats`), so slow drifts of a
shared machine fall on all of them alike; with `waves`, they take turns wave by wave within a pass
(`concurrency` prompts a wave), for a VM whose steps slow by a third for tens of seconds. A pass is
one server x mode x concurrency x repeat; a cell pools a server's repeats of one mode and level.
Completion tokens come from the stream's `usage` chunk (`stream_options.include_usage`), else from
llama-server's `timings`, else from the number of chunks with text (llama-cpp-python's server sends
no usage when streaming; a chunk is one token there, bar characters split over tokens); each request
records which. Acceptance comes from `metrics.speculative_decoding` (ours, vLLM) or
`timings.draft_n` / `draft_n_accepted` (llama-server) where the server sends them.
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specdecode.prompts import Prompt, require_prompts

# The user lines that extend a conversation, one per turn after the first, in this order: they
# suit code and open questions alike and ask for a full answer each time.
FOLLOW_UPS = (
    "Make it shorter.",
    "Now explain what it does, step by step.",
    "Rewrite it once more, with comments.",
    "Summarise the conversation so far in three sentences.",
)
WARMUP_TOKENS = 8  # the one request per server that wakes it before anything is measured


@dataclass(frozen=True)
class Server:
    """A server under test: `url` is its root (`http://host:port`), `/v1` added per route."""

    label: str
    url: str
    model: str | None = None  # the `model` field sent; None: the first id of `/v1/models`

    @staticmethod
    def parse(spec: str) -> Server:
        """`label=url` or a bare url, labelled by its host and port."""
        label, sep, url = spec.partition("=")
        if not sep or "://" in label:  # a bare url (which may hold a '=' of its own)
            label, url = "", spec
        parts = urlsplit(url.strip())
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise ValueError(
                f"server {spec!r}: expected http://HOST:PORT (optionally LABEL=http://HOST:PORT)"
            )
        root = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"
        return Server(label=label.strip() or parts.netloc, url=root)


@dataclass(frozen=True)
class ServeBenchConfig:
    servers: tuple[Server, ...]
    prompts: str = "humaneval"
    limit: int = 16
    skip: int = 0
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    max_tokens: int = 128
    modes: tuple[str, ...] = ("new", "seen", "chat")
    turns: int = 3  # requests per conversation in `chat`
    repeats: int = 1  # passes of each server per mode and level, interleaved A B A B
    api_key: str | None = None
    timeout_s: float = 600.0  # the longest wait for a server's next bytes
    ignore_eos: bool = False  # every request runs to max_tokens (equal work)
    # each pass cut into waves of `concurrency` prompts, the servers taking turns wave by wave
    waves: bool = False

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("no server to drive: give --url URL or --label NAME=URL")
        labels = [s.label for s in self.servers]
        if len(set(labels)) != len(labels):
            raise ValueError(f"server labels must differ, got {labels}; name them --label NAME=URL")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"unknown mode(s) {unknown or self.modes}; choose from {list(MODES)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {list(self.concurrency)}")
        for name in ("max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if not 1 <= self.turns <= len(FOLLOW_UPS) + 1:
            raise ValueError(f"turns must be between 1 and {len(FOLLOW_UPS) + 1}, got {self.turns}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")


# ---- one request ----


def _tagged(text: str) -> tuple[str, str]:
    """The text behind a tag of its own (a code comment, harmless to code and prose alike),
    and the tag: no two requests share more than the comment sign, so no cache helps."""
    tag = uuid.uuid4().hex[:8]
    return f"# {tag}\n{text}", tag


@dataclass
class Client:
    """One server's HTTP client: the streamed requests, each timed from send to its last chunk."""

    http: Any  # httpx.AsyncClient
    server: Server
    model: str
    max_tokens: int
    ignore_eos: bool = False
    clock_zero: float = field(default_factory=time.perf_counter)

    async def complete(self, prompt: str, **record: Any) -> dict:
        return await self._stream("/v1/completions", {"prompt": prompt}, record)

    async def chat(self, messages: list[dict], **record: Any) -> dict:
        return await self._stream("/v1/chat/completions", {"messages": messages}, record)

    async def _stream(self, route: str, body: dict, record: dict) -> dict:
        """Send, read the server-sent events, return the request's raw figures (and its text
        under `text`, for a conversation's next turn). A failure is recorded, not raised: one
        refused request must not end a long run, and the table counts them."""
        import httpx

        body = {
            "model": self.model,
            **body,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        sent = time.perf_counter()
        first = None
        pieces: list[str] = []
        chunks = 0
        finals: dict[str, Any] = {}
        out: dict[str, Any] = {**record, "sent_s": sent - self.clock_zero}
        try:
            async with self.http.stream("POST", self.server.url + route, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                    return {**out, "error": f"HTTP {resp.status_code}: {detail}"}
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return {**out, "error": f"in the stream: {chunk['error']}"}
                    text = _chunk_text(chunk)
                    if text:
                        first = first or time.perf_counter()
                        pieces.append(text)
                        chunks += 1
                    for key in ("usage", "timings", "metrics"):
                        if chunk.get(key):
                            finals[key] = chunk[key]
                    reason = (chunk.get("choices") or [{}])[0].get("finish_reason")
                    if reason:
                        finals["finish_reason"] = reason
        except (httpx.HTTPError, json.JSONDecodeError) as err:
            return {**out, "error": f"{type(err).__name__}: {err}"}
        end = time.perf_counter()
        out |= _counts(finals, chunks)
        if "finish_reason" not in finals:  # served in part: its figures would flatter the server
            return {**out, "error": "the stream ended without a finish_reason (cut off)"}
        return {
            **out,
            "ttft_s": None if first is None else first - sent,
            "e2e_s": end - sent,
            "finish_reason": finals["finish_reason"],
            "text": "".join(pieces),
        }


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def _counts(finals: dict, chunks: int) -> dict:
    """Tokens and acceptance from whatever the server sent at the end of its stream."""
    usage, timings = finals.get("usage") or {}, finals.get("timings") or {}
    spec = (finals.get("metrics") or {}).get("speculative_decoding") or {}
    if usage.get("completion_tokens") is not None:
        tokens, source = usage["completion_tokens"], "usage"
    elif timings.get("predicted_n") is not None:
        tokens, source = timings["predicted_n"], "timings"
    else:
        tokens, source = chunks, "chunks"
    out = {
        "completion_tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens", timings.get("prompt_n")),
        "tokens_from": source,
        "chunks": chunks,
    }
    if spec:
        out.update(
            drafted=spec.get("num_draft_tokens"),
            accepted=spec.get("num_accepted_tokens"),
            spec_steps=spec.get("num_spec_steps"),
        )
    elif "draft_n" in timings:
        out.update(drafted=timings["draft_n"], accepted=timings.get("draft_n_accepted"))
    return out


# ---- the modes: what a pass sends ----

Job = Callable[[], Awaitable[list[dict]]]


@dataclass(frozen=True)
class Mode:
    """What one pass sends: `jobs` (one per prompt, run `concurrency` at a time; a job is one
    request, or a conversation's turns one after another), and with `warm`, the same prompts
    once before, at the same concurrency, not counted."""

    name: str
    warm: bool
    jobs: Callable[[Client, Sequence[Prompt], int], list[Job]]


def _single_jobs(tagged: bool) -> Callable[[Client, Sequence[Prompt], int], list[Job]]:
    def jobs(client: Client, prompts: Sequence[Prompt], turns: int) -> list[Job]:
        def job(p: Prompt) -> Job:
            async def run() -> list[dict]:
                text, tag = _tagged(p.text) if tagged else (p.text, None)
                return [await client.complete(text, prompt_id=p.id, tag=tag)]

            return run

        return [job(p) for p in prompts]

    return jobs


def _chat_jobs(client: Client, prompts: Sequence[Prompt], turns: int) -> list[Job]:
    def job(p: Prompt) -> Job:
        async def run() -> list[dict]:
            text, tag = _tagged(p.text)
            messages = [{"role": "user", "content": text}]
            done = []
            for turn in range(turns):
                if turn:
                    answer = done[-1].get("text", "")
                    messages = [
                        *messages,
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": FOLLOW_UPS[turn - 1]},
                    ]
                done.append(await client.chat(messages, prompt_id=p.id, tag=tag, turn=turn))
                if "error" in done[-1]:
                    break  # the next turn needs this one's answer
            return done

        return run

    return [job(p) for p in prompts]


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("new", warm=False, jobs=_single_jobs(tagged=True)),
        Mode("seen", warm=True, jobs=_single_jobs(tagged=False)),
        Mode("chat", warm=False, jobs=_chat_jobs),
    )
}


async def _pool(jobs: Sequence[Job], concurrency: int) -> list[dict]:
    """Run `jobs` with `concurrency` of them in flight, a new one starting as one ends."""
    queue = deque(jobs)
    done: list[dict] = []

    async def worker() -> None:
        while queue:
            done.extend(await queue.popleft()())

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
    return sorted(done, key=lambda r: r["sent_s"])


# ---- figures ----


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """p50 and p99 (linear between order statistics); None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return {"p50": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p99": cuts[98]}


def cell_figures(passes: Sequence[dict]) -> dict:
    """One server x mode x concurrency from its passes: rates over the passes' summed wall
    time, latencies over all their requests, acceptance where the server reported it, and each
    pass's own output rate (their spread says how far one pass can be trusted)."""
    requests = [r for p in passes for r in p["requests"]]
    served = [r for r in requests if "error" not in r]
    wall = sum(p["wall_s"] for p in passes)
    tokens = sum(r["completion_tokens"] for r in served)
    tpot = [
        (r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
        for r in served
        if r["ttft_s"] is not None and r["completion_tokens"] > 1
    ]
    drafted = [r for r in served if r.get("drafted") is not None]
    acceptance = None
    if drafted:
        n_drafted = sum(r["drafted"] for r in drafted)
        n_accepted = sum(r["accepted"] or 0 for r in drafted)
        steps = [r["spec_steps"] for r in drafted if r.get("spec_steps") is not None]
        acceptance = {
            "requests": len(drafted),
            "drafted": n_drafted,
            "accepted": n_accepted,
            "rate": n_accepted / n_drafted if n_drafted else None,
            "mean_acceptance_length": 1 + n_accepted / sum(steps) if sum(steps) else None,
        }
    return {
        "server": passes[0]["server"],
        "mode": passes[0]["mode"],
        "concurrency": passes[0]["concurrency"],
        "passes": len(passes),
        "requests": len(served),
        "errors": len(requests) - len(served),
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall if wall > 0 else None,
        "pass_tok_per_s": [_pass_rate(p) for p in passes],
        "requests_per_s": len(served) / wall if wall > 0 else None,
        "ttft_s": percentiles([r["ttft_s"] for r in served if r["ttft_s"] is not None]),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles([r["e2e_s"] for r in served]),
        "acceptance": acceptance,
        "tokens_from": sorted({r["tokens_from"] for r in served}),
    }


def _pass_rate(done: dict) -> float | None:
    tokens = sum(r["completion_tokens"] for r in done["requests"] if "error" not in r)
    return tokens / done["wall_s"] if done["wall_s"] > 0 else None


# ---- the run ----


async def _connect(
    http: Any, server: Server, max_tokens: int, ignore_eos: bool
) -> tuple[Client, dict]:
    """The server's model id and what it says of itself; a clear error if it does not answer."""
    import httpx

    try:
        resp = await http.get(server.url + "/v1/models")
    except httpx.HTTPError as err:
        raise RuntimeError(
            f"cannot reach server {server.label!r} at {server.url} ({type(err).__name__}: "
            f"{err}); start it first (docs/benchmarks.md, 'Serving')"
        ) from None
    if resp.status_code != 200:
        raise RuntimeError(
            f"server {server.label!r} at {server.url}: GET /v1/models answered "
            f"{resp.status_code} ({resp.text[:200]}); is it an OpenAI-compatible server, "
            "ready, and is --api-key right?"
        )
    try:
        models = [m.get("id") for m in resp.json().get("data", [])]
    except (ValueError, AttributeError):
        raise RuntimeError(
            f"server {server.label!r} at {server.url}: GET /v1/models did not answer the "
            f"OpenAI model list ({resp.text[:200]!r}); is it an OpenAI-compatible server?"
        ) from None
    model = server.model or (models[0] if models else None)
    if model is None:
        raise RuntimeError(f"server {server.label!r} at {server.url} lists no model")
    about: dict[str, Any] = {**asdict(server), "model": model, "models": models}
    try:  # llama-server describes its build and slots here; other servers have no such route
        props = await http.get(server.url + "/props")
        if props.status_code == 200:
            keep = ("build_info", "total_slots", "model_path")
            about["props"] = {k: v for k, v in props.json().items() if k in keep}
    except (httpx.HTTPError, ValueError):
        pass
    client = Client(http, server, model, max_tokens, ignore_eos)
    return client, about


async def _pass(
    client: Client, mode: Mode, prompts: Sequence[Prompt], concurrency: int, cfg: ServeBenchConfig
) -> dict:
    warmup: list[dict] = []
    warm_zero = client.clock_zero = time.perf_counter()
    if mode.warm:
        warmup = await _pool(mode.jobs(client, prompts, cfg.turns), concurrency)
    client.clock_zero = time.perf_counter()
    for r in warmup:  # on the measured clock: the warm-up went before its zero
        r["sent_s"] -= client.clock_zero - warm_zero
    requests = await _pool(mode.jobs(client, prompts, cfg.turns), concurrency)
    wall = time.perf_counter() - client.clock_zero
    return {
        "server": client.server.label,
        "mode": mode.name,
        "concurrency": concurrency,
        "wall_s": wall,
        "warmup": [_without_text(r) for r in warmup],
        "requests": [_without_text(r) for r in requests],
    }


def _without_text(request: dict) -> dict:
    """A request's figures for the record: the texts are the server's business, not a timing."""
    return {k: v for k, v in request.items() if k != "text"}


async def _run(cfg: ServeBenchConfig, prompts: list[Prompt], log: Callable[[str], None]) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 2)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s), limits=limits, headers=headers
    ) as http:
        clients, servers = [], []
        for server in cfg.servers:
            client, about = await _connect(http, server, cfg.max_tokens, cfg.ignore_eos)
            text, tag = _tagged(prompts[0].text)
            waking = replace(client, max_tokens=min(WARMUP_TOKENS, cfg.max_tokens))
            warm = await waking.complete(text, prompt_id=prompts[0].id, tag=tag)
            if "error" in warm:
                raise RuntimeError(
                    f"server {server.label!r} refused the warm-up request: {warm['error']}"
                )
            about["warmup"] = [_without_text(warm)]
            clients.append(client)
            servers.append(about)
        passes = []
        for mode_name in cfg.modes:
            for concurrency in cfg.concurrency:
                step = concurrency if cfg.waves else len(prompts)
                parts = [prompts[i : i + step] for i in range(0, len(prompts), step)]
                for repeat in range(cfg.repeats):
                    done: dict[str, list[dict]] = {c.server.label: [] for c in clients}
                    for i, part in enumerate(parts):
                        # A B A B: drift falls on every server alike; the first of each wave
                        # alternates, so none always follows an idle machine
                        for client in clients if (i + repeat) % 2 == 0 else clients[::-1]:
                            wave = await _pass(client, MODES[mode_name], part, concurrency, cfg)
                            done[client.server.label].append(wave)
                    for client in clients:
                        joined = _joined(done[client.server.label])
                        joined["repeat"] = repeat
                        passes.append(joined)
                        log(_pass_line(joined))
    return {"servers": servers, "passes": passes}


def _joined(waves: list[dict]) -> dict:
    """One pass from its waves: their seconds added, each wave's requests sent after the
    waves before it on the pass's clock."""
    joined = {**waves[0], "wall_s": 0.0, "warmup": [], "requests": []}
    for wave in waves:
        for key in ("warmup", "requests"):
            joined[key] += [r | {"sent_s": r["sent_s"] + joined["wall_s"]} for r in wave[key]]
        joined["wall_s"] += wave["wall_s"]
    return joined


def _pass_line(done: dict) -> str:
    f = cell_figures([done])
    rate = "-" if f["output_tok_per_s"] is None else f"{f['output_tok_per_s']:.2f}"
    e2e = "-" if f["e2e_s"] is None else f"{f['e2e_s']['p50']:.2f}"
    failed = f", {f['errors']} failed" if f["errors"] else ""
    return (
        f"{done['server']} {done['mode']} c={done['concurrency']}: {f['requests']} requests, "
        f"{f['completion_tokens']} tokens, {rate} tok/s, end-to-end p50 {e2e} s{failed}"
    )


def run_serving_bench(cfg: ServeBenchConfig, log: Callable[[str], None] | None = None) -> dict:
    """Drive every server in `cfg` and return the record (see `write_serving_report`)."""
    try:
        import httpx
    except ImportError:
        raise RuntimeError(
            "bench-serve needs httpx: pip install 'httpx>=0.27' (or the project's dev extra)"
        ) from None
    from specdecode.bench.runner import machine_info

    prompts = require_prompts(cfg.prompts, limit=cfg.limit, skip=cfg.skip)
    if max(cfg.concurrency) > len(prompts):  # a pass runs a job per prompt: fewer never reach it
        raise ValueError(
            f"concurrency {max(cfg.concurrency)} needs at least as many prompts, and "
            f"{cfg.prompts!r} gives {len(prompts)} with --limit {cfg.limit} --skip {cfg.skip}; "
            "raise --limit or lower --concurrency"
        )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    run = asyncio.run(_run(cfg, prompts, log or (lambda line: print(line, file=sys.stderr))))
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for p in run["passes"]:
        groups.setdefault((p["server"], p["mode"], p["concurrency"]), []).append(p)
    cells = [cell_figures(group) for group in groups.values()]
    return {
        "kind": "serving",
        "config": asdict(cfg) | {"api_key": "(given)" if cfg.api_key else None},
        "machine": machine_info(),
        "versions": {
            "specdecode": version("specdecode"),
            "httpx": httpx.__version__,
            "python": platform.python_version(),
        },
        "started": started,
        "prompt_ids": [p.id for p in prompts],
        "servers": run["servers"],
        "cells": cells,
        "passes": run["passes"],
        "ok": not any(c["errors"] for c in cells),
    }


# ---- what a run leaves behind ----


def _rate(cell: dict) -> str:
    rate = cell["output_tok_per_s"]
    if rate is None:
        return "-"
    each = [r for r in cell["pass_tok_per_s"] if r is not None]
    spread = f" [{min(each):.2f}, {max(each):.2f}]" if len(each) > 1 else ""
    return f"{rate:.2f}{spread}"


def _ms(figures: dict | None) -> str:
    return "-" if figures is None else f"{1000 * figures['p50']:.0f} / {1000 * figures['p99']:.0f}"


def _acceptance(cell: dict) -> str:
    acc = cell["acceptance"]
    if acc is None or acc["rate"] is None:
        return "-"
    length = acc["mean_acceptance_length"]
    return f"{100 * acc['rate']:.1f}%" + ("" if length is None else f" ({length:.2f} per step)")


def serving_table(record: dict) -> str:
    cfg, machine = record["config"], record["machine"]
    n = cfg["max_tokens"]
    length = (
        f"exactly {n} tokens each (ignore_eos)" if cfg["ignore_eos"] else f"at most {n} tokens each"
    )
    lines = [
        "# specdecode bench-serve",
        "",
        f"Prompts: {cfg['prompts']} ({cfg['limit']} after the first {cfg['skip']}), {length}, "
        "greedy, streamed; "
        + (f"chat: {cfg['turns']} turns; " if "chat" in cfg["modes"] else "")
        + f"{cfg['repeats']} pass(es) of each server per mode and level, interleaved; "
        f"client machine: {machine['cpu']} ({machine['cores']} cores); {record['started']}.",
        "",
        "Servers: "
        + "; ".join(f"{s['label']} = {s['url']} (model {s['model']})" for s in record["servers"])
        + ".",
        "",
        "| server | mode | concurrency | requests | output tok/s | requests/s "
        "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | end-to-end p50 / p99 ms | acceptance "
        "| tokens from | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = [s["label"] for s in record["servers"]]

    def order(c: dict) -> tuple[int, int, int]:  # as run: modes, levels, then servers
        return cfg["modes"].index(c["mode"]), c["concurrency"], labels.index(c["server"])

    for c in sorted(record["cells"], key=order):
        rps = c["requests_per_s"]
        lines.append(
            f"| {c['server']} | {c['mode']} | {c['concurrency']} | {c['requests']} | "
            f"{_rate(c)} | {'-' if rps is None else f'{rps:.3f}'} | "
            f"{_ms(c['ttft_s'])} | {_ms(c['tpot_s'])} | {_ms(c['e2e_s'])} | {_acceptance(c)} | "
            f"{', '.join(c['tokens_from']) or '-'} | {c['errors']} |"
        )
    lines += [
        "",
        "Output tok/s: completion tokens over the passes' wall time (with several passes, the "
        "lowest and highest pass in brackets); TTFT: to the first chunk "
        "with text; TPOT: the rest of a request's time over its remaining tokens. Tokens from "
        "`usage` or `timings` are the server's count; from `chunks`, chunks with text.",
    ]
    return "\n".join(lines) + "\n"


def plot_serving(record: dict, out_dir: Path) -> Path:
    """Throughput and median end-to-end latency against concurrency, a line per server and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specdecode.bench.report import _save

    labels = [s["label"] for s in record["servers"]]
    styles = dict(zip(MODES, ("-", "--", ":"), strict=True))  # the line's style: its mode
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # its colour: its server
    levels = sorted({c["concurrency"] for c in record["cells"]})
    fig, (ax_rate, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    for i, server in enumerate(labels):
        for mode in record["config"]["modes"]:
            cells = sorted(
                (c for c in record["cells"] if (c["server"], c["mode"]) == (server, mode)),
                key=lambda c: c["concurrency"],
            )
            cells = [c for c in cells if c["e2e_s"]]  # a level where every request failed
            line = {"marker": "o", "ls": styles[mode], "color": colours[i % len(colours)]}
            xs = [c["concurrency"] for c in cells]
            ax_rate.plot(
                xs, [c["output_tok_per_s"] for c in cells], label=f"{server} {mode}", **line
            )
            ax_lat.plot(xs, [c["e2e_s"]["p50"] for c in cells], label=f"{server} {mode}", **line)
    ax_rate.set(xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput")
    ax_lat.set(xlabel="concurrent requests", ylabel="seconds", title="End-to-end latency, p50")
    for ax in (ax_rate, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out_dir / "serving.png", plt)


def write_serving_report(record: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    """record.json, table.md and serving.png, as `report.write_report` writes a bench run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "record.json").write_text(json.dumps(record, indent=1))
    (out_dir / "table.md").write_text(serving_table(record))
    written = [out_dir / "record.json", out_dir / "table.md"]
    return written + ([plot_serving(record, out_dir)] if plots else [])
