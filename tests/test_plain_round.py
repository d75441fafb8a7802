"""Plain rounds (`engine.plain_step`): rows kept on the host between rounds write what the
general round writes for the same rows (greedy, and seeded sampled rows draw the same numbers),
with stops, budgets, rows that join, leave and fail, and around the drafting rounds of a
drafter that rests."""

from __future__ import annotations

from typing import ClassVar

import torch

import specdecode.core.engine as engine
from specdecode import SpeculativeDecoder
from specdecode.core.config import PromptLookup, SamplingConfig
from specdecode.core.drafting.base import Draft
from specdecode.core.drafting.lookup import PromptLookupDrafter
from specdecode.core.engine import Batch, DecodeLoop, RowFailed, RowRequest
from specdecode.core.length_policies import ConstantLength
from specdecode.core.sampling import RowSampling, greedy_tokens

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23], [40], [7, 7, 7, 7, 7, 7]]
HOT = SamplingConfig(temperature=0.9, top_k=20)


class Silent:
    """A drafter asked every round that drafts nothing: its rounds are the general round's
    plain ones."""

    def start(self, batch_size: int) -> None:
        pass

    def rests(self) -> bool:
        return False

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        return Draft.empty(len(seq_lens), sequences.device)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass

    def add_rows(self, prompts, partitions=None) -> None:
        pass


def like(loop: DecodeLoop, drafter) -> DecodeLoop:
    """A loop over the same target and settings as `loop`, with `drafter`."""
    return DecodeLoop(
        loop.target, drafter, loop.cfg, sampling=RowSampling(), max_rows=loop.max_rows,
        capacity=loop.capacity, joins=True, prefill_chunk=loop.prefill_chunk,
    )  # fmt: skip


def drive(loop: DecodeLoop, arrivals: dict[int, list[RowRequest]]) -> tuple[list, list, int]:
    """Step `loop`, adding `arrivals[r]` before round r; -> tokens by key, finished keys,
    rounds."""
    out: dict[int, list[int]] = {}
    ended: list[int] = []
    r = 0
    while r <= max(arrivals) or len(loop):
        for request in arrivals.get(r, []):
            out[loop.add(request)] = []
        for update in loop.step():
            assert update.key not in ended, "a row got tokens after it ended"
            out[update.key] += update.tokens
            if update.finished:
                ended.append(update.key)
        r += 1
        assert r < 500
    return [out[k] for k in sorted(out)], sorted(ended), r


def counted(monkeypatch) -> list[int]:
    """How many rounds ran `plain_step` (one counter per call of this)."""
    calls = [0]
    real = engine.plain_step

    def plain_step(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "plain_step", plain_step)
    return calls


def test_plain_rounds_write_what_general_rounds_write(tiny_llama, monkeypatch):
    """Greedy and seeded sampled rows, joining at different rounds, with budgets and a stop id
    that ends one row early: the same tokens from the host rounds as from the general ones."""
    decoder = SpeculativeDecoder(tiny_llama(seed=0))
    lean = decoder.loop(max_rows=3, prefill_chunk=4, use_drafter=False)
    reference, _, _ = drive(like(lean, Silent()), {0: [RowRequest(PROMPTS[0], 16)]})
    stop = reference[0][6]
    requests = {
        0: [RowRequest(PROMPTS[0], 16, stop_token_ids=(stop,)), RowRequest(PROMPTS[1], 9)],
        2: [RowRequest(PROMPTS[2], 12, HOT, seed=11)],
        5: [RowRequest(PROMPTS[3], 7, HOT, seed=5), RowRequest(PROMPTS[4], 14)],
    }
    general, general_ended, _ = drive(like(lean, Silent()), requests)
    calls = counted(monkeypatch)
    texts, ended, rounds = drive(lean, requests)
    assert calls[0] > rounds / 2  # most rounds ran plain on the host (not prefills, joins)
    assert texts == general and ended == general_ended == [0, 1, 2, 3, 4]
    assert texts[0] == reference[0][: reference[0].index(stop) + 1]
    assert [len(t) for t in texts[1:]] == [9, 12, 7, 14]


def test_a_row_that_fails_in_a_plain_round_leaves_alone(tiny_llama):
    """A row whose logits turn NaN mid-way, in a run of host rounds, fails alone; the others
    write what they write without it."""
    decoder = SpeculativeDecoder(tiny_llama(seed=0))
    alone = decoder.generate([PROMPTS[0], PROMPTS[2]], max_new_tokens=12, use_drafter=False)
    loop = decoder.loop(max_rows=3, use_drafter=False)
    target = loop.target
    marked: list[bool] = []
    real_step, real_select = target.step_logits, target.select_rows

    def step_logits(tokens):
        logits = real_step(tokens).clone()
        if target.lengths.max() > 14:  # a few rounds in
            logits[torch.tensor(marked, dtype=torch.bool)] = float("nan")
        return logits

    def select_rows(rows):
        marked[:] = [marked[b] for b in rows.tolist()]
        real_select(rows)

    target.step_logits, target.select_rows = step_logits, select_rows
    keys = [loop.add(RowRequest(p, 12)) for p in PROMPTS[:3]]
    marked[:] = [False, True, False]
    out = {k: [] for k in keys}
    failed = []
    while len(loop):
        try:
            updates = loop.step()
        except RowFailed as error:
            failed += error.keys
            updates = error.updates
        for update in updates:
            out[update.key] += update.tokens
    assert failed == [keys[1]]
    assert [out[keys[0]], out[keys[2]]] == alone.new_tokens


def test_a_resting_drafter_is_not_asked_and_its_text_stands(tiny_llama, monkeypatch):
    """Rounds a drafter rests run plain without `propose`, and so do rounds whose draft came
    back empty; the drafting rounds between them read the host rounds' tokens (written back
    into the batch first): greedy text equals plain decoding."""

    class Resting(PromptLookupDrafter):
        asked = rested = 0
        empty: ClassVar[list[bool]] = []  # per `propose`: the draft came back empty

        def rests(self) -> bool:  # every other time it is asked
            Resting.asked += 1
            Resting.rested += Resting.asked % 2
            return Resting.asked % 2 == 1

        def propose(self, sequences, seq_lens, max_tokens, rng):
            draft = super().propose(sequences, seq_lens, max_tokens, rng)
            Resting.empty.append(draft.tokens.shape[1] == 0)
            return draft

    decoder = SpeculativeDecoder(tiny_llama(seed=0))
    plain = decoder.generate(PROMPTS[:3], max_new_tokens=20, use_drafter=False).new_tokens
    lean = decoder.loop(max_rows=3, use_drafter=False)
    drafter = Resting(PromptLookup(), ConstantLength(3), decoder.vocab_size, lean.target.device)
    calls = counted(monkeypatch)
    texts, _, rounds = drive(like(lean, drafter), {0: [RowRequest(p, 20) for p in PROMPTS[:3]]})
    assert texts == plain
    assert Resting.rested > 0 and any(Resting.empty[1:]) and not all(Resting.empty[1:])
    assert len(Resting.empty) + Resting.rested == rounds  # a round is asked, or rests
    # the first round feeds the prompts (a general round); after it, every round that drafts
    # nothing runs plain
    assert calls[0] == Resting.rested + sum(Resting.empty[1:])


def test_the_host_rows_are_written_back_before_the_tensors_are_read():
    """`Batch.sync` writes the host rounds' tokens where `commit` would have, and rows that
    leave in a run of host rounds take their tokens with them."""
    batch = Batch(12, torch.device("cpu"))
    batch.add([0, 1, 2], [RowRequest([1, 2, 3], 5, stop_token_ids=(9,)), RowRequest([4], 2),
                          RowRequest([5, 6], 4)])  # fmt: skip
    assert batch.on_host().last == [3, 4, 6]
    assert batch.append([7, 8, 10]) == [False, False, False]
    assert batch.append([9, 11, 12]) == [True, True, False]  # a stop id; a spent budget
    batch.select([2])
    batch.sync()
    assert batch.rows == [2]
    assert batch.sequences[0, :5].tolist() == [5, 6, 10, 12, 0]
    assert batch.seq_lens.tolist() == [4] and batch.budget.tolist() == [2]
    assert batch.host is None and batch.on_host().last == [12]


def test_greedy_tokens_flag_what_bad_rows_flags():
    """The argmax's own logit tells a NaN, a +inf and an all -inf row, as `bad_rows` does."""
    logits = torch.randn(5, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, :10] = float("-inf")  # a masked stretch is fine
    tokens, bad = greedy_tokens(logits)
    assert bad == [False, True, True, True, False]
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())
    assert greedy_tokens(logits.double()) == (tokens, bad)  # the tensor path agrees
