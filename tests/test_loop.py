"""The engine's loop stepped from outside: rows join a running batch and leave it, and each row
decodes what it decodes alone (greedy), whatever joins beside it and however its prompt is fed."""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.config import SamplingConfig
from specdecode.core.engine import RowRequest

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23], [40], [7, 7, 7, 7, 7, 7]]


def alone(decoder, prompt, n, **kw):
    return decoder.generate([prompt], max_new_tokens=n, stop_token_ids=[], **kw).new_tokens[0]


def drive(loop, arrivals: dict[int, list[RowRequest]], cancel: dict[int, int] | None = None):
    """Step `loop`, adding the requests of `arrivals[r]` before round r; -> tokens by key."""
    out: dict[int, list[int]] = {}
    keys: list[int] = []
    finished: set[int] = set()
    r = 0
    while r <= max(arrivals) or len(loop):
        for request in arrivals.get(r, []):
            keys.append(loop.add(request))
            out[keys[-1]] = []
        if cancel and r in cancel:
            loop.cancel(keys[cancel[r]])
        for update in loop.step():
            assert update.key not in finished, "a row got tokens after it finished"
            out[update.key].extend(update.tokens)
            if update.finished:
                finished.add(update.key)
        r += 1
        assert r < 500
    return [out[k] for k in keys], finished, keys


@pytest.mark.parametrize("chunk", [None, 3])
def test_rows_joining_mid_run_decode_as_alone(tiny_llama, chunk):
    decoder = SpeculativeDecoder(tiny_llama(seed=0), drafter=tiny_llama(seed=3, layers=1))
    loop = decoder.loop(max_rows=3, prefill_chunk=chunk, drafting="model", num_draft_tokens=3)
    budgets = [12, 5, 9, 14, 7]
    requests = [RowRequest(p, n) for p, n in zip(PROMPTS, budgets, strict=True)]
    # two at once, one a few rounds later, two more than max_rows allows at once (they wait)
    texts, finished, keys = drive(loop, {0: requests[:2], 3: requests[2:3], 4: requests[3:]})
    assert finished == set(keys)
    for got, p, n in zip(texts, PROMPTS, budgets, strict=True):
        assert got == alone(decoder, p, n, drafting="model", num_draft_tokens=3)


def test_cancelled_row_leaves_and_the_others_go_on(tiny_llama):
    decoder = SpeculativeDecoder(tiny_llama(seed=0), drafter=tiny_llama(seed=3, layers=1))
    loop = decoder.loop(max_rows=4, drafting="model", num_draft_tokens=2)
    requests = [RowRequest(p, 10) for p in PROMPTS[:3]]
    texts, finished, keys = drive(loop, {0: requests}, cancel={2: 1})
    assert keys[1] not in finished and len(texts[1]) < 10
    assert len(loop) == 0 and loop.running == 0
    for i in (0, 2):
        assert texts[i] == alone(decoder, PROMPTS[i], 10, drafting="model", num_draft_tokens=2)


def test_greedy_and_sampled_rows_share_a_batch(tiny_llama):
    """A greedy row beside sampled rows is still greedy; a sampled row with a seed is the same
    whatever runs beside it (its stream is its own)."""
    decoder = SpeculativeDecoder(tiny_llama(seed=0), drafter=tiny_llama(seed=3, layers=1))
    hot = SamplingConfig(temperature=0.9, top_k=20)
    greedy = RowRequest(PROMPTS[0], 12)
    sampled = RowRequest(PROMPTS[1], 12, hot, seed=11)
    # drafting model: each row's round lengths are its own (a priced plan reads the batch)
    mixed, _, _ = drive(
        decoder.loop(max_rows=4, drafting="model"),
        {0: [greedy, sampled, RowRequest(PROMPTS[2], 8, hot, seed=5)]},
    )
    solo, _, _ = drive(decoder.loop(max_rows=4, drafting="model"), {0: [sampled]})
    assert mixed[0] == alone(decoder, PROMPTS[0], 12)
    assert mixed[1] == solo[0]


def test_loop_refuses_what_cannot_join(tiny_llama):
    decoder = SpeculativeDecoder(tiny_llama(seed=0))
    loop = decoder.loop(max_rows=1)
    with pytest.raises(ValueError, match="prompt"):
        RowRequest([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        RowRequest([1, 2], 0)
    with pytest.raises(ValueError, match="do not fit"):
        loop.add(RowRequest([1] * 10, 10**6))


@pytest.mark.slow
def test_prefix_reuse_on_llamacpp_equals_a_fresh_prefill():
    pytest.importorskip("llama_cpp")
    from specdecode.models.store import gguf_file

    gguf_file("smollm2-135m", progress=False)
    decoder = SpeculativeDecoder.from_pretrained("smollm2-135m", backend="llama.cpp")
    prompt = decoder.encode("The capital of France is a city that")[0]
    longer = prompt + decoder.encode(" many people visit every year because")[0]
    loop = decoder.loop(max_rows=2, prefill_chunk=4, use_drafter=False)
    first, _, _ = drive(loop, {0: [RowRequest(prompt, 12)]})
    # the same prompt again, then one extending it: both reuse the cells left by the first
    again = loop.add(RowRequest(prompt, 12))
    reused = {}
    got: dict[int, list[int]] = {again: []}
    while len(loop):
        for u in loop.step():
            got[u.key] += u.tokens
            reused.setdefault(u.key, u.reused)
    assert reused[again] == len(prompt) - 1
    ext = loop.add(RowRequest(longer, 12))
    got[ext] = []
    while len(loop):
        for u in loop.step():
            got[u.key] += u.tokens
            reused.setdefault(u.key, u.reused)
    assert reused[ext] >= len(prompt) - 1
    fresh = SpeculativeDecoder.from_pretrained("smollm2-135m", backend="llama.cpp")
    assert got[again] == first[0] == alone(fresh, prompt, 12, use_drafter=False)
    assert got[ext] == alone(fresh, longer, 12, use_drafter=False)
    assert torch.equal(loop.target.lengths, torch.zeros(0, dtype=torch.long))


def test_timed_rounds_reach_drafting_s_judge(tiny_llama, monkeypatch):
    """Every decoding round of a planned drafter is reported with its shape (each row's tokens
    in the target's pass, at least one), the tokens it committed and its seconds; prompt
    rounds are not."""
    decoder = SpeculativeDecoder(tiny_llama(seed=0), drafter=tiny_llama(seed=3, layers=1))
    decoder.prices(rows=2)
    seen = []
    monkeypatch.setattr(decoder, "observe_round", lambda *a: seen.append(a))
    out = decoder.generate(PROMPTS[:2], max_new_tokens=12, stop_token_ids=[])
    assert seen and len(seen) <= out.stats.target_passes - 1  # not the first (prompt) round
    for counts, committed, seconds in seen:
        assert len(counts) in (1, 2) and min(counts) >= 1 and seconds > 0
        assert len(counts) <= committed <= sum(counts) + len(counts)
    plain = []
    monkeypatch.setattr(decoder, "observe_round", lambda *a: plain.append(a))
    decoder.generate(PROMPTS[:2], max_new_tokens=4, use_drafter=False)
    assert plain == []  # nothing planned, nothing to watch


def test_a_round_is_decoding_only_when_it_feeds_no_prompt(tiny_llama):
    """`DecodeLoop.decoding` after each round: not for the first (the prompts' prefill), nor
    for a round a row joins in or any chunk of a long prompt is fed, its last too, else yes."""
    decoder = SpeculativeDecoder(tiny_llama(seed=0), drafter=tiny_llama(seed=3, layers=1))
    loop = decoder.loop(max_rows=2, prefill_chunk=4, use_drafter=False)
    loop.add(RowRequest(PROMPTS[1], 6))
    seen = []
    for r in range(5):
        if r == 2:  # nine tokens in chunks of four: fed over three rounds
            loop.add(RowRequest(PROMPTS[0], 3))
        loop.step()
        seen.append(loop.decoding)
    assert seen == [False, True, False, False, False]
    while len(loop):
        loop.step()
        last = loop.decoding
    assert last
