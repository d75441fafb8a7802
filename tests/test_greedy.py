"""Greedy speculative output is token-identical to the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24], [40]]


def hf_greedy(model, prompt, n, eos=None):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("drafter_kind", ["random", "same"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_target(tiny_architecture, drafter_kind, k):
    make = tiny_architecture  # llama, gpt2 and qwen2 in turn
    target = make(seed=0, layers=2)
    drafter = target if drafter_kind == "same" else make(seed=1, layers=1)
    decoder = SpeculativeDecoder(target, drafter=drafter)
    out = decoder.generate(
        PROMPTS, max_new_tokens=24, drafting="model", num_draft_tokens=k, stop_token_ids=[]
    )
    plain = decoder.generate(PROMPTS, max_new_tokens=24, use_drafter=False, stop_token_ids=[])
    for prompt, spec, ar in zip(PROMPTS, out.new_tokens, plain.new_tokens, strict=True):
        assert spec == ar == hf_greedy(target, prompt, 24)
    total = out.stats.total
    assert total.new_tokens == 24 * len(PROMPTS)
    if drafter_kind == "same":
        assert total.acceptance_rate == 1.0
        # k accepted + 1 bonus per call, except where the budget cut the last draft short
        assert total.target_calls <= len(PROMPTS) * -(-24 // (k + 1))


def test_disjoint_drafter_accepts_nothing_and_stays_exact(tiny_llama):
    target = tiny_llama(seed=0, tie_word_embeddings=False)
    drafter = tiny_llama(seed=1, layers=1)
    with torch.no_grad():  # all drafter logits equal: it always proposes token 0
        drafter.model.norm.weight.zero_()
        target.lm_head.weight[0] = 0.0  # logit 0 is always 0, below the best of 95 others
    decoder = SpeculativeDecoder(target, drafter=drafter)
    out = decoder.generate(
        PROMPTS, max_new_tokens=16, drafting="model", num_draft_tokens=4, stop_token_ids=[]
    )
    assert out.stats.total.accepted == 0 and out.stats.total.drafted > 0
    for prompt, spec in zip(PROMPTS, out.new_tokens, strict=True):
        assert spec == hf_greedy(target, prompt, 16)


def test_output_object_and_sequences(tiny_llama):
    target = tiny_llama(seed=0)
    decoder = SpeculativeDecoder(target, drafter=tiny_llama(seed=2, layers=1))
    out = decoder.generate(PROMPTS[:2], max_new_tokens=5, stop_token_ids=[])
    assert out.sequences[0][: len(PROMPTS[0])] == PROMPTS[0]
    assert out.sequences[1] == PROMPTS[1] + out.new_tokens[1]
    assert out.texts is None  # no tokenizer given
    d = out.stats.as_dict()
    assert d["total"]["new_tokens"] == 10 and len(d["rows"]) == 2
    assert sum(d["total"]["accepted_hist"]) == d["total"]["target_calls"]
    assert d["total"]["accepted"] + d["total"]["recovered"] + d["total"]["bonus"] == 10
