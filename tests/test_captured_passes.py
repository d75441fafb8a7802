"""The static path's hand-captured passes, on the CPU: a recorded graph stands in for a CUDA one.

A CUDA graph replays the kernels it recorded on the addresses it recorded: its static inputs,
the cache's buffers, its own outputs. `Recorded` replays the pass on the same static inputs,
writes into the same output tensors (so a backend keeping a graph's output across replays reads
it overwritten, as on a GPU), and checks that the cache's buffers are the ones it was captured
over (so buffers moved under a live graph fail here, where on a GPU they would write freed
memory). What only a GPU shows (no host sync inside a pass, the capture's time) is in
test_cuda.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.torch_static import StaticCachedModel
from specdecode.pricebook import pass_seconds

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23], [40], [7, 7, 7, 7, 7, 7]]


class Recorded:
    """A stand-in for CUDA capture over `backend`'s cache: counts captures and replays."""

    def __init__(self, backend: StaticCachedModel) -> None:
        self.backend = backend
        self.captures = 0
        self.replays = 0
        backend.graphs.capture = self
        backend.graphs.synchronize = lambda: None

    def addresses(self) -> list[int]:
        return [
            t.data_ptr() for layer in self.backend.cache.layers for t in (layer.keys, layer.values)
        ]

    def __call__(self, run, warm):
        warm()
        outputs = run()  # a CUDA capture runs nothing; this pass is the first replay's twin
        captured_over = self.addresses()
        self.captures += 1

        def replay() -> None:
            assert self.addresses() == captured_over, "the cache moved under a captured graph"
            with torch.inference_mode():  # a replay's kernels write outputs unchecked
                for kept, fresh in zip(outputs, run(), strict=True):
                    if kept is not None:
                        kept.copy_(fresh)
            self.replays += 1

        return replay, outputs


def captured(model, role: str, **kw) -> tuple[StaticCachedModel, Recorded]:
    backend = StaticCachedModel(model, role, capture=True, **kw)
    return backend, Recorded(backend)


def test_captured_greedy_text_is_the_targets_and_graphs_are_reused(tiny_llama):
    """Ragged rows finishing at different rounds (the bucket shrinks 8 -> 4 -> 2 -> 1), drafts
    of two and four: the target's own greedy text. A second run of the same batch captures
    nothing: shrinking moves rows inside the buffers, it does not reallocate them."""
    target, drafter = tiny_llama(seed=0), tiny_llama(seed=3, layers=1)
    (t_lm, t_rec), (d_lm, d_rec) = captured(target, "target"), captured(drafter, "drafter")
    decoder = SpeculativeDecoder(t_lm, drafter=d_lm)
    plain = SpeculativeDecoder(target).generate(
        PROMPTS, max_new_tokens=20, use_drafter=False, stop_token_ids=[]
    )
    stop = plain.new_tokens[0][6]
    for k in (2, 4):
        out = decoder.generate(
            PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=k, stop_token_ids=[stop]
        )
        for tokens, reference in zip(out.new_tokens, plain.new_tokens, strict=True):
            cut = reference.index(stop) + 1 if stop in reference else len(reference)
            assert tokens == reference[:cut]
        assert len({len(t) for t in out.new_tokens}) > 1, "rows should finish apart"
    assert t_rec.replays > t_rec.captures > 0 and d_rec.replays > d_rec.captures > 0
    seen = (t_rec.captures, d_rec.captures)
    again = decoder.generate(
        PROMPTS, max_new_tokens=20, drafting="model", num_draft_tokens=4, stop_token_ids=[stop]
    )
    assert again.new_tokens == out.new_tokens
    assert (t_rec.captures, d_rec.captures) == seen
    # graphs captured while decoding (in inference mode) replay for the pass timer (outside it)
    (seconds,) = pass_seconds([(t_lm, [1, 4])], PROMPTS[0], 2, rows=5)
    assert set(seconds) == {1, 4} and all(s > 0 for s in seconds.values())
    assert len(t_lm.capture_times) == t_rec.captures
    rows = {c.rows for c in t_lm.capture_times}
    assert 8 in rows and min(rows) < 8  # the bucket of five rows, then smaller ones


def test_outgrowing_the_capacity_recaptures_over_the_new_buffers(tiny_llama):
    """Rows that outgrow the capacity asked for grow the cache (one copy): the graphs over the
    old buffers are dropped, captured again over the new, and the text stays the target's."""
    target = tiny_llama(seed=0)
    t_lm, _ = captured(target, "target", capacity=16)
    assert t_lm.capacity == 16
    decoder = SpeculativeDecoder(t_lm, drafter=StaticCachedModel(target, "drafter"))
    out = decoder.generate(
        PROMPTS, max_new_tokens=40, drafting="model", num_draft_tokens=3, stop_token_ids=[]
    )
    plain = SpeculativeDecoder(target).generate(
        PROMPTS, max_new_tokens=40, use_drafter=False, stop_token_ids=[]
    )
    assert out.new_tokens == plain.new_tokens
    assert t_lm.capacity >= 64
    widths = [(c.rows, c.width) for c in t_lm.capture_times]
    assert len(widths) > len(set(widths)), "a shape captured again after the buffers moved"


def test_capacity_asked_for_allocates_once(tiny_llama):
    """Asked for enough, the buffers are allocated once: every shape is captured once."""
    target = tiny_llama(seed=0)
    t_lm, _ = captured(target, "target", capacity=128)
    decoder = SpeculativeDecoder(t_lm, drafter=StaticCachedModel(target, "drafter"))
    decoder.generate(
        PROMPTS, max_new_tokens=40, drafting="model", num_draft_tokens=3, stop_token_ids=[]
    )
    shapes = [(c.rows, c.width, c.hidden) for c in t_lm.capture_times]
    assert t_lm.capacity == 128 and len(shapes) == len(set(shapes))


def test_captured_sampled_law_is_the_targets(tiny_llama, sampled_law):
    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    drafter = tiny_llama(seed=9, vocab=sampled_law.vocab, init=0.4, layers=1)
    decoder = SpeculativeDecoder(
        captured(target, "target")[0], drafter=captured(drafter, "drafter")[0]
    )
    total = sampled_law.assert_decoder_follows_target(
        decoder, target, sampled_law.prompt, 2000, 4, drafting="model", num_draft_tokens=3
    )
    assert total.recovered > 0 and total.accepted > 0


def test_capture_and_compile_are_one_choice(tiny_llama):
    with pytest.raises(ValueError, match="choose one"):
        StaticCachedModel(tiny_llama(seed=0), capture=True, compile=True)
    assert StaticCachedModel(tiny_llama(seed=0)).graphs is None  # the CPU's default: eager


def test_a_pass_that_cannot_be_captured_runs_uncaptured(tiny_llama, caplog):
    """A capture that fails (an operation a graph cannot hold) leaves decoding to the
    uncaptured passes, with the reason kept and said once: the text is the target's."""
    target = tiny_llama(seed=0)
    t_lm = StaticCachedModel(target, "target", capture=True)

    def refuse(run, warm):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    t_lm.graphs.capture = refuse
    decoder = SpeculativeDecoder(t_lm, drafter=StaticCachedModel(target, "drafter"))
    with caplog.at_level("WARNING"):
        out = decoder.generate(
            PROMPTS, max_new_tokens=12, drafting="model", num_draft_tokens=3, stop_token_ids=[]
        )
    plain = SpeculativeDecoder(target).generate(
        PROMPTS, max_new_tokens=12, use_drafter=False, stop_token_ids=[]
    )
    assert out.new_tokens == plain.new_tokens
    assert t_lm.capture_failure == "RuntimeError: operation not permitted when stream is capturing"
    assert sum("could not be captured" in r.getMessage() for r in caplog.records) == 1
    assert t_lm.capture_times == []
