"""Coupled randomness: numbers keyed to positions, and bonus tokens drawn via the drafter.

Its promise is that a seeded row's sampled text does not depend on how many tokens any round
drafted, so every length policy commits the same text and wall-clock comparisons of policies are
paired. Its duty is that of every sampling path: the output law is the target's, exactly.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core import engine
from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.sampling import DRAFT, RESIDUAL, PositionRandom

# the policies, prompts, seeds and law check are conftest's `coupled_runs` (test_cuda runs them
# on a GPU)


@pytest.fixture(scope="module")
def decoder(tiny_llama, noisy_copy, drawn_head) -> SpeculativeDecoder:
    target = tiny_llama(seed=0, init=0.3)
    return SpeculativeDecoder(
        target, drafter=noisy_copy(target, 0.1), acceptance_head=drawn_head(32)
    )


def test_every_policy_commits_the_same_text(decoder: SpeculativeDecoder, coupled_runs) -> None:
    generate, policies = coupled_runs.generate, coupled_runs.policies
    outputs = {name: generate(decoder, True, **policy) for name, policy in policies.items()}
    texts = {name: out.new_tokens for name, out in outputs.items()}
    assert all(text == texts["k=1"] for text in texts.values()), texts
    # ... although the policies drafted differently and some drafts were rejected
    drafted = {name: out.stats.total.drafted for name, out in outputs.items()}
    assert len(set(drafted.values())) == len(policies), drafted
    assert 0.2 < outputs["k=3"].stats.total.acceptance_rate < 0.95
    assert all(out.stats.coupling_passes > 0 for out in outputs.values())
    # the control: stream randomness, the default, pairs nothing
    streams = [generate(decoder, False, **policies[name]).new_tokens for name in ("k=1", "k=7")]
    assert streams[0] != streams[1]


def test_first_round_costs_are_filed_apart(decoder: SpeculativeDecoder, coupled_runs) -> None:
    """The first round (both prefills) is filed apart, and verify time is read without the
    coupling pass, so that `bench`'s in-run costs per call leave out both."""
    s = coupled_runs.generate(decoder, True, drafting="model", num_draft_tokens=3).stats
    first = s.first_round_costs
    assert first.target_passes == 1  # one batch: one first round
    assert 1 <= first.drafter_passes < s.drafter_passes
    assert 0 < first.verify_seconds < s.verify_seconds - s.coupling_seconds
    assert 0 < first.draft_seconds < s.draft_seconds
    now = s.cost_figures()
    assert now.verify_seconds == pytest.approx(s.verify_seconds - s.coupling_seconds)
    assert s.coupling_seconds > 0
    assert (now.draft_seconds, now.target_passes, now.drafter_passes) == (
        s.draft_seconds,
        s.target_passes,
        s.drafter_passes,
    )


def test_rows_depend_on_their_own_seed_alone(decoder: SpeculativeDecoder, coupled_runs) -> None:
    head = coupled_runs.policies["head"]
    batched = coupled_runs.generate(decoder, True, **head).new_tokens
    alone = [
        decoder.generate(
            [list(prompt)],
            max_new_tokens=24,
            temperature=0.9,
            top_k=40,
            top_p=0.95,
            row_seeds=[seed],
            stop_token_ids=[],
            coupled=True,
            drafting="model",
            num_draft_tokens=5,
        ).new_tokens[0]
        for prompt, seed in zip(coupled_runs.prompts, coupled_runs.seeds, strict=True)
    ]
    assert batched == alone
    other_seeds = [s + 1 for s in coupled_runs.seeds]
    assert coupled_runs.generate(decoder, True, other_seeds, **head).new_tokens != alone


@pytest.mark.parametrize("policy", ["k=1", "k=3", "head"])
def test_sampled_law_equals_target(policy: str, coupled_runs) -> None:
    coupled_runs.assert_sampled_law_is_targets(policy)


def test_numbers_are_keyed_to_positions() -> None:
    rng = PositionRandom([7, 8], capacity=10)
    rng.begin_round(torch.tensor([2, 5]))
    first = rng.at(torch.tensor([[1], [0]]), DRAFT)  # positions 3 and 5
    rng.begin_round(torch.tensor([3, 4]))
    again = rng.at(torch.tensor([[0], [1]]), DRAFT)  # the same positions
    assert torch.equal(first, again)
    assert not torch.equal(first, rng.at(torch.tensor([[0], [1]]), RESIDUAL))
    rng.select([1])
    rng.begin_round(torch.tensor([5]))
    assert rng.at(torch.tensor([[0]]), DRAFT).item() == first[1, 0].item()


def test_coupled_greedy_is_refused() -> None:
    with pytest.raises(ValueError, match="coupled randomness pairs sampled text"):
        DecodeConfig(sampling=SamplingConfig(temperature=0.0), coupled=True)


def test_position_keys_alone_do_not_pair(
    decoder: SpeculativeDecoder, monkeypatch: pytest.MonkeyPatch, coupled_runs
) -> None:
    """Without the bonus drawn via the drafter, the same numbers give k=1 and k=7 other texts:
    a bonus token drawn from the target is another function of them than a drafted one."""
    monkeypatch.setattr(engine, "coupled_next_tokens", lambda *a: (a[4].next_tokens, False))
    policies = [coupled_runs.policies[name] for name in ("k=1", "k=7")]
    texts = [coupled_runs.generate(decoder, True, **policy).new_tokens for policy in policies]
    assert texts[0] != texts[1]


def test_unusable_drafter_law_at_a_bonus_position_is_refused(
    decoder: SpeculativeDecoder, monkeypatch: pytest.MonkeyPatch, coupled_runs
) -> None:
    """A NaN law read for a bonus token stops decoding with the step's logit error."""
    from specdecode.core.drafting.model import ModelDrafter
    from specdecode.core.sampling import InvalidLogitsError

    real = ModelDrafter.next_law

    def nan_law(self, sequences, seq_lens, rows):
        return real(self, sequences, seq_lens, rows) * float("nan")

    monkeypatch.setattr(ModelDrafter, "next_law", nan_law)
    with pytest.raises(InvalidLogitsError, match="NaN"):
        coupled_runs.generate(decoder, True, **coupled_runs.policies["k=1"])
