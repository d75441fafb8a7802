"""Length policies choose how many tokens a row drafts, never which, so no policy may change
what is emitted.

Four layers: each policy's decisions on hand-built inputs (exact thresholds, bounds, per-row
state); the drafter's per-row stopping on tiny models; the acceptance head's weights, storage and
refusals; and end to end, greedy outputs identical to plain decoding and sampled laws equal to
the target's for every policy (with checks that the adaptive policies really vary the length,
so those tests are not vacuous).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from specdecode import SpeculativeDecoder
from specdecode.acceptance.head import (
    CONFIG_FILE,
    AcceptanceHead,
    HeadConfig,
    HeadMismatchError,
    ModelIdentity,
    law_features,
    load_head,
    top_two,
)
from specdecode.backends.torch_eager import CachedModel
from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.drafting import factory
from specdecode.core.drafting.base import Draft
from specdecode.core.drafting.model import ModelDrafter
from specdecode.core.length_policies import (
    ConfidenceLength,
    ConstantLength,
    DraftedPosition,
    HeadLength,
    HeuristicLength,
    LengthPolicy,
    make_policy,
)
from specdecode.core.prices import Prices
from specdecode.core.sampling import PositionRandom, RowRandom
from specdecode.core.verification import LosslessSamplingRule

# --------------------------------------------------------------------------------------------
# helpers


def logit(a: float) -> float:
    return math.log(a / (1 - a))


class ColumnHead(nn.Module):
    """A fake acceptance head: the logit is hidden[:, 0], so a test sets a = sigmoid(x) per row."""

    reads_law = reads_drawn = False

    def forward(self, hidden: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        return hidden[:, 0]


class ConstantHead(nn.Module):
    """Every drafted token gets the same acceptance probability `a`."""

    reads_law = reads_drawn = False

    def __init__(self, a: float) -> None:
        super().__init__()
        self.value = logit(a)

    def forward(self, hidden: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        return torch.full(hidden.shape[:1], self.value)


class RecordingHead(nn.Module):
    """Wraps a head and keeps the acceptance probabilities it predicted, call by call."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head
        self.reads_law, self.reads_drawn = head.reads_law, head.reads_drawn
        self.seen: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        out = self.head(hidden, features)
        self.seen.append(torch.sigmoid(out.double()))
        return out


class RecordingConfidence(ConfidenceLength):
    """Never stops; keeps the drafter's top probability at each position."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(0.0, 1, max_tokens)
        self.seen: list[torch.Tensor] = []

    def should_stop(self, position: DraftedPosition) -> torch.Tensor:
        self.seen.append(position.logits.double().softmax(-1).max(-1).values)
        return super().should_stop(position)


def at(index: int, batch: int = 2, **fields: torch.Tensor | None) -> DraftedPosition:
    """A drafted position; logits default to uniform (they matter to the confidence policy)."""
    logits = fields.get("logits")
    logits = torch.zeros(batch, 5) if logits is None else logits
    return DraftedPosition(
        index,
        logits,
        fields.get("probs"),
        fields.get("hidden"),
        fields.get("token"),
        fields.get("number"),
    )


def acceptance_hidden(a: torch.Tensor) -> torch.Tensor:
    """[batch] acceptance probabilities -> [batch, 2] hidden states for ColumnHead."""
    return torch.stack([torch.logit(a.double()).float(), torch.zeros_like(a).float()], 1)


def simulate_round(policy: LengthPolicy, acceptances: torch.Tensor, budget: list[int]) -> list[int]:
    """Drive a head policy like `ModelDrafter.propose` does: tokens drafted per row this round.

    acceptances: [batch, positions] the a_i the ColumnHead reports at each position.
    """
    limits = policy.round_limits(torch.tensor(budget))
    lengths = [0] * len(budget)
    active = [lim > 0 for lim in limits.tolist()]
    for i in range(int(limits.max())):
        for row, on in enumerate(active):
            lengths[row] += int(on)
        keep = policy.keep_drafting(at(i, len(budget), hidden=acceptance_hidden(acceptances[:, i])))
        rows = zip(active, limits.tolist(), keep.tolist(), strict=True)
        active = [on and lim > i + 1 and k for on, lim, k in rows]
        if not any(active):
            break
    return lengths


def first_stop(risks: list[float], h: float, low: int, high: int) -> int:
    """The SpecDec++ rule, written out: the least m >= MIN whose risk exceeds h, else MAX."""
    return next((m for m in range(low, high + 1) if risks[m - 1] > h), high)


def padded(prompts: list[list[int]], extra: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    sequences = torch.zeros(len(prompts), max(map(len, prompts)) + extra, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        sequences[row, : len(prompt)] = torch.tensor(prompt)
    return sequences, torch.tensor([len(p) for p in prompts])


def draft_once(model: nn.Module, policy: LengthPolicy, prompts: list[list[int]], k: int) -> Draft:
    """One greedy drafting round of a ModelDrafter over a ragged batch, each row allowed k."""
    vocab = model.config.vocab_size
    drafter = ModelDrafter(CachedModel(model), SamplingConfig(), vocab, policy)
    drafter.start(len(prompts))
    sequences, lens = padded(prompts)
    return drafter.propose(sequences, lens, torch.full((len(prompts),), k), None)


class RecordingDrafter(ModelDrafter):
    """Keeps, per round, the budget each row had and how many tokens it drafted."""

    rounds: ClassVar[list[tuple[list[int], list[int]]]] = []

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        draft = super().propose(sequences, seq_lens, max_tokens, rng)
        RecordingDrafter.rounds.append((max_tokens.tolist(), draft.lengths.tolist()))
        return draft


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """The decoder builds RecordingDrafters; the fixture returns their shared round log."""
    monkeypatch.setattr(factory, "ModelDrafter", RecordingDrafter)
    monkeypatch.setattr(RecordingDrafter, "rounds", [])
    return RecordingDrafter.rounds


def chosen_lengths(rounds: list[tuple[list[int], list[int]]], high: int) -> set[int]:
    """Draft lengths the policy chose, leaving out rows whose budget capped the round."""
    return {
        n for budget, lengths in rounds for b, n in zip(budget, lengths, strict=True) if b >= high
    }


# --------------------------------------------------------------------------------------------
# 1. decisions on hand-built inputs


def test_constant_clamps_to_k_and_to_each_rows_budget() -> None:
    policy = ConstantLength(3)
    assert policy.round_limits(torch.tensor([0, 1, 3, 4, 50])).tolist() == [0, 1, 3, 3, 3]
    assert policy.keep_drafting(at(0, 3)).tolist() == [True] * 3
    assert not policy.stops_early and not policy.needs_hidden


def test_heuristic_schedule_per_row() -> None:
    """+2 after a fully accepted round, -1 otherwise, within [MIN, MAX]; rows are independent."""
    policy = HeuristicLength(first=4, min_tokens=2, max_tokens=7)
    policy.start(4, torch.device("cpu"))
    assert policy.round_limits(torch.tensor([9, 9, 9, 3])).tolist() == [4, 4, 4, 3]
    # row 0 all in, row 1 one rejected, row 2 drafted nothing (budget spent), row 3 capped and in
    policy.observe(torch.tensor([4, 4, 0, 3]), torch.tensor([4, 3, 0, 3]))
    assert policy.k.tolist() == [6, 3, 4, 6]
    policy.observe(torch.tensor([6, 3, 4, 6]), torch.tensor([6, 0, 1, 6]))
    assert policy.k.tolist() == [7, 2, 3, 7]  # clamped at MAX 7; 3 - 1 = 2
    policy.observe(torch.tensor([7, 2, 3, 7]), torch.tensor([2, 0, 0, 7]))
    assert policy.k.tolist() == [6, 2, 2, 7]  # never below MIN 2
    assert policy.round_limits(torch.tensor([9, 9, 1, 9])).tolist() == [6, 2, 1, 7]
    policy.select_rows(torch.tensor([3, 0]))
    assert policy.k.tolist() == [7, 6]
    policy.observe(torch.tensor([7, 6]), torch.tensor([0, 6]))
    assert policy.k.tolist() == [6, 7]


@pytest.mark.parametrize(("first", "low", "high", "start"), [(10, 1, 6, 6), (0, 2, 6, 2)])
def test_heuristic_first_k_within_bounds(first: int, low: int, high: int, start: int) -> None:
    policy = HeuristicLength(first, low, high)
    policy.start(2, torch.device("cpu"))
    assert policy.k.tolist() == [start, start]


def confident_rows() -> torch.Tensor:
    """Row 0: top probability 0.9; row 1: uniform over five tokens, top probability 0.2."""
    probs = torch.tensor([[0.9, 0.025, 0.025, 0.025, 0.025], [0.2] * 5])
    return probs.log()


def test_confidence_stops_each_row_on_its_own() -> None:
    policy = ConfidenceLength(0.4, 1, 6)
    assert policy.round_limits(torch.tensor([2, 9])).tolist() == [2, 6]
    assert policy.keep_drafting(at(0, logits=confident_rows())).tolist() == [True, False]
    assert policy.keep_drafting(at(4, logits=confident_rows())).tolist() == [True, False]
    flipped = confident_rows().flip(0)
    assert policy.keep_drafting(at(0, logits=flipped)).tolist() == [False, True]


def test_confidence_min_bound_forces_drafting() -> None:
    policy = ConfidenceLength(0.4, 3, 6)
    policy.round_limits(torch.tensor([6, 6]))
    for index in (0, 1):  # index + 1 < MIN: go on whatever the confidence
        assert policy.keep_drafting(at(index, logits=confident_rows())).tolist() == [True, True]
    assert policy.keep_drafting(at(2, logits=confident_rows())).tolist() == [True, False]


def test_confidence_reads_the_sampling_law_when_given() -> None:
    """Under sampling the drawn-from law (after temperature, top-k) decides, not raw logits."""
    policy = ConfidenceLength(0.4, 1, 6)
    uniform_logits = torch.zeros(2, 5)
    probs = confident_rows().exp()
    assert policy.keep_drafting(at(0, logits=uniform_logits, probs=probs)).tolist() == [True, False]
    assert policy.keep_drafting(at(0, logits=confident_rows(), probs=probs.flip(0))).tolist() == [
        False,
        True,
    ]


@pytest.mark.parametrize("delta", [-1e-4, 1e-4])
def test_head_stops_exactly_when_risk_exceeds_threshold(delta: float) -> None:
    """After a1 = 0.9 and a2 = 0.8 the risk 1 - a1 a2 is 0.28: stop iff 0.28 > h."""
    h = 0.28 + delta
    policy = HeadLength(ColumnHead(), h, 1, 6)
    policy.round_limits(torch.tensor([6]))
    assert policy.keep_drafting(at(0, 1, hidden=acceptance_hidden(torch.tensor([0.9])))).item()
    keep = policy.keep_drafting(at(1, 1, hidden=acceptance_hidden(torch.tensor([0.8])))).item()
    assert keep == (delta > 0)


def test_head_per_row_and_reset_every_round() -> None:
    policy = HeadLength(ColumnHead(), 0.3, 1, 6)
    a = torch.tensor([[0.9, 0.8, 0.9, 0.9], [0.6, 0.99, 0.99, 0.99], [0.99] * 4])
    # risks: row 0 0.1, 0.28, 0.352 (stop, keeping the 3rd); row 1 0.4; row 2 < 0.04 (never)
    assert simulate_round(policy, a, [4, 4, 4]) == [3, 1, 4]
    # a new round forgets the last one's product (else row 0 would stop at once)
    assert simulate_round(policy, a, [4, 4, 2]) == [3, 1, 2]
    direct = HeadLength(ColumnHead(), 0.3, 1, 6)
    direct.round_limits(torch.tensor([6, 6]))
    for _ in range(5):  # many confident positions in one round accumulate past the threshold...
        direct.keep_drafting(at(0, hidden=acceptance_hidden(torch.tensor([0.95, 0.95]))))
    direct.round_limits(torch.tensor([6, 6]))  # ...but the next round starts from zero risk
    keep = direct.keep_drafting(at(0, hidden=acceptance_hidden(torch.tensor([0.95, 0.5]))))
    assert keep.tolist() == [True, False]


def test_head_min_bound_and_max_clamp() -> None:
    policy = HeadLength(ColumnHead(), 0.3, 3, 5)
    assert policy.round_limits(torch.tensor([0, 4, 5, 9])).tolist() == [0, 4, 5, 5]
    low = torch.full((1, 6), 0.1)  # risk 0.9 from the first token on
    assert simulate_round(policy, low, [9]) == [3]  # MIN 3 forces two more
    high = torch.full((1, 6), 0.999)
    assert simulate_round(policy, high, [9]) == [5]  # MAX ends the round


# A 2-core CPU's shape: verify passes of 1..5 drafted tokens cost one step, 6 and more jump
JUMP = Prices.stated(0.1, 0.0, (1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.11, 1.12))


def test_round_prices_arithmetic_and_refusals() -> None:
    rounds = JUMP.rounds(1)
    assert rounds.added_cost(5, 1) == pytest.approx(0.1 + 0.1)  # the jump
    assert rounds.added_cost(2, 3) == pytest.approx(0.3)  # flat stretch: drafts only
    assert rounds.added_cost(0, 1) == pytest.approx(1.1)  # a round's start: its verify pass
    assert rounds.added_cost(8, 4) == pytest.approx(0.4)  # past the stated curve: flat
    for bad, message in [
        (dict(draft=float("nan")), "draft must be a finite number >= 0"),
        (dict(draft=0.1, verify_curve=(1.0, -1.0)), "verify_curve must be a finite number"),
    ]:
        with pytest.raises(ValueError, match=message):
            Prices.stated(**bad)
    with pytest.raises(ValueError, match="read by drafting auto and the head policies"):
        DecodeConfig(drafting="model", length_policy="confidence", prices=JUMP)
    with pytest.raises(ValueError, match="need a drafter step's price"):
        HeadLength(ColumnHead(), 0.5, 1, 8, prices=Prices.stated(0.0))


@given(
    st.lists(st.floats(0.3, 0.999), min_size=8, max_size=8),
    st.floats(0.05, 0.95),
    st.floats(0.01, 1.0),
)
@settings(max_examples=60, deadline=None)
def test_flat_prices_decide_as_the_threshold_rule(
    acceptances: list[float], h: float, draft: float
) -> None:
    """With every verify pass priced alike, looking further never pays more than the next
    token: the priced rule is SpecDec++'s threshold rule, whatever a draft costs."""
    risks = [1 - math.prod(acceptances[:m]) for m in range(1, 9)]
    assume(all(abs(r - h) > 1e-6 for r in risks))  # no tie for float rounding to decide
    a = torch.tensor([acceptances])
    flat = HeadLength(ColumnHead(), h, 1, 8, prices=Prices.stated(draft, 0.0, (1.2,) * 8))
    assert simulate_round(flat, a, [8]) == [first_stop(risks, h, 1, 8)]


def test_priced_head_crosses_a_jump_only_when_it_will_go_far_beyond() -> None:
    """h = 0.5: the threshold rule drafts while P(all accepted) >= 0.5. At 5 drafted tokens
    the 6th costs a draft and the verify pass's jump, two drafts' worth, so one more token
    must pass a bar twice as high; a stretch beyond it spreads the jump over its tokens."""
    unpriced, priced = (
        HeadLength(ColumnHead(), 0.5, 1, 8),
        HeadLength(ColumnHead(), 0.5, 1, 8, prices=JUMP),
    )
    middling = torch.full((1, 8), 0.88)  # all accepted after 5: 0.53, after 8: 0.36
    assert simulate_round(unpriced, middling, [8]) == [6]  # 1 - 0.88^6 = 0.54 > 0.5
    assert simulate_round(priced, middling, [8]) == [5]  # the jump is not worth it
    sure = torch.full((1, 8), 0.995)
    assert simulate_round(unpriced, sure, [8]) == [8]
    assert simulate_round(priced, sure, [8]) == [8]  # two tokens past 5 pay for the jump
    # a bar row per drafted count: the 6th token's bar is (1 - h) x (0.1 + 0.1) / 0.1
    assert priced.bar[4, 0].item() == pytest.approx(0.5 * 2)
    assert priced.bar[0, 0].item() == pytest.approx(0.5)  # flat: the threshold rule's 1 - h
    assert torch.isinf(priced.bar[7]).all() and torch.isinf(priced.bar[2, 6:]).all()


def test_head_without_hidden_states_is_refused() -> None:
    policy = HeadLength(ColumnHead(), 0.3, 1, 4)
    policy.round_limits(torch.tensor([4]))
    with pytest.raises(ValueError, match="hidden"):
        policy.keep_drafting(at(0, 1))


def test_make_policy_builds_each_policy_from_the_config() -> None:
    constant = make_policy(DecodeConfig(drafting="model", num_draft_tokens=3))
    assert isinstance(constant, ConstantLength) and constant.num_draft_tokens == 3
    heuristic = make_policy(
        DecodeConfig(num_draft_tokens=3, drafting="model", length_policy="heuristic", bound=(2, 5))
    )
    assert isinstance(heuristic, HeuristicLength)
    assert (heuristic.first, heuristic.min_tokens, heuristic.max_tokens) == (3, 2, 5)
    confidence = make_policy(DecodeConfig(drafting="model", length_policy="confidence"))
    assert isinstance(confidence, ConfidenceLength)
    assert (confidence.threshold, confidence.min_tokens, confidence.max_tokens) == (0.4, 1, 8)
    head_cfg = DecodeConfig(
        drafting="model", length_policy="head", stop_threshold=0.2, bound=(2, 5)
    )
    head = make_policy(head_cfg, ColumnHead())
    assert isinstance(head, HeadLength) and head.needs_hidden and head.stops_early
    assert (head.threshold, head.min_tokens, head.max_tokens) == (0.2, 2, 5)
    assert (
        head_cfg.max_draft_tokens == 5
        and DecodeConfig(drafting="model", num_draft_tokens=3).max_draft_tokens == 3
    )


def test_make_policy_head_without_a_head() -> None:
    with pytest.raises(ValueError, match="needs an acceptance head"):
        make_policy(DecodeConfig(drafting="model", length_policy="head"))


BAD_THRESHOLD = r"stop_threshold must be in \(0, 1\)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            dict(drafting="model", length_policy="oracle"),
            "unknown length policy 'oracle'",
            id="name",
        ),
        pytest.param(
            dict(drafting="model", length_policy="confidence", stop_threshold=0.0),
            BAD_THRESHOLD,
            id="0",
        ),
        pytest.param(
            dict(drafting="model", length_policy="head", stop_threshold=1.0), BAD_THRESHOLD, id="1"
        ),
        pytest.param(
            dict(drafting="model", length_policy="head", stop_threshold=-0.2),
            BAD_THRESHOLD,
            id="neg",
        ),
        pytest.param(
            dict(drafting="model", length_policy="head", stop_threshold=float("nan")),
            BAD_THRESHOLD,
            id="nan",
        ),
        pytest.param(
            dict(drafting="model", length_policy="constant", stop_threshold=0.5),
            "not 'constant'",
            id="constant-h",
        ),
        pytest.param(
            dict(drafting="model", length_policy="heuristic", stop_threshold=0.5),
            "not 'heuristic'",
            id="heur-h",
        ),
        pytest.param(
            dict(drafting="model", length_policy="head", bound=(5, 3)),
            "1 <= MIN <= MAX",
            id="min>max",
        ),
        pytest.param(
            dict(drafting="model", length_policy="confidence", bound=(0, 3)),
            "1 <= MIN <= MAX",
            id="min<1",
        ),
    ],
)
def test_decode_config_refuses_bad_policy_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**kwargs)


# --------------------------------------------------------------------------------------------
# 2. per-row stopping inside the drafter

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24], [40], [7, 7, 7, 7, 7, 7]]
MAX = 6


@pytest.fixture(scope="module")
def peaked_drafter(tiny_llama) -> nn.Module:
    """A one-layer drafter with large weights: confident at some positions, not at others."""
    return tiny_llama(seed=1, layers=1, init=0.5)


def test_constant_head_ends_the_round_when_every_row_stops(peaked_drafter: nn.Module) -> None:
    """a = 0.9 everywhere, h = 0.25: risks 0.1, 0.19, 0.271 -> three tokens, three forwards."""
    draft = draft_once(peaked_drafter, HeadLength(ConstantHead(0.9), 0.25, 1, MAX), PROMPTS, MAX)
    assert draft.lengths.tolist() == [3] * len(PROMPTS) and draft.passes == 3
    drafter = ModelDrafter(
        CachedModel(peaked_drafter),
        SamplingConfig(),
        peaked_drafter.config.vocab_size,
        HeadLength(ConstantHead(0.9), 0.25, 1, MAX),
    )
    drafter.start(2)
    sequences, lens = padded(PROMPTS[:2])
    draft = drafter.propose(sequences, lens, torch.tensor([MAX, 2]), None)
    assert draft.lengths.tolist() == [3, 2] and draft.passes == 3


def spaced_threshold(
    values: torch.Tensor, stops: Callable[[float], torch.Tensor], low: int, early: bool
) -> tuple[float, list[int]]:
    """A threshold, away from every observed value, under which rows stop at different places
    (and, if `early`, all of them before MAX); with the lengths the rule predicts per row."""
    levels = values.flatten().unique().sort().values
    candidates = ((levels[1:] + levels[:-1]) / 2).tolist()
    gaps = (levels[1:] - levels[:-1]).tolist()
    for h, gap in sorted(zip(candidates, gaps, strict=True), key=lambda c: -c[1]):
        if gap < 2e-3:
            break
        stop = stops(h)  # [batch, MAX]
        lengths = [
            next((m for m in range(low, MAX + 1) if stop[b, m - 1]), MAX)
            for b in range(stop.shape[0])
        ]
        if len(set(lengths)) > 2 and (max(lengths) < MAX or not early):
            return h, lengths
    raise AssertionError("no threshold splits the rows; the test models no longer fit")


@pytest.mark.parametrize("kind", ["head", "confidence"])
def test_drafter_rows_stop_where_the_rule_says(
    peaked_drafter: nn.Module, kind: str, spread_head
) -> None:
    """Per-row draft lengths follow the rule applied to what a never-stopping round saw; each
    row drafts the same tokens as the row alone; the round costs the longest row's forwards."""
    if kind == "head":
        probe_head = RecordingHead(spread_head(32))
        probe = draft_once(peaked_drafter, HeadLength(probe_head, 1.0, 1, MAX), PROMPTS, MAX)
        acceptance = torch.stack(probe_head.seen, 1)  # [batch, MAX]
        risk = 1 - acceptance.cumprod(1)
        low = 1
        h, expected = spaced_threshold(risk, lambda h: risk > h, low, early=True)

        def policy() -> LengthPolicy:
            return HeadLength(spread_head(32), h, low, MAX)
    else:
        recorder = RecordingConfidence(MAX)
        probe = draft_once(peaked_drafter, recorder, PROMPTS, MAX)
        top = torch.stack(recorder.seen, 1)  # [batch, MAX]
        low = 2
        h, expected = spaced_threshold(top, lambda h: top < h, low, early=False)

        def policy() -> LengthPolicy:
            return ConfidenceLength(h, low, MAX)

    assert probe.lengths.tolist() == [MAX] * len(PROMPTS)
    draft = draft_once(peaked_drafter, policy(), PROMPTS, MAX)
    assert draft.lengths.tolist() == expected
    assert draft.passes == max(expected)
    assert max(expected) < MAX or kind == "confidence"  # the head round ends early
    for row, n in enumerate(expected):
        assert draft.tokens[row, :n].tolist() == probe.tokens[row, :n].tolist()
        alone = draft_once(peaked_drafter, policy(), [PROMPTS[row]], MAX)
        assert alone.lengths.tolist() == [n] and alone.passes == n
        assert alone.tokens[0, :n].tolist() == draft.tokens[row, :n].tolist()


# --------------------------------------------------------------------------------------------
# 3. the acceptance head: weights, storage, refusals


def test_head_layers_have_their_own_weights() -> None:
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=16, num_layers=3))
    weights = [block.linear.weight for block in head.blocks]
    assert len({w.data_ptr() for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    mlp = 3 * (16 * 16 + 16) + 16 + 1
    assert sum(p.numel() for p in head.parameters()) == mlp + 3 + 1  # + the law term
    before = weights[1].detach().clone()
    with torch.no_grad():
        weights[0].add_(1.0)
    assert torch.equal(weights[1], before)


def test_narrow_head_projects_then_runs_its_own_blocks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=16, num_layers=2, width=4)).eval()
    assert head.project is not None and head.project.weight.shape == (4, 16)
    assert [b.linear.weight.shape for b in head.blocks] == [(4, 4), (4, 4)]
    assert head.blocks[0].linear.weight.data_ptr() != head.blocks[1].linear.weight.data_ptr()
    projection, mlp = 16 * 4 + 4, 2 * (4 * 4 + 4) + 4 + 1
    assert sum(p.numel() for p in head.parameters()) == projection + mlp + 3 + 1
    with torch.no_grad():  # a non-zero output layer, so the state changes the logit
        head.out.weight.normal_()
    head.save(tmp_path)
    loaded = load_head(tmp_path)
    assert loaded.config.width == 4
    hidden, law = torch.randn(5, 16), law_features(torch.randn(5, 9).softmax(-1))
    assert torch.equal(loaded(hidden, law), head(hidden, law))
    assert not torch.allclose(head(hidden, law), head(hidden * 2, law))
    with pytest.raises(ValueError, match="width must be >= 1"):
        HeadConfig(hidden_size=16, width=0)


def named(model: nn.Module, name: str) -> nn.Module:
    model.config.name_or_path = f"tiny/{name}"
    return model


@pytest.fixture(scope="module")
def pair(tiny_llama) -> dict[str, nn.Module]:
    return {
        "target": named(tiny_llama(seed=0), "target-a"),
        "other_target": named(tiny_llama(seed=4), "target-b"),
        "drafter": named(tiny_llama(seed=1, layers=1), "drafter-a"),
        "other_drafter": named(tiny_llama(seed=2, layers=1), "drafter-b"),
    }


def saved_head(directory: Path, pair: dict[str, nn.Module], rule: str = "greedy") -> AcceptanceHead:
    torch.manual_seed(5)
    config = HeadConfig(
        hidden_size=32,
        rule=rule,
        drafter=ModelIdentity.of(pair["drafter"]),
        target=ModelIdentity.of(pair["target"]),
    )
    head = AcceptanceHead(config).eval()
    head.save(directory)
    return head


def test_head_save_load_round_trip(tmp_path: Path, pair: dict[str, nn.Module]) -> None:
    head = saved_head(tmp_path / "head", pair)
    loaded = load_head(tmp_path / "head", drafter=pair["drafter"], target=pair["target"])
    assert loaded.config == head.config and not loaded.training
    hidden, law = torch.randn(7, 32), law_features(torch.randn(7, 11).softmax(-1))
    assert torch.equal(loaded(hidden, law), head(hidden, law))


@pytest.mark.parametrize("role", ["drafter", "target"])
def test_head_for_another_model_is_refused(
    tmp_path: Path, pair: dict[str, nn.Module], role: str
) -> None:
    saved_head(tmp_path / "head", pair)
    given = dict(drafter=pair["drafter"], target=pair["target"])
    given[role] = pair[f"other_{role}"]
    with pytest.raises(HeadMismatchError) as error:
        load_head(tmp_path / "head", **given)
    message = str(error.value)
    for model in (pair[role], pair[f"other_{role}"]):
        identity = ModelIdentity.of(model)
        assert identity.name in message and identity.fingerprint in message
    assert role in message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_admits_its_models_loaded_in_lower_precision(
    tmp_path: Path, pair: dict[str, nn.Module], dtype: torch.dtype
) -> None:
    """Other bytes, the same weights: a head trained on the fp32 pair serves the pair in
    bfloat16 or float16; another model in that precision, or an fp32 model whose values moved
    without changing sign, is still refused."""
    saved_head(tmp_path / "head", pair)
    low = {role: copy.deepcopy(pair[role]).to(dtype) for role in ("drafter", "target")}
    assert load_head(tmp_path / "head", **low).config.drafter.name == "drafter-a"
    other = copy.deepcopy(pair["other_drafter"]).to(dtype)
    with pytest.raises(HeadMismatchError, match="drafter"):
        load_head(tmp_path / "head", drafter=other, target=low["target"])
    moved = copy.deepcopy(pair["drafter"])
    with torch.no_grad():
        moved.get_input_embeddings().weight.mul_(1.01)
    assert ModelIdentity.of(moved).signs == ModelIdentity.of(pair["drafter"]).signs
    with pytest.raises(HeadMismatchError, match="drafter"):
        load_head(tmp_path / "head", drafter=moved, target=pair["target"])


def test_head_rule_mismatch_is_refused(tmp_path: Path, pair: dict[str, nn.Module]) -> None:
    saved_head(tmp_path / "head", pair, rule="greedy")
    assert load_head(tmp_path / "head", rule="greedy").config.rule == "greedy"
    with pytest.raises(HeadMismatchError, match=r"greedy acceptance.*sampling verification"):
        load_head(tmp_path / "head", rule="sampling")


def test_missing_head_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no acceptance head at .*head_config\.json") as e:
        load_head(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(e.value) and "specdecode head train" in str(e.value)


@pytest.mark.parametrize(("rule", "temperature"), [("greedy", 0.8), ("sampling", 0.0)])
def test_generate_refuses_a_head_of_the_other_rule(
    pair: dict[str, nn.Module], rule: str, temperature: float
) -> None:
    head = AcceptanceHead(HeadConfig(hidden_size=32, rule=rule)).eval()
    decoder = SpeculativeDecoder(pair["target"], drafter=pair["drafter"], acceptance_head=head)
    with pytest.raises(ValueError, match=f"learnt {rule} acceptance"):
        decoder.generate(
            [[3, 4]],
            max_new_tokens=4,
            temperature=temperature,
            seed=0,
            drafting="model",
            length_policy="head",
        )


def test_generate_head_policy_without_head(pair: dict[str, nn.Module]) -> None:
    decoder = SpeculativeDecoder(pair["target"], drafter=pair["drafter"])
    with pytest.raises(ValueError, match="needs an acceptance head"):
        decoder.generate([[3, 4]], max_new_tokens=4, drafting="model", length_policy="head")


# --------------------------------------------------------------------------------------------
# 4. outputs unchanged by every policy

GREEDY_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24], [40]]
GREEDY_POLICIES: list[dict] = [
    dict(drafting="model", length_policy="constant", num_draft_tokens=1),
    dict(drafting="model", length_policy="constant", num_draft_tokens=3),
    dict(drafting="model", length_policy="heuristic"),
    dict(drafting="model", length_policy="confidence", stop_threshold=0.3),
    dict(drafting="model", length_policy="confidence", stop_threshold=0.9),
    *(
        dict(drafting="model", length_policy="head", stop_threshold=h, bound=bound)
        for h in (0.1, 0.5, 0.9)
        for bound in ((1, 6), (2, 4))
    ),
    dict(
        drafting="model",
        length_policy="head",
        stop_threshold=0.5,
        bound=(1, 6),
        prices=Prices.stated(0.2, 0.0, (1.0, 1.0, 1.0, 1.4, 1.45, 1.5)),
    ),
]


@pytest.fixture(scope="module")
def greedy_models(tiny_llama) -> dict[str, nn.Module]:
    """Large weights make the models confident at some positions: adaptive lengths vary."""
    target = tiny_llama(seed=0, init=0.8)
    return {
        "target": target,
        "other": tiny_llama(seed=1, layers=1, init=0.8),  # almost every draft rejected
        "same": target,  # every draft accepted: long rounds
    }


@pytest.mark.parametrize(("drafter", "max_new_tokens"), [("other", 12), ("same", 16)])
def test_greedy_output_identical_under_every_policy(
    greedy_models: dict[str, nn.Module],
    recorded: list[tuple[list[int], list[int]]],
    drafter: str,
    max_new_tokens: int,
    word_tokenizer,
    spread_head,
) -> None:
    """Same new tokens as plain greedy decoding; the drafted counts add up in the stats; every
    adaptive policy keeps within its bounds and chooses more than one length."""
    target = greedy_models["target"]
    decoder = SpeculativeDecoder(
        target, word_tokenizer(), greedy_models[drafter], acceptance_head=spread_head(32)
    )
    kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=[])
    plain = decoder.generate(GREEDY_PROMPTS, use_drafter=False, **kw).new_tokens
    unvaried = []
    for policy in GREEDY_POLICIES:
        recorded.clear()
        out = decoder.generate(GREEDY_PROMPTS, **kw, **policy)
        assert out.new_tokens == plain, policy
        total = out.stats.total
        drafted = [n for _, lengths in recorded for n in lengths]
        assert total.drafted == sum(drafted)
        assert out.stats.drafter_passes == sum(max(lengths) for _, lengths in recorded)
        if drafter == "same":
            assert total.acceptance_rate == 1.0
        else:
            assert total.recovered > 0
        high = DecodeConfig(**policy).max_draft_tokens
        chosen = chosen_lengths(recorded, high)  # lengths where the budget did not decide
        assert max(drafted) <= high
        if policy["length_policy"] == "constant":
            assert chosen == {policy["num_draft_tokens"]}
            continue
        assert min(chosen) >= policy.get("bound", (1, 8))[0]
        if len(chosen) < 2:
            unvaried.append(policy)
    assert not unvaried, "these adaptive policies always drafted one length"


@pytest.fixture(scope="module")
def small_models(tiny_llama, sampled_law) -> dict[str, nn.Module | list[torch.Tensor]]:
    """test_sampling_e2e's models and exact marginal laws, plus the target as its own drafter."""
    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    return {
        "target": target,
        "other": tiny_llama(seed=9, vocab=sampled_law.vocab, init=0.4, layers=1),
        "same": target,
        "marginals": sampled_law.exact_marginals(target),
    }


SAMPLE_ROWS = 2000


# (drafter, policy, stop threshold, bound, head) of the chi-square test below
ADAPTIVE_LAW_CASES = [
    # every draft accepted: a row that stops short of the round's longest row takes its
    # bonus token inside the first three positions
    ("same", "confidence", 0.5, (1, 3), "spread"),
    ("same", "head", 0.5, (1, 3), "spread"),
    # mostly rejected; this drafter's first two tokens are near certain, so rows part from
    # the third drafted position on: MIN 3, MAX 4
    ("other", "confidence", 0.7, (3, 4), "spread"),
    ("other", "head", 0.7, (3, 4), "spread"),
    # a head that reads the drawn token: the stop depends on the very token drawn
    ("same", "head", 0.5, (1, 3), "drawn"),
    ("other", "head", 0.5, (1, 4), "drawn"),
    # head-u: the stop after a token depends on that token's acceptance number, the very
    # number its verdict will use
    ("same", "head-u", 0.5, (1, 3), "numbered"),
    ("other", "head-u", 0.5, (1, 4), "numbered"),
    # priced: a round stops where one more token is not worth a verify pass's jump
    ("other", "head", 0.9, (1, 4), "priced"),
]
LAW_PRICES = Prices.stated(0.2, 0.0, (1.0, 1.0, 1.3, 1.35))
LAW_TOKENS = {"same": 4, "other": 5}  # new tokens per row: the "other" drafter's rows part later


@pytest.mark.parametrize(
    ("drafter", "policy", "threshold", "bound", "head_kind"),
    [
        pytest.param(*case, id=f"{case[0]}-{case[4]}-{case[1]}".replace("-spread", ""))
        for case in ADAPTIVE_LAW_CASES
    ],
)
def test_sampled_law_equals_target_under_adaptive_policy(
    small_models: dict,
    recorded: list[tuple[list[int], list[int]]],
    drafter: str,
    policy: str,
    threshold: float,
    bound: tuple[int, int],
    head_kind: str,
    sampled_law,
    drawn_head,
    numbered_head,
    spread_head,
) -> None:
    """The first three tokens of thousands of seeded rows (one prompt) follow the target's
    exact law, while the rows' first rounds draft different numbers of tokens."""
    heads = {"drawn": drawn_head, "numbered": numbered_head}
    head = heads.get(head_kind, lambda n: spread_head(n, rule="sampling"))(32)
    decoder = SpeculativeDecoder(
        small_models["target"], drafter=small_models[drafter], acceptance_head=head
    )
    out = decoder.generate(
        [list(sampled_law.prompt)] * SAMPLE_ROWS,
        max_new_tokens=LAW_TOKENS[drafter],
        temperature=sampled_law.sampling.temperature,
        top_k=sampled_law.sampling.top_k,
        top_p=sampled_law.sampling.top_p,
        row_seeds=range(SAMPLE_ROWS),
        stop_token_ids=[],
        drafting="model",
        length_policy=policy,
        stop_threshold=threshold,
        bound=bound,
        prices=LAW_PRICES if head_kind == "priced" else None,
    )
    first_round = recorded[0][1]
    assert len(set(first_round)) > 1, sorted(set(first_round))
    if drafter == "same":
        assert out.stats.total.acceptance_rate > 0.99
    tokens = torch.tensor(out.new_tokens)  # [rows, max_new_tokens]
    sampled_law.assert_follows(tokens, small_models["marginals"])


class FixedUniforms(RowRandom):
    """Every draw is the same number, so the token a law yields is known in advance."""

    def __init__(self, u: float, rows: int) -> None:
        super().__init__([0] * rows)
        self.u = u

    def uniform(self, counts: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.full((len(counts), max(counts)), self.u)


@pytest.mark.parametrize("u", [0.1, 0.9])
def test_row_that_drafted_less_than_the_batch_takes_its_bonus_from_the_target(u: float) -> None:
    """Adaptive policies leave rows with fewer drafts than the round's widest row; past a row's
    length its draft-law entries are padding, and its next token must follow the target alone.

    Target law (0.5, 0.5): u = 0.1 gives token 0 and u = 0.9 token 1, as for the row alone.
    """
    rule = LosslessSamplingRule(SamplingConfig(temperature=1.0))
    target_logits = torch.tensor([0.5, 0.5, 1e-9, 1e-9]).log().expand(2, 2, 4)  # [b, k + 1, V]
    draft_tokens = torch.tensor([[0], [0]])  # k = 1
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]).expand(2, 1, 4)  # row 1: padding
    verdict = rule.verify(
        draft_tokens, draft_probs, target_logits, torch.tensor([1, 0]), FixedUniforms(u, 2)
    )
    alone = rule.verify(
        draft_tokens[1:, :0],
        draft_probs[1:, :0],
        target_logits[1:, :1],
        torch.tensor([0]),
        FixedUniforms(u, 1),
    )
    expected = 0 if u < 0.5 else 1
    assert alone.next_tokens.tolist() == [expected]
    assert verdict.num_accepted.tolist()[1] == 0
    assert verdict.next_tokens.tolist()[1] == expected


def test_sampling_rows_with_own_seeds_equal_rows_alone_head_policy(
    recorded: list[tuple[list[int], list[int]]], tiny_llama, noisy_copy, spread_head
) -> None:
    target = tiny_llama(seed=0, init=0.3)
    decoder = SpeculativeDecoder(
        target,
        drafter=noisy_copy(target, 0.05),
        acceptance_head=spread_head(32, rule="sampling"),
    )
    seeds = [11, 22, 33, 44, 55]
    kw = dict(
        max_new_tokens=16,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        drafting="model",
        length_policy="head",
        stop_threshold=0.5,
        bound=(1, 6),
        stop_token_ids=[],
    )
    batched = decoder.generate(PROMPTS, row_seeds=seeds, **kw).new_tokens
    assert len(chosen_lengths(recorded, 6)) > 1
    alone = [
        decoder.generate([p], row_seeds=[s], **kw).new_tokens[0]
        for p, s in zip(PROMPTS, seeds, strict=True)
    ]
    assert batched == alone
    assert decoder.generate(PROMPTS, row_seeds=[s + 1 for s in seeds], **kw).new_tokens != batched


# --------------------------------------------------------------------------------------------
# 5. the SpecDec++ stopping rule, as a property


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 3),
    h=st.floats(0.01, 0.99),
    low=st.integers(1, 4),
    width=st.integers(0, 4),
)
def test_head_drafts_until_risk_exceeds_threshold(
    data: st.DataObject, rows: int, h: float, low: int, width: int
) -> None:
    """Per row: the least m >= MIN with 1 - a_1 ... a_m > h, else MAX, and never past the
    row's budget."""
    high = low + width
    acceptances = data.draw(
        st.lists(
            st.lists(st.floats(0.02, 0.999), min_size=high, max_size=high),
            min_size=rows,
            max_size=rows,
        )
    )
    budget = data.draw(st.lists(st.integers(0, high + 2), min_size=rows, max_size=rows))
    # what the policy sees: float32 logits; the rule is applied to exactly those values
    a = torch.sigmoid(torch.logit(torch.tensor(acceptances, dtype=torch.float64)).float().double())
    risks = (1 - a.cumprod(1)).tolist()  # [rows, high]
    assume(all(abs(r - h) > 1e-5 for row in risks for r in row))
    policy = HeadLength(ColumnHead(), h, low, high)
    got = simulate_round(policy, a.float(), budget)
    expected = [min(first_stop(r, h, low, high), b) for r, b in zip(risks, budget, strict=True)]
    assert got == expected


def test_law_features_on_a_hand_built_law() -> None:
    law = torch.tensor([[0.5, 0.25, 0.25, 0.0], [1.0, 0.0, 0.0, 0.0]])
    got = law_features(law)  # [2, 3]: log top, entropy, log margin (capped for a zero runner-up)
    expected_entropy = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    torch.testing.assert_close(got[0], torch.tensor([math.log(0.5), expected_entropy, math.log(2)]))
    assert got[1, 0] == 0 and got[1, 1] == 0 and got[1, 2] == 30.0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 700),
    rows=st.integers(1, 3),
    levels=st.integers(1, 6),
    chunk=st.sampled_from([2, 4, 128]),
    seed=st.integers(0, 2**16),
)
def test_top_two_is_topk(n: int, rows: int, levels: int, chunk: int, seed: int) -> None:
    """The chunked top-2 equals `topk(2)` exactly: few distinct values make ties inside and
    across chunks, and lengths that fill no whole chunk leave a tail."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, levels, (rows, 2, n), generator=gen).float() / levels  # [r, 2, n]
    assert torch.equal(top_two(values, chunk), values.topk(2, dim=-1).values)
    law = torch.randn(rows, n, generator=gen).softmax(-1)
    assert torch.equal(top_two(law, chunk), law.topk(2, dim=-1).values)


def test_top_two_finds_both_in_one_chunk_or_in_two() -> None:
    values = torch.zeros(1, 1000)
    values[0, 130], values[0, 131] = 5.0, 4.0  # both in chunk 1
    assert top_two(values).tolist() == [[5.0, 4.0]]
    values[0, 999] = 4.5  # the tail past the last whole chunk beats the runner-up
    assert top_two(values).tolist() == [[5.0, 4.5]]
    values[0, 3] = 4.75  # another chunk's maximum beats the best chunk's second entry
    assert top_two(values).tolist() == [[5.0, 4.75]]


def test_head_reads_the_law_it_was_drafted_from() -> None:
    """A head with law features gets them from the sampling law when there is one, else from
    softmax(logits); and the features move its prediction (they are not ignored)."""
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(hidden_size=4, num_layers=1)).eval()
    hidden = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="law_features"):
        head(hidden)
    peaked, flat = torch.tensor([[9.0, 0.0, 0.0]]), torch.zeros(1, 3)
    assert head(hidden, law_features(peaked.softmax(-1))) != head(
        hidden, law_features(flat.softmax(-1))
    )
    recorder = RecordingHead(head)
    policy = HeadLength(recorder, 0.99, 1, 4)
    policy.round_limits(torch.tensor([4]))
    policy.keep_drafting(at(0, 1, logits=peaked, hidden=hidden))
    policy.keep_drafting(at(1, 1, logits=peaked, probs=flat.softmax(-1), hidden=hidden))
    direct = [head.acceptance(hidden, law_features(law.softmax(-1))) for law in (peaked, flat)]
    torch.testing.assert_close(torch.cat(recorder.seen).float(), torch.cat(direct))


def test_law_features_of_the_drawn_token() -> None:
    law = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.1, 0.9, 0.0, 0.0]])
    got = law_features(law, torch.tensor([2, 0]))  # [2, 4]
    torch.testing.assert_close(got[:, :3], law_features(law))
    torch.testing.assert_close(got[:, 3], torch.tensor([math.log(0.25), math.log(0.1)]))


def test_head_reads_the_drawn_token(drawn_head) -> None:
    """A drawn-token head gets log q of the token the drafter drew (its prediction differs for a
    likely and an unlikely draw from one law); it refuses three features or a missing token."""
    head = drawn_head(4)
    hidden, law = torch.zeros(1, 4), torch.tensor([[0.7, 0.2, 0.1]])
    with pytest.raises(ValueError, match="reads 4 features"):
        head(hidden, law_features(law))
    recorder = RecordingHead(head)
    policy = HeadLength(recorder, 0.99, 1, 4)
    policy.round_limits(torch.tensor([4]))
    for i, token in enumerate((0, 2)):
        policy.keep_drafting(at(i, 1, probs=law, hidden=hidden, token=torch.tensor([token])))
    direct = [head.acceptance(hidden, law_features(law, torch.tensor([t]))) for t in (0, 2)]
    torch.testing.assert_close(torch.cat(recorder.seen).float(), torch.cat(direct))
    assert recorder.seen[0] > recorder.seen[1] + 0.2
    with pytest.raises(ValueError, match="drawn token"):
        policy.keep_drafting(at(2, 1, probs=law, hidden=hidden))
    with pytest.raises(ValueError, match="drawn_token needs law_features"):
        HeadConfig(hidden_size=4, law_features=False, drawn_token=True)


def test_heads_saved_before_law_features_load_without_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    old = AcceptanceHead(HeadConfig(hidden_size=8, num_layers=1, law_features=False)).eval()
    old.save(tmp_path)
    raw = json.loads((tmp_path / CONFIG_FILE).read_text())
    del raw["law_features"], raw["width"]  # what a head from before the features looks like
    (tmp_path / CONFIG_FILE).write_text(json.dumps(raw))
    loaded = load_head(tmp_path)
    assert not loaded.reads_law
    hidden = torch.randn(3, 8)
    torch.testing.assert_close(loaded(hidden), old(hidden))


# --------------------------------------------------------------------------------------------
# 6. head-u: the acceptance number, read before the verdict


def test_stream_numbers_read_while_drafting_are_the_ones_verification_uses() -> None:
    """RowRandom draws a token's acceptance number with the token; the policy reads it
    (`accept_uniforms`) and the verdict uses that very number, then one fresh number for the
    recovered or bonus token. Rows that stop drafting stop drawing."""
    rng = RowRandom([1, 2, 3])
    rng.begin_round(torch.zeros(3))
    seen = []
    for index, active in enumerate([[True, True, True], [True, False, True], [True, False, False]]):
        rng.draft_uniforms(index, active)
        seen.append(rng.accept_uniforms(index))
    num_drafted = torch.tensor([3, 1, 2])
    uniforms = rng.verify_uniforms(num_drafted, 3, "cpu")  # [3, 4]
    for row, n in enumerate(num_drafted.tolist()):
        assert uniforms[row, :n].tolist() == [seen[i][row].item() for i in range(n)]
        assert 0 < uniforms[row, n] < 1  # the recovered or bonus token's number
    assert seen[1][1].item() == 1.0  # row 1 drafted nothing at position 1
    # a drafter that draws no numbers (deterministic proposals): all drawn at verification
    rng.begin_round(torch.zeros(3))
    assert (rng.verify_uniforms(torch.tensor([2, 0, 1]), 2, "cpu")[0, :3] > 0).all()


def test_position_numbers_read_while_drafting_are_the_ones_verification_uses() -> None:
    rng = PositionRandom([5, 6], capacity=20)
    rng.begin_round(torch.tensor([3, 7]))
    uniforms = rng.verify_uniforms(torch.tensor([4, 4]), 4, "cpu")  # [2, 5]
    for index in range(4):
        assert torch.equal(rng.accept_uniforms(index), uniforms[:, index])


def test_head_u_stops_on_the_number(spread_head, numbered_head) -> None:
    """One head prediction, two numbers: a small u keeps the row drafting, u near 1 stops it,
    by the calibrated logit bias + a z + b log u."""
    hidden = torch.zeros(2, 2)
    z = spread_head(2, rule="sampling")(hidden).detach().float()  # [2] the same for both rows
    bias = -float(z[0]) - 1.0  # u = 1 alone: P(accept) = sigmoid(-1)
    head = numbered_head(2, calibration=(bias, 1.0, -3.0))
    policy = HeadLength(head, 0.5, 1, 8, reads_number=True)
    policy.round_limits(torch.tensor([8, 8]))
    number = torch.tensor([0.01, 0.99])
    keep = policy.keep_drafting(at(0, hidden=hidden, number=number))
    risk = 1 - torch.sigmoid(bias + z - 3.0 * number.log())
    assert keep.tolist() == (risk <= 0.5).tolist() == [True, False]
    with pytest.raises(ValueError, match="acceptance number"):
        policy.keep_drafting(at(1, hidden=hidden))


def test_head_u_settings_are_checked(
    pair: dict[str, nn.Module], tmp_path: Path, spread_head, numbered_head
) -> None:
    with pytest.raises(ValueError, match="only sampling draws"):
        DecodeConfig(drafting="model", length_policy="head-u")
    cfg = DecodeConfig(
        drafting="model", length_policy="head-u", sampling=SamplingConfig(0.7), stop_threshold=0.6
    )
    with pytest.raises(ValueError, match="head calibrate"):
        make_policy(cfg, spread_head(32, rule="sampling"))
    policy = make_policy(cfg, numbered_head(32))
    assert policy.name == "head-u" and policy.threshold == 0.6
    assert (
        DecodeConfig(
            drafting="model", length_policy="head-u", sampling=SamplingConfig(0.7)
        ).policy_threshold
        == 0.8
    )
    with pytest.raises(ValueError, match="only sampling verdicts"):
        HeadConfig(hidden_size=4, number_calibration=(0.0, 1.0, -1.0))
    with pytest.raises(ValueError, match="three finite numbers"):
        HeadConfig(hidden_size=4, rule="sampling", number_calibration=(0.0, float("nan"), 1.0))
    head = numbered_head(32, calibration=(0.25, 0.5, -2.0))
    head.save(tmp_path)
    assert load_head(tmp_path).config.number_calibration == (0.25, 0.5, -2.0)


def test_generate_head_u_is_reproducible_and_differs_from_head(
    recorded: list[tuple[list[int], list[int]]], tiny_llama, noisy_copy, numbered_head
) -> None:
    """The engine passes the numbers: head-u runs end to end, a row's text depends on its seed
    alone, and the numbers move its round lengths away from the plain head's."""
    target = tiny_llama(seed=0, init=0.3)
    decoder = SpeculativeDecoder(
        target, drafter=noisy_copy(target, 0.05), acceptance_head=numbered_head(32)
    )
    kw = dict(max_new_tokens=16, temperature=0.9, stop_threshold=0.5, bound=(1, 6),
              stop_token_ids=[], row_seeds=[11, 22, 33])  # fmt: skip
    first = decoder.generate(PROMPTS[:3], drafting="model", length_policy="head-u", **kw)
    rounds_u = list(recorded)
    assert len(chosen_lengths(rounds_u, 6)) > 1
    assert decoder.generate(
        PROMPTS[:3], drafting="model", length_policy="head-u", **kw
    ).new_tokens == (first.new_tokens)
    recorded.clear()
    decoder.generate(PROMPTS[:3], drafting="model", length_policy="head", **kw)
    assert [lengths for _, lengths in rounds_u] != [lengths for _, lengths in recorded]
