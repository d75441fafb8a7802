"""Faults stay where they start, on the real engine (PyTorch on tiny random models, llama.cpp on
SmolLM2-135M's GGUF): a row whose logits or law come out unusable fails alone (`RowFailed`)
while the other rows decode what they decode without it; a drafter model is never asked past
its own context, however long a row grows under the target's; an error of a round as a whole,
or of an admission, leaves no row in either model, and the next request decodes as before.

The faults are injected by `Faulty`, a backend around the real one, into one row of a running
batch (the row of a marked prompt), or into a whole pass or admission.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.base import StepFromForward
from specdecode.core.config import SamplingConfig
from specdecode.core.engine import DecodeLoop, RowFailed, RowRequest
from specdecode.core.prices import Prices
from specdecode.core.sampling import InvalidLogitsError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23]]
FAULTY = 1  # the row the faults hit
NEW = 10  # tokens per row
TINY = 1e-45  # a temperature under which any logit overflows float32
# a drafter step a tenth of a target pass, verify passes that grow slowly: drafting auto
# drafts by model wherever it can
CHEAP_DRAFTS = Prices(
    (1, 2, 4),
    tuple(tuple(1.0 + 0.05 * r * t for t in range(8)) for r in (1, 2, 4)),
    (0.1, 0.12, 0.15),
)


class Faulty:
    """A model backend passing every call to `inner`, with one fault injected.

    "nan", "inf": the logits of the row whose prompt is `marked`, from its pass `after` on (a
    row of a running batch, mid-way through its answer). "pass": that pass raises, for every
    row. "admit": the admission of `marked` raises once `inner` has taken its rows (half
    admitted: the other model and the batch have not). "context": no fault, but a pass past
    `inner`'s context raises, as llama.cpp does (PyTorch reads positions past it silently).
    """

    def __init__(self, inner, fault: str, marked: list[int] | None = None, after: int = 2):
        self.inner, self.fault, self.marked, self.after = inner, fault, marked, after
        self.flags: list[bool] = []  # per row: it is the marked one
        self.passes = 0  # passes run
        self.marked_passes = 0  # of them, with the marked row
        self.armed = True  # "pass" and "admit" fire once

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def reset(self, batch_size: int) -> None:
        self.inner.reset(batch_size)
        self.flags = [False] * batch_size

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        self.flags = [self.flags[b] for b in rows.tolist()]

    def add_rows(self, prompts: list[list[int]], partitions=None) -> list[int]:
        reused = self.inner.add_rows(prompts, partitions)
        self.flags += [p == self.marked for p in prompts]
        if self.fault == "admit" and self.armed and any(self.flags):
            self.armed = False
            raise RuntimeError("an admission failed half-way")
        return reused

    def step_logits(self, tokens: list[int]) -> torch.Tensor:
        return StepFromForward.step_logits(self, tokens)  # through the faults of `forward`

    def forward(self, tokens, valid, logits_to_keep=1, want_hidden=False):
        if self.fault == "context":
            held = self.inner.lengths + valid.sum(1)  # [batch]
            assert all(h <= self.inner.context_length for h in held.tolist()), "past the context"
        self.passes += 1
        self.marked_passes += any(self.flags)
        if self.fault == "pass" and self.armed and self.marked_passes > self.after:
            self.armed = False
            raise RuntimeError("a pass failed")
        logits, hidden = self.inner.forward(tokens, valid, logits_to_keep, want_hidden)
        if self.fault in ("nan", "inf") and self.marked_passes > self.after:
            bad = float(self.fault)
            for b, marked in enumerate(self.flags):
                if marked:
                    logits[b, -1, 7] = bad  # [batch, keep, vocab]: one logit of the row
        return logits, hidden


def run(loop: DecodeLoop, requests: list[RowRequest]) -> tuple[list[list[int]], dict[int, str]]:
    """Step `loop` to its end over `requests`, added at once -> each row's tokens, and why each
    failed row failed, by its index in `requests`."""
    keys = [loop.add(r) for r in requests]
    tokens: dict[int, list[int]] = {k: [] for k in keys}
    failed: dict[int, Exception] = {}
    for _ in range(500):
        if not len(loop):
            break
        try:
            updates = loop.step()
        except RowFailed as error:
            assert not set(error.keys) & set(failed), "a row failed twice"
            failed.update(error.reasons)
            updates = error.updates
        for update in updates:
            assert update.key not in failed, "a failed row got tokens"
            tokens[update.key] += update.tokens
    index = {k: i for i, k in enumerate(keys)}
    return [tokens[k] for k in keys], {index[k]: str(why) for k, why in failed.items()}


def greedy(prompts: list[list[int]], new: int = NEW) -> list[RowRequest]:
    return [RowRequest(p, new) for p in prompts]


def assert_holds_no_row(loop: DecodeLoop, decoder: SpeculativeDecoder) -> None:
    """Neither the loop nor a model holds a row: llama.cpp's sequences all free."""
    assert len(loop) == 0 and loop.running == 0
    for backend in (decoder.target_backend, decoder.drafter_backend):
        assert backend.lengths.numel() == 0
        if isinstance(backend, Faulty):
            assert backend.flags == []
        if hasattr(backend, "seq_ids"):  # llama.cpp: every sequence free for a row to take
            assert backend.seq_ids == []
            assert sorted(backend.kept) == list(range(max(loop.max_rows, len(backend.kept))))


# ------------------------------------------------------------------ the pairs

Models = Callable[[str, int | None], object]  # (role, tokens per row or None) -> a backend


def torch_models(tiny_llama) -> Models:
    from specdecode.backends.torch_eager import CachedModel

    def model(role: str, context: int | None):
        lm = tiny_llama(seed=0) if role == "target" else tiny_llama(seed=3, layers=1)
        if context is not None:
            lm.config.max_position_embeddings = context
        return CachedModel(lm, role)

    return model


def llamacpp_models() -> Models:
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp import LlamaCppModel
    from specdecode.models.store import gguf_file

    try:
        path = gguf_file("smollm2-135m", progress=False)
    except Exception as error:  # offline, with no copy in the cache
        pytest.skip(f"SmolLM2-135M's GGUF is not at hand: {error}")

    def model(role: str, context: int | None):
        return LlamaCppModel(path, role=role, context=context or 256, threads=1)

    return model


def decoder_of(
    models: Models, fault=None, marked=None, on="target", drafter_context=None
) -> SpeculativeDecoder:
    """A decoder whose target (or drafter, `on`) is `Faulty` around the backend's model;
    `drafter_context`: a drafter of that few tokens per row, which refuses a pass past them."""
    target, drafter = models("target", None), models("drafter", drafter_context)
    if drafter_context is not None:
        drafter = Faulty(drafter, "context")
    if fault is not None and on == "target":
        target = Faulty(target, fault, marked)
    elif fault is not None:
        drafter = Faulty(drafter, fault, marked)
    return SpeculativeDecoder(target, drafter=drafter)


@pytest.fixture(params=["torch", pytest.param("llama.cpp", marks=pytest.mark.slow)])
def pair(request, tiny_llama) -> Callable[..., SpeculativeDecoder]:
    """`pair(fault, marked, on, drafter_context)`: `decoder_of` on either backend."""
    models = torch_models(tiny_llama) if request.param == "torch" else llamacpp_models()
    return functools.partial(decoder_of, models)


def loop_of(decoder: SpeculativeDecoder, drafting: str = "model", rows: int = 3) -> DecodeLoop:
    return decoder.loop(
        max_rows=rows, prefill_chunk=None, drafting=drafting, num_draft_tokens=3,
        prices=CHEAP_DRAFTS if drafting == "auto" else None,
    )  # fmt: skip


# ------------------------------------------------------------------ a row's fault


@pytest.mark.parametrize("fault", ["nan", "inf"])
@pytest.mark.parametrize("on", ["target", "drafter"])
def test_a_row_with_unusable_logits_fails_alone(pair, fault, on):
    decoder = pair(fault, PROMPTS[FAULTY], on)
    loop = loop_of(decoder)
    got, failed = run(loop, greedy(PROMPTS))
    assert list(failed) == [FAULTY] and "NaN or +inf" in failed[FAULTY]
    others = [p for i, p in enumerate(PROMPTS) if i != FAULTY]
    alone, none = run(loop_of(pair()), greedy(others))
    assert not none
    assert [t for i, t in enumerate(got) if i != FAULTY] == alone
    assert_holds_no_row(loop, decoder)


def test_a_row_whose_temperature_spoils_its_law_fails_alone(pair):
    """A temperature so small that the row's law overflows float32 (its softmax NaN, though its
    logits are finite) fails that row; the greedy rows beside it are untouched."""
    decoder = pair()
    requests = greedy(PROMPTS)
    requests[FAULTY] = RowRequest(PROMPTS[FAULTY], NEW, SamplingConfig(temperature=TINY), seed=1)
    loop = loop_of(decoder)
    got, failed = run(loop, requests)
    assert list(failed) == [FAULTY] and "temperature" in failed[FAULTY]
    others = [p for i, p in enumerate(PROMPTS) if i != FAULTY]
    assert [t for i, t in enumerate(got) if i != FAULTY] == run(loop_of(pair()), greedy(others))[0]
    assert_holds_no_row(loop, decoder)


def test_a_generate_call_whose_rows_fail_raises_their_error(pair):
    """A fixed batch's caller asked for every row: the call fails, with the rows' error."""
    with pytest.raises(InvalidLogitsError, match="temperature"):
        pair().generate(PROMPTS, max_new_tokens=NEW, drafting="model", temperature=TINY)


# ------------------------------------------------------------------ the drafter's context


@pytest.mark.parametrize("drafting", ["model", "lookup-first", "auto"])
def test_a_drafter_is_never_asked_past_its_context(pair, drafting):
    """A drafter of 16 tokens per row beside a target of 256: a row whose prompt is longer
    drafts by lookup or not at all, a short one drafts by model until it would pass 16, and
    every row decodes its plain text (the `Faulty` drafter refuses any pass past 16)."""
    prompts = [list(range(5, 25)), [3, 4, 5], [20, 21, 22, 23, 20, 21]]
    decoder = pair(drafter_context=16)
    loop = loop_of(decoder, drafting)
    got, failed = run(loop, greedy(prompts, 16))
    assert not failed
    assert decoder.drafter_backend.passes > 0, "the drafter model drafted nothing"
    plain = decoder.loop(max_rows=3, prefill_chunk=None, use_drafter=False)
    assert got == run(plain, greedy(prompts, 16))[0]
    assert_holds_no_row(loop, decoder)


# ------------------------------------------------------------------ the round's fault


def test_a_failed_pass_fails_the_round_and_leaves_no_row_behind(pair):
    decoder = pair("pass", PROMPTS[FAULTY])
    loop = loop_of(decoder)
    for request in greedy(PROMPTS):
        loop.add(request)
    with pytest.raises(RuntimeError, match="a pass failed"):
        for _ in range(10):
            loop.step()
    loop.reset()
    assert_holds_no_row(loop, decoder)
    assert run(loop, greedy(PROMPTS[:1]))[0] == run(loop_of(pair()), greedy(PROMPTS[:1]))[0]


def test_a_failed_admission_leaves_no_row_behind(pair):
    """The target takes a joining row, then its admission fails before the drafter and the
    batch take it: the reset frees it too, and the rows that ran before."""
    decoder = pair("admit", PROMPTS[FAULTY])
    loop = loop_of(decoder)
    loop.add(RowRequest(PROMPTS[0], NEW))
    loop.step()
    loop.step()
    loop.add(RowRequest(PROMPTS[FAULTY], NEW))
    with pytest.raises(RuntimeError, match="admission failed"):
        loop.step()
    loop.reset()
    assert_holds_no_row(loop, decoder)
    assert run(loop, greedy(PROMPTS)) == run(loop_of(pair()), greedy(PROMPTS))


def test_a_batch_that_emptied_takes_new_rows(pair):
    """Every row ended and the batch is empty: a row joining then decodes as in a new loop."""
    decoder = pair()
    loop = loop_of(decoder)
    run(loop, greedy(PROMPTS[:1]))
    assert_holds_no_row(loop, decoder)
    assert run(loop, greedy(PROMPTS[1:])) == run(loop_of(pair()), greedy(PROMPTS[1:]))


# ------------------------------------------------------------------ through the server


class Unreadable:
    """A tokenizer that cannot decode a text holding `poison` (a broken vocabulary entry);
    every other call goes to `inner`."""

    def __init__(self, inner, poison: int) -> None:
        self.inner, self.poison = inner, poison

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids, *args, **kwargs) -> str:
        if self.poison in ids:
            raise ValueError(f"no text for token {self.poison}")
        return self.inner.decode(ids, *args, **kwargs)


def serve(decoder: SpeculativeDecoder, *waves: list[dict]) -> list[list]:
    """Each wave of request bodies sent to /v1/completions at once (after the wave before has
    been answered), in process, to a server of 3 rows over `decoder` -> the responses."""
    pytest.importorskip("fastapi")
    import httpx

    from specdecode.serve.app import ServerState, create_app
    from specdecode.serve.metrics import ServerMetrics
    from specdecode.serve.scheduler import Scheduler

    async def send() -> list[list[httpx.Response]]:
        metrics = ServerMetrics()
        options = {"drafting": "model", "num_draft_tokens": 3}
        scheduler = Scheduler(lambda: decoder, metrics, max_rows=3, loop_options=options)
        scheduler.start()
        try:
            await asyncio.to_thread(scheduler.loaded.wait, 60)
            assert scheduler.state == "ready", scheduler.load_error
            app = create_app(ServerState(scheduler, metrics, "tiny"))
            transport = httpx.ASGITransport(app=app)
            answers = []
            async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as client:
                for wave in waves:
                    posts = (client.post("/v1/completions", json=body) for body in wave)
                    answers.append(await asyncio.wait_for(asyncio.gather(*posts), 120))
            return answers
        finally:
            scheduler.stop()

    return asyncio.run(send())


def body(prompt: list[int], **extra) -> dict:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True, **extra,
    }  # fmt: skip


def text_of(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fault", ["nan", "decode", "stop"])
def test_a_request_whose_row_fails_gets_an_error_and_the_others_their_text(
    fault, stream, tiny_llama, word_tokenizer, monkeypatch
):
    """NaN logits in its row, a tokenizer that cannot decode its tokens, a stop string that
    cannot be matched: that request is answered with an OpenAI error (an error event on a
    stream), and the requests beside it get the text they get alone."""
    models, tokenizer = torch_models(tiny_llama), word_tokenizer()
    alone = run(loop_of(decoder_of(models)), greedy(PROMPTS))[0]
    decoder = decoder_of(models, "nan", PROMPTS[FAULTY]) if fault == "nan" else decoder_of(models)
    decoder.tokenizer = tokenizer
    extra = {"stream": stream}
    if fault == "decode":
        others = {t for i, row in enumerate(alone) if i != FAULTY for t in row}
        poison = next(t for t in alone[FAULTY] if t not in others)
        decoder.tokenizer = Unreadable(tokenizer, poison)
    if fault == "stop":
        from specdecode.serve.text import RowText

        def broken(self, text: str, start: int) -> int | None:
            raise RuntimeError("the stop strings cannot be matched")

        monkeypatch.setattr(RowText, "_first_stop", broken)
        extra["stop"] = ["never"]
    bodies = [body(p) for p in PROMPTS]
    bodies[FAULTY] = body(PROMPTS[FAULTY], **extra)
    (answers,) = serve(decoder, bodies)
    for i, answer in enumerate(answers):
        if i != FAULTY:
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == text_of(tokenizer, alone[i])
    failed = answers[FAULTY]
    if stream:
        events = [e for e in failed.text.split("\n\n") if e]
        assert failed.status_code == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "server_error"
    else:
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["type"] == "server_error"


def test_a_failed_round_fails_the_requests_running_and_the_next_is_served(
    tiny_llama, word_tokenizer
):
    models, tokenizer = torch_models(tiny_llama), word_tokenizer()
    alone = run(loop_of(decoder_of(models)), greedy(PROMPTS))[0]
    decoder = decoder_of(models, "pass", PROMPTS[FAULTY])
    decoder.tokenizer = tokenizer
    during, after = serve(decoder, [body(p) for p in PROMPTS], [body(p) for p in PROMPTS])
    assert during[FAULTY].status_code == 500
    for i, answer in enumerate(during):  # a request that was not running yet is served
        expected = text_of(tokenizer, alone[i])
        assert answer.status_code == 500 or answer.json()["choices"][0]["text"] == expected
    texts = [a.json()["choices"][0]["text"] for a in after]
    assert texts == [text_of(tokenizer, tokens) for tokens in alone]
