"""End to end: speculative sampling emits the target's own sampling law, position by position.

The exact marginal law of the first three generated tokens is computed by enumerating every
prefix with the target (same temperature, top-k, top-p); thousands of rows, each with its own
seed, are sampled in one batch, and a chi-square test compares the two. The negative control (a
rule that accepts every draft) must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.backends.torch_eager import CachedModel
from specdecode.core.config import DecodeConfig
from specdecode.core.drafting.model import ModelDrafter
from specdecode.core.engine import decode
from specdecode.core.length_policies import ConstantLength
from specdecode.core.stats import DecodeStats, RowStats
from specdecode.core.verification import LosslessSamplingRule

N = 3000  # rows, each with its own seed


def sample_positions(law, target, drafter, rule) -> torch.Tensor:
    cfg = DecodeConfig(
        max_new_tokens=3,
        drafting="model",
        num_draft_tokens=2,
        sampling=law.sampling,
        row_seeds=tuple(range(N)),
    )
    draft = None
    if drafter is not None:
        draft = ModelDrafter(CachedModel(drafter), law.sampling, law.vocab, ConstantLength(2))
    out = [[] for _ in range(N)]
    stats = DecodeStats([RowStats() for _ in range(N)])
    prompts = [list(law.prompt)] * N
    for event in decode(CachedModel(target), draft, rule, prompts, cfg, stats):
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            out[row].extend(tokens)
    return torch.tensor(out)  # [N, 3]


class AlwaysAccept(LosslessSamplingRule):
    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng):
        verdict = super().verify(draft_tokens, draft_probs, target_logits, num_drafted, rng)
        return type(verdict)(num_drafted.clone(), verdict.next_tokens)


@pytest.fixture(scope="module")
def models(tiny_llama, sampled_law):
    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    drafter = tiny_llama(seed=9, vocab=sampled_law.vocab, init=0.4, layers=1)
    return target, drafter, sampled_law.exact_marginals(target)


@pytest.mark.parametrize("method", ["speculative", "plain"])
def test_sampled_law_equals_target(models, method, sampled_law):
    target, drafter, marginals = models
    rule = LosslessSamplingRule(sampled_law.sampling)
    drafter = drafter if method == "speculative" else None
    sampled_law.assert_follows(sample_positions(sampled_law, target, drafter, rule), marginals)


def test_negative_control_fails(models, sampled_law):
    law = sampled_law
    target, drafter, marginals = models
    tokens = sample_positions(law, target, drafter, AlwaysAccept(law.sampling))
    tests = [
        law.chi2(torch.bincount(tokens[:, i], minlength=law.vocab).float(), marginal)
        for i, marginal in enumerate(marginals)
    ]
    failed = any(stat > law.chi2_critical(df) for stat, df in tests)
    assert failed, "accepting every draft must fail"
