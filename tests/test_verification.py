"""The accept/resample rule in isolation: exact algebra, convergence, forced outcomes, tau."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.core.config import SamplingConfig
from specdecode.core.sampling import RowRandom, argmax_last, logits_to_probs, sample_from
from specdecode.core.verification import (
    GreedyRule,
    LosslessSamplingRule,
    acceptance_probability,
    make_rule,
    residual_law,
)

SAMPLING = SamplingConfig(temperature=1.0)


def random_law(generator: torch.Generator, vocab: int, peaky: float = 2.0) -> torch.Tensor:
    return (torch.randn(vocab, generator=generator) * peaky).softmax(-1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 40), zeros=st.integers(0, 5))
def test_exact_algebra_recovers_target(seed, vocab, zeros):
    """q * min(1, p/q) + P(reject) * normalize(max(0, p - q)) == p, with sparse supports too."""
    g = torch.Generator().manual_seed(seed)
    p, q = random_law(g, vocab), random_law(g, vocab)
    p[torch.randperm(vocab, generator=g)[: min(zeros, vocab - 1)]] = 0
    q[torch.randperm(vocab, generator=g)[: min(zeros, vocab - 1)]] = 0
    p, q = p / p.sum(), q / q.sum()
    kept = q * acceptance_probability(p, q)
    law = kept + (1 - kept.sum()) * residual_law(p, q)
    torch.testing.assert_close(law, p, atol=1e-6, rtol=0)


def emitted_first_tokens(target_probs, draft_probs, n, seed, rule_cls=LosslessSamplingRule):
    """Draw n drafts of one token from q, verify against p, return the emitted first tokens."""
    vocab = target_probs.shape[-1]
    rng = RowRandom(list(range(seed, seed + n)))
    draft_tokens = sample_from(draft_probs.expand(n, vocab), rng.uniform([1] * n)[:, 0])
    logits = target_probs.log().expand(n, 2, vocab)
    verdict = rule_cls(SAMPLING).verify(
        draft_tokens[:, None],
        draft_probs.expand(n, 1, vocab),
        logits,
        torch.ones(n, dtype=torch.long),
        rng,
    )
    return torch.where(verdict.num_accepted > 0, draft_tokens, verdict.next_tokens)


def tv(counts: torch.Tensor, law: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - law).abs().sum())


class AlwaysAccept(LosslessSamplingRule):
    """Negative control: accepts every draft token, so its output follows the drafter."""

    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng):
        verdict = super().verify(draft_tokens, draft_probs, target_logits, num_drafted, rng)
        return type(verdict)(num_drafted.clone(), verdict.next_tokens)


@pytest.mark.parametrize(
    "rule_cls,should_match", [(LosslessSamplingRule, True), (AlwaysAccept, False)]
)
def test_distribution_converges_to_target(rule_cls, should_match):
    g = torch.Generator().manual_seed(7)
    vocab = 8
    p, q = random_law(g, vocab), random_law(g, vocab)
    references = [random_law(g, vocab) for _ in range(5)]
    distances = []
    for i, n in enumerate((500, 4000, 32000)):
        tokens = emitted_first_tokens(p, q, n, seed=1000 * i, rule_cls=rule_cls)
        counts = torch.bincount(tokens, minlength=vocab).float()
        distances.append(tv(counts, p))
        to_references = min(tv(counts, r) for r in references)
    if should_match:
        assert distances[-1] < 0.015
        assert distances[-1] < distances[0]
        assert distances[-1] * 5 < to_references
    else:
        assert distances[-1] > 0.05, "the negative control must fail the same test"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 3), st.integers(2, 300))
def test_argmax_last_is_torchs_argmax_ties_and_views_included(seed, batch, width, vocab):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (batch, width, vocab), generator=gen).float()  # many ties
    for view in (x, x[:, -1], x[0, 0], x[:, :, : max(1, vocab // 2)], x.transpose(0, 1)):
        got = argmax_last(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(-1))


def test_hand_built_logits_force_outcomes():
    vocab = 10
    target = torch.zeros(1, 3, vocab)
    target[0, :, 3] = 100.0  # the target is sure of token 3 everywhere
    draft_ok, draft_bad = torch.tensor([[3, 3]]), torch.tensor([[3, 5]])
    two = torch.tensor([2])
    greedy = GreedyRule()
    assert greedy.verify(draft_ok, None, target, two, None).num_accepted.item() == 2
    verdict = greedy.verify(draft_bad, None, target, two, None)
    assert (verdict.num_accepted.item(), verdict.next_tokens.item()) == (1, 3)

    rule = LosslessSamplingRule(SAMPLING)
    q = torch.full((1, 2, vocab), 1 / vocab)
    for seed in range(20):
        verdict = rule.verify(draft_bad, q, target, two, RowRandom([seed]))
        assert (verdict.num_accepted.item(), verdict.next_tokens.item()) == (1, 3)
    # -inf for the drafted token: rejection is certain and the recovery avoids that token
    forbid = torch.randn(1, 2, vocab)
    forbid[0, 0, 4] = float("-inf")
    for seed in range(50):
        verdict = rule.verify(
            torch.tensor([[4]]), q[:, :1], forbid, torch.tensor([1]), RowRandom([seed])
        )
        assert verdict.num_accepted.item() == 0 and verdict.next_tokens.item() != 4


def test_row_with_fewer_drafts_gets_bonus_at_its_own_end():
    vocab = 6
    target = torch.zeros(2, 4, vocab)
    target[:, :, 2] = 50.0
    target[1, 1, 5] = 100.0  # row 1: the position after its single draft token prefers 5
    drafts = torch.tensor([[2, 2, 2], [2, 0, 0]])
    verdict = GreedyRule().verify(drafts, None, target, torch.tensor([3, 1]), None)
    assert verdict.num_accepted.tolist() == [3, 1]
    assert verdict.next_tokens.tolist() == [2, 5]


def test_tokens_per_call_matches_closed_form():
    """Independent acceptance at rate a gives (1 - a^(k+1)) / (1 - a) tokens per target call."""
    a, k, n, vocab = 0.7, 4, 20000, 4
    target = torch.full((n, k + 1, vocab), (1 - a) / (vocab - 1))
    target[:, :, 0] = a  # a deterministic drafter proposes token 0; p(0) = a
    drafts = torch.zeros(n, k, dtype=torch.long)
    verdict = LosslessSamplingRule(SAMPLING).verify(
        drafts, None, target.log(), torch.full((n,), k), RowRandom(list(range(n)))
    )
    measured = float((verdict.num_accepted + 1).float().mean())
    expected = (1 - a ** (k + 1)) / (1 - a)
    assert measured == pytest.approx(expected, rel=0.02)


def test_top_k_top_p_processing():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all() and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    full = logits.softmax(-1)[0]
    top_p = float(full[0] + full[1] / 2)  # keeps token 0 and 1 (mass before 1 is < top_p)
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    assert (probs[0, :2] > 0).all() and (probs[0, 2:] == 0).all()
    greedy = logits_to_probs(logits, SamplingConfig())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_sample_from_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(1000, 5)
    uniforms = torch.linspace(0, 1 - 1e-7, 1000)
    tokens = sample_from(probs, uniforms)
    assert set(tokens.tolist()) == {1, 3}


def test_make_rule_by_name():
    assert make_rule(None, SamplingConfig()).name == "greedy"
    assert make_rule(None, SAMPLING).name == "sampling"
    with pytest.raises(ValueError, match="unknown verification rule"):
        make_rule("nope", SAMPLING)
    with pytest.raises(ValueError, match="temperature > 0"):
        make_rule("sampling", SamplingConfig())
