"""The static-cache backend: per-row offsets, rollback by moving them, fixed shapes, compiled.

The engine's correctness suite on this path: ragged rows, rows finishing mid-draft, greedy
equality with the target's own decoding, the sampled law, and the compiled passes giving the
eager ones' tokens (rollback against a fresh forward is in test_kv_cache, for both backends).
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.torch_eager import CachedModel
from specdecode.backends.torch_static import StaticCachedModel, row_bucket

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23], [40], [7, 7, 7, 7, 7, 7]]


def static_decoder(target, drafter=None, compile: bool = False, **kw) -> SpeculativeDecoder:
    draft_lm = StaticCachedModel(drafter, "drafter", compile) if drafter is not None else None
    return SpeculativeDecoder(StaticCachedModel(target, "target", compile), drafter=draft_lm, **kw)


def test_row_buckets_are_few_and_tight():
    sizes = (1, 2, 3, 5, 8, 9, 40, 41, 64)
    assert [row_bucket(n) for n in sizes] == [1, 2, 4, 8, 8, 16, 40, 48, 64]


def test_row_selection_shrinks_the_bucket_and_keeps_each_rows_cache(tiny_llama):
    model = tiny_llama(seed=1)
    static, eager = StaticCachedModel(model), CachedModel(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 90, (5, 6), generator=g)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, :4] = False  # a short row, left-padded
    for lm in (static, eager):
        lm.reset(5)
        lm.forward(tokens, valid)
    assert static.phys_rows == 8
    for keep in (torch.tensor([4, 1, 3]), torch.tensor([2, 0])):  # 5 -> 3 -> 2 rows
        step = torch.randint(1, 90, (len(keep), 2), generator=g)
        ones = torch.ones_like(step, dtype=torch.bool)
        outs = []
        for lm in (static, eager):
            lm.select_rows(keep)
            outs.append(lm.forward(step, ones, logits_to_keep=2, want_hidden=True))
        (ls, hs), (le, he) = outs
        torch.testing.assert_close(ls, le, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hs, he, atol=1e-5, rtol=1e-5)
        assert static.phys_rows == row_bucket(len(keep))
        assert static.lengths.tolist() == eager.lengths.tolist()


@pytest.mark.parametrize(("drafter_kind", "k"), [("random", 3), ("same", 4)])
def test_greedy_equals_the_targets_own_decoding(tiny_architecture, drafter_kind, k):
    target = tiny_architecture(seed=0, layers=2)
    drafter = target if drafter_kind == "same" else tiny_architecture(seed=1, layers=1)
    static = static_decoder(target, drafter)
    assert static.backend == "torch-static"
    eager = SpeculativeDecoder(target)
    spec = static.generate(
        PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=k, stop_token_ids=[]
    )
    plain = eager.generate(PROMPTS, max_new_tokens=20, use_drafter=False, stop_token_ids=[])
    assert spec.new_tokens == plain.new_tokens
    if drafter_kind == "same":
        assert spec.stats.total.acceptance_rate == 1.0


def test_rows_finishing_mid_draft_and_batches_equal_rows_alone(tiny_llama):
    target = tiny_llama(seed=0)
    decoder = static_decoder(target, target)  # oracle drafter: stops land inside drafts
    free = decoder.generate(
        PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4, stop_token_ids=[]
    )
    stop = free.new_tokens[0][6]
    stopped = decoder.generate(
        PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4, stop_token_ids=[stop]
    ).new_tokens
    for tokens, reference in zip(stopped, free.new_tokens, strict=True):
        cut = reference.index(stop) + 1 if stop in reference else len(reference)
        assert tokens == reference[:cut]
    assert len({len(t) for t in stopped}) > 1, "rows should finish at different steps"
    other = static_decoder(target, tiny_llama(seed=3, layers=1))
    batched = other.generate(
        PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=3, stop_token_ids=[]
    )
    for prompt, row in zip(PROMPTS, batched.new_tokens, strict=True):
        alone = other.generate(
            [prompt], max_new_tokens=20, drafting="model", num_draft_tokens=3, stop_token_ids=[]
        )
        assert alone.new_tokens[0] == row


def test_sampled_law_is_the_targets(tiny_llama, sampled_law):
    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    drafter = tiny_llama(seed=9, vocab=sampled_law.vocab, init=0.4, layers=1)
    total = sampled_law.assert_decoder_follows_target(
        static_decoder(target, drafter),
        target,
        sampled_law.prompt,
        2000,
        4,
        drafting="model",
        num_draft_tokens=3,
    )
    assert total.recovered > 0 and total.accepted > 0


def test_compiled_passes_give_the_eager_tokens(tiny_llama):
    """Inductor on the CPU: decoding steps and verify passes compiled in fixed shapes (prompts
    longer than the compiled widths prefill uncompiled)."""
    target, drafter = tiny_llama(seed=0), tiny_llama(seed=3, layers=1)
    prompts = [list(range(5, 23))]  # one row: each shape compiles once (about a minute on 2 cores)
    compiled = static_decoder(target, drafter, compile=True)
    eager = SpeculativeDecoder(target)
    spec = compiled.generate(
        prompts, max_new_tokens=12, drafting="model", num_draft_tokens=3, stop_token_ids=[]
    )
    plain = eager.generate(prompts, max_new_tokens=12, use_drafter=False, stop_token_ids=[])
    assert spec.new_tokens == plain.new_tokens
    assert spec.stats.total.drafted > 0


def test_the_targets_pending_width_comes_from_the_host_after_the_first_round(tiny_llama):
    """The engine tells the target how many tokens its cache lacks (from the round's one host
    copy), so a GPU round does not wait on reading it off the device; the width it tells must
    be the one the device holds, on ragged rows that finish at different rounds."""
    target_model = tiny_llama(seed=0)
    seen: list[tuple[int | None, int]] = []

    class Watched(StaticCachedModel):
        def pending(self, sequences, seq_lens, pad_id=0, width=None):
            seen.append((width, int((seq_lens - self.lengths).max())))
            return super().pending(sequences, seq_lens, pad_id, width)

    decoder = SpeculativeDecoder(
        Watched(target_model, "target"), drafter=StaticCachedModel(tiny_llama(seed=3), "drafter")
    )
    reference = SpeculativeDecoder(target_model).generate(
        PROMPTS, max_new_tokens=12, use_drafter=False, stop_token_ids=[]
    )
    stop = reference.new_tokens[0][4]
    out = decoder.generate(
        PROMPTS, max_new_tokens=12, drafting="model", num_draft_tokens=3, stop_token_ids=[stop]
    )
    for tokens, plain in zip(out.new_tokens, reference.new_tokens, strict=True):
        assert tokens == (plain[: plain.index(stop) + 1] if stop in plain else plain)
    assert seen[0] == (None, max(map(len, PROMPTS)))  # the prompts: read off the device
    assert len(seen) > 3 and all(told == held for told, held in seen[1:])
