"""Ragged batches: every row equals the same prompt run alone, whatever its neighbours do."""

from __future__ import annotations

from specdecode import SpeculativeDecoder

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23], [40], [7, 7, 7, 7, 7, 7]]


def run(decoder, prompts, **kw):
    kw.setdefault("stop_token_ids", [])
    return decoder.generate(prompts, **kw).new_tokens


def test_batch_equals_rows_alone_greedy(tiny_llama, tiny_gpt2):
    for make in (tiny_llama, tiny_gpt2):
        decoder = SpeculativeDecoder(make(seed=0), drafter=make(seed=3, layers=1))
        batched = run(decoder, PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=3)
        alone = [
            run(decoder, [p], max_new_tokens=20, drafting="model", num_draft_tokens=3)[0]
            for p in PROMPTS
        ]
        assert batched == alone


def test_eos_inside_draft_and_rows_finishing_at_different_steps(tiny_llama):
    target = tiny_llama(seed=0)
    decoder = SpeculativeDecoder(target, drafter=target)  # oracle drafter: stops land mid-draft
    free = run(decoder, PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4)
    stop = free[0][6]  # a token the first row emits mid-way (inside its second draft)
    stopped = decoder.generate(
        PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4, stop_token_ids=[stop]
    )
    for tokens, reference in zip(stopped.new_tokens, free, strict=True):
        cut = reference.index(stop) + 1 if stop in reference else len(reference)
        assert tokens == reference[:cut]
    lengths = {len(t) for t in stopped.new_tokens}
    assert len(lengths) > 1, "rows should finish at different steps"
    # drafts accepted past the stop are never committed, so they do not count as accepted
    for row, tokens in zip(stopped.stats.rows, stopped.new_tokens, strict=True):
        assert row.new_tokens == len(tokens) and row.accepted <= len(tokens)
    assert stopped.stats.rows[0].accepted == len(stopped.new_tokens[0]) - 1  # oracle: all but one
    events = list(
        decoder.stream(
            PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4, stop_token_ids=[stop]
        )
    )
    finished_at = {}
    for step, event in enumerate(events):
        for row, done in zip(event.rows, event.finished, strict=True):
            if done:
                finished_at[row] = step
    assert len(finished_at) == len(PROMPTS) and len(set(finished_at.values())) > 1
    # a finished row leaves the batch: it appears in no later event
    for row, step in finished_at.items():
        assert all(row not in e.rows for e in events[step + 1 :])


def test_max_new_tokens_inside_draft(tiny_llama):
    target = tiny_llama(seed=0)
    decoder = SpeculativeDecoder(target, drafter=target)
    full = run(decoder, PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4)
    for n in (1, 2, 6, 7):
        out = decoder.generate(
            PROMPTS, max_new_tokens=n, drafting="model", num_draft_tokens=4, stop_token_ids=[]
        )
        assert out.new_tokens == [t[:n] for t in full]
        assert out.stats.total.drafted <= len(PROMPTS) * (n - 1)  # never drafts past the budget


def test_sampling_rows_with_own_seeds_equal_rows_alone(tiny_llama):
    decoder = SpeculativeDecoder(tiny_llama(seed=0, init=0.3), drafter=tiny_llama(seed=5, init=0.3))
    seeds = [11, 22, 33, 44, 55]
    kw = dict(
        max_new_tokens=16,
        drafting="model",
        num_draft_tokens=3,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
    )
    batched = run(decoder, PROMPTS, row_seeds=seeds, **kw)
    alone = [run(decoder, [p], row_seeds=[s], **kw)[0] for p, s in zip(PROMPTS, seeds, strict=True)]
    assert batched == alone
    assert run(decoder, PROMPTS, row_seeds=seeds, **kw) == batched  # seeded determinism
    other = run(decoder, PROMPTS, row_seeds=[s + 1 for s in seeds], **kw)
    assert other != batched


def test_streaming_reassembles_generate(tiny_llama):
    target = tiny_llama(seed=0)
    decoder = SpeculativeDecoder(target, drafter=tiny_llama(seed=1, layers=1))
    pieces = [[] for _ in PROMPTS]
    for event in decoder.stream(PROMPTS, max_new_tokens=12, stop_token_ids=[]):
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            pieces[row].extend(tokens)
    assert pieces == run(decoder, PROMPTS, max_new_tokens=12)
    # a consumer that stops early, then a fresh call: same answer as before
    stream = decoder.stream(PROMPTS, max_new_tokens=12, stop_token_ids=[])
    next(stream)
    stream.close()
    assert run(decoder, PROMPTS, max_new_tokens=12) == pieces


def test_finished_rows_stop_costing_compute(tiny_llama):
    target = tiny_llama(seed=0)
    decoder = SpeculativeDecoder(target, drafter=target)
    prompts = [[5, 6], [7, 8, 9]]
    free = run(decoder, prompts, max_new_tokens=20, drafting="model", num_draft_tokens=2)
    stop = next(t for t in free[0][:4] if t not in free[1])  # ends row 0 early, never row 1
    rows_per_forward = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    try:
        out = decoder.generate(
            prompts, max_new_tokens=20, drafting="model", num_draft_tokens=2, stop_token_ids=[stop]
        )
    finally:
        hook.remove()
    assert len(out.new_tokens[0]) <= 4 and len(out.new_tokens[1]) == 20
    assert rows_per_forward[0] == 2 and rows_per_forward[-1] == 1


def test_drafting_only_while_the_batch_is_small(tiny_llama):
    """`max_draft_batch`: rounds of a larger batch are plain steps, the drafter catches up once
    rows have finished, and no output changes (greedy, and coupled sampling, whose text depends
    on the seed alone whatever each round drafted)."""
    target, drafter_model = tiny_llama(seed=0), tiny_llama(seed=3, layers=1)
    decoder = SpeculativeDecoder(target, drafter=drafter_model)
    free = run(decoder, PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=3)

    def finish(token: int) -> list[int]:
        return sorted(row.index(token) if token in row else 20 for row in free)

    # a stop token that ends three rows early and leaves two running for a while
    stop = next(t for row in free for t in row if finish(t)[2] < 12 and finish(t)[3] > 14)
    rows_drafting: list[int] = []
    hook = drafter_model.register_forward_pre_hook(
        lambda module, args, kwargs: rows_drafting.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    kw = dict(max_new_tokens=20, drafting="model", num_draft_tokens=3, stop_token_ids=[stop])
    try:
        always = decoder.generate(PROMPTS, **kw)
        assert max(rows_drafting) == len(PROMPTS)
        rows_drafting.clear()
        small = decoder.generate(PROMPTS, max_draft_batch=2, **kw)
    finally:
        hook.remove()
    assert small.new_tokens == always.new_tokens
    assert rows_drafting and max(rows_drafting) <= 2
    assert 0 < small.stats.total.drafted < always.stats.total.drafted
    sampled = dict(kw, temperature=0.9, row_seeds=[1, 2, 3, 4, 5], coupled=True)
    assert run(decoder, PROMPTS, max_draft_batch=2, **sampled) == run(decoder, PROMPTS, **sampled)
