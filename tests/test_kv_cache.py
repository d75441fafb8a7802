"""Per-row rollback is bookkeeping: what remains is exactly the accepted prefix."""

from __future__ import annotations

import pytest
import torch

from specdecode.backends import torch_static
from specdecode.backends.torch_eager import CachedModel
from specdecode.backends.torch_static import StaticCachedModel


def fresh_next_logits(model, rows: list[list[int]]) -> torch.Tensor:
    out = []
    for row in rows:
        with torch.no_grad():
            out.append(model(torch.tensor([row])).logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_rollback_leaves_exactly_the_accepted_prefix(tiny_architecture, backend, monkeypatch):
    """On both PyTorch backends; the static one from a capacity its rows outgrow."""
    monkeypatch.setattr(torch_static, "MIN_CAPACITY", 16)
    model = tiny_architecture(seed=0)  # llama, gpt2 and qwen2 in turn
    lm = CachedModel(model) if backend == "eager" else StaticCachedModel(model)
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [11, 12, 13]]
    lm.reset(len(prompts))
    seqs = torch.zeros(3, 64, dtype=torch.long)
    lens = torch.tensor([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        seqs[i, : len(p)] = torch.tensor(p)
    committed = [list(p) for p in prompts]
    for keep in ([2, 0, 4], [4, 1, 0], [1, 3, 2], [0, 0, 0], [4, 4, 4], [3, 0, 1]):
        block = torch.randint(1, 90, (3, 4), generator=g)  # a "draft" of 4 tokens per row
        pending, valid = lm.pending(seqs, lens)
        drafted = torch.ones_like(block, dtype=torch.bool)
        lm.forward(torch.cat([pending, block], 1), torch.cat([valid, drafted], 1))
        keep_t = torch.tensor(keep)
        lm.truncate(lens + keep_t)  # rows keep different numbers of draft tokens
        for i, k in enumerate(keep):
            committed[i] += block[i, :k].tolist() + [int(block[i, k]) if k < 4 else 7]
            seqs[i, : len(committed[i])] = torch.tensor(committed[i])
        assert lm.lengths.tolist() == [len(c) - 1 for c in committed]
        lens = torch.tensor([len(c) for c in committed])
    # every row's next logits equal a fresh forward over its committed tokens
    pending, valid = lm.pending(seqs, lens)
    logits, _ = lm.forward(pending, valid)
    expect = fresh_next_logits(model, committed)
    torch.testing.assert_close(logits[:, -1], expect, atol=1e-4, rtol=1e-4)
    if backend == "eager":
        assert (lm.slot_pos >= 0).sum(1).tolist() == [len(c) for c in committed]
    else:
        assert lm.capacity > 16  # the buffers grew, keeping every row's slots


def test_compaction_and_row_selection_keep_logits(tiny_llama):
    model = tiny_llama(seed=1)
    lm = CachedModel(model)
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    lm.reset(2)
    seqs = torch.zeros(2, 32, dtype=torch.long)
    for i, r in enumerate(rows):
        seqs[i, : len(r)] = torch.tensor(r)
    lm.forward(*lm.pending(seqs, torch.tensor([3, 6])))  # ragged prompts: row 0 left-padded
    junk = torch.full((2, 4), 50)
    physical = lm.physical_len
    lm.forward(junk, torch.tensor([[True] * 4, [False] * 4]))
    lm.truncate(torch.tensor([4, 6]))  # row 0 keeps one junk token, the rest are holes
    assert lm.physical_len == physical + 1  # trailing holes shared by both rows are cropped
    lm.compact()
    assert lm.physical_len == 6  # the longest row, no holes for it
    assert (lm.slot_pos[0] >= 0).sum() == 4 and (lm.slot_pos[1] >= 0).all()
    rows[0].append(50)
    nxt = torch.tensor([[21], [22]])
    got, _ = lm.forward(nxt, torch.ones(2, 1, dtype=torch.bool))
    expect = fresh_next_logits(model, [rows[0] + [21], rows[1] + [22]])
    torch.testing.assert_close(got[:, -1], expect, atol=1e-4, rtol=1e-4)
    lm.select_rows(torch.tensor([1]))  # row 0 finished: only row 1 remains
    got, _ = lm.forward(torch.tensor([[23]]), torch.ones(1, 1, dtype=torch.bool))
    expect = fresh_next_logits(model, [rows[1] + [22, 23]])
    torch.testing.assert_close(got[:, -1], expect, atol=1e-4, rtol=1e-4)
    assert lm.lengths.tolist() == [8]
