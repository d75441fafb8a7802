"""End to end: speculative sampling emits the target's own sampling law, position by position.

The exact marginal law of the first three generated tokens is computed by enumerating every
prefix with the target (same temperature, top-k, top-p); thousands of rows, each with its own
seed, are sampled in one batch, and a chi-square test compares the two. The negative control (a
rule that accepts every draft) must fail the same test.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama

from specdecode.backends.torch_eager import CachedModel
from specdecode.config import DecodeConfig, SamplingConfig
from specdecode.drafters import ModelDrafter
from specdecode.engine import decode
from specdecode.length_policies import ConstantLength
from specdecode.sampling import logits_to_probs
from specdecode.stats import DecodeStats, RowStats
from specdecode.verification import LosslessSamplingRule

VOCAB, N, PROMPT = 12, 3000, [3, 7, 1, 9]
SAMPLING = SamplingConfig(temperature=0.8, top_k=10, top_p=0.95)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
    expected = law * counts.sum()
    big = expected >= 5  # pool the small cells so the statistic stays chi-square
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def exact_marginals(model, prompt: list[int] = PROMPT) -> list[torch.Tensor]:
    """The target's exact laws of the first three generated tokens after `prompt`."""
    with torch.no_grad():

        def law(prefixes: torch.Tensor) -> torch.Tensor:
            return logits_to_probs(model(prefixes).logits[:, -1], SAMPLING)

        base = torch.tensor([prompt])
        p1 = law(base)[0]  # [vocab]
        one = torch.cat([base.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = law(one)  # [t1, vocab]
        two = torch.cat(
            [one.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1
        )
        p3 = law(two).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, vocab]
    joint12 = p1[:, None] * p2
    return [p1, joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))]


def assert_decoder_follows_target(decoder, target, prompt, rows, new_tokens, **kwargs):
    """`decoder` samples `rows` seeded rows after `prompt` (SAMPLING), and their first three
    tokens follow `target`'s exact law (chi-square); returns the run's total statistics."""
    out = decoder.generate(
        [prompt] * rows,
        max_new_tokens=new_tokens,
        temperature=SAMPLING.temperature,
        top_k=SAMPLING.top_k,
        top_p=SAMPLING.top_p,
        row_seeds=range(rows),
        stop_token_ids=[],
        **kwargs,
    )
    tokens = torch.tensor(out.new_tokens)  # [rows, new_tokens]
    for position, law in enumerate(exact_marginals(target, prompt)):
        stat, df = chi2(torch.bincount(tokens[:, position], minlength=VOCAB).float(), law)
        assert stat < chi2_critical(df), f"position {position}: chi2 {stat:.1f} on {df} df"
    return out.stats.total


def sample_positions(target, drafter, rule) -> torch.Tensor:
    cfg = DecodeConfig(
        max_new_tokens=3, num_draft_tokens=2, sampling=SAMPLING, row_seeds=tuple(range(N))
    )
    draft = None
    if drafter is not None:
        draft = ModelDrafter(CachedModel(drafter), SAMPLING, VOCAB, ConstantLength(2))
    out = [[] for _ in range(N)]
    stats = DecodeStats([RowStats() for _ in range(N)])
    for event in decode(CachedModel(target), draft, rule, [PROMPT] * N, cfg, stats):
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            out[row].extend(tokens)
    return torch.tensor(out)  # [N, 3]


class AlwaysAccept(LosslessSamplingRule):
    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng):
        verdict = super().verify(draft_tokens, draft_probs, target_logits, num_drafted, rng)
        return type(verdict)(num_drafted.clone(), verdict.next_tokens)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=0, vocab=VOCAB, init=0.4)
    drafter = tiny_llama(seed=9, vocab=VOCAB, init=0.4, layers=1)
    return target, drafter, exact_marginals(target)


@pytest.mark.parametrize("method", ["speculative", "plain"])
def test_sampled_law_equals_target(models, method):
    target, drafter, marginals = models
    tokens = sample_positions(
        target, drafter if method == "speculative" else None, LosslessSamplingRule(SAMPLING)
    )
    for position, law in enumerate(marginals):
        stat, df = chi2(torch.bincount(tokens[:, position], minlength=VOCAB).float(), law)
        assert stat < chi2_critical(df), f"position {position}: chi2 {stat:.1f} on {df} df"


def test_negative_control_fails(models):
    target, drafter, marginals = models
    tokens = sample_positions(target, drafter, AlwaysAccept(SAMPLING))
    tests = [
        chi2(torch.bincount(tokens[:, i], minlength=VOCAB).float(), law)
        for i, law in enumerate(marginals)
    ]
    assert any(stat > chi2_critical(df) for stat, df in tests), "accepting every draft must fail"
