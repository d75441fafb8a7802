"""Drafting settings: one factory, the mixed drafter's planners, one default everywhere.

The planners run on tiny random models with prices given by hand (`FakePrices`), so what the
priced plan does is decided by the prices alone, not by this machine's timings.
"""

from __future__ import annotations

import inspect
import time

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.torch_eager import CachedModel
from specdecode.bench.llamacpp import LLAMA
from specdecode.bench.methods import CAUSAL
from specdecode.cli.main import build_parser
from specdecode.core.config import DEFAULT_DRAFTING, DRAFTINGS, DecodeConfig, PromptLookup
from specdecode.core.drafting.corpus import CorpusIndex
from specdecode.core.drafting.factory import Sources, make_drafter
from specdecode.core.drafting.planners import (
    FixedPlanner,
    PricedPlanner,
    explored_caps,
    plan_lengths,
)
from specdecode.core.engine import decode
from specdecode.core.length_policies import ConstantLength
from specdecode.core.outcomes import Outcomes
from specdecode.core.prices import Prices
from specdecode.core.stats import DecodeStats, RowStats
from specdecode.core.verification import make_rule

# texts that repeat themselves (lookup finds matches) and one that does not
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 8, 9, 8, 9, 8], [4, 11, 2], [1, 2, 3, 4, 5, 6, 1, 2, 3]]
GREEDY = dict(max_new_tokens=24, stop_token_ids=[])


def priced(
    per_token_1: float = 0.05,
    per_token_8: float = 0.05,
    draft: float | None = 0.1,
    layout: str = "padded",
) -> Prices:
    """Prices where an even pass of r rows holding t tokens each costs 1 + 0.05 (r - 1) plus a
    share of a step, `per_token(r)`, for each token past one a row (from `per_token_1` at one
    row to `per_token_8` at eight); a drafter step `draft` a row it runs over."""

    def per_token(rows: int) -> float:
        share = min(max(rows - 1, 0) / 7, 1.0)
        return per_token_1 + share * (per_token_8 - per_token_1)

    rows = (1, 2, 4, 8)
    passes = [
        [1.0 + 0.05 * (r - 1) + per_token(r) * r * (t - 1) for t in range(1, 13)] for r in rows
    ]
    drafts = None if draft is None else tuple(draft * r for r in rows)
    return Prices(rows, tuple(map(tuple, passes)), drafts, layout=layout)


@pytest.fixture(scope="module")
def pair(tiny_llama, noisy_copy):
    target = tiny_llama(seed=0, init=0.3)
    return target, noisy_copy(target, 0.3)


@pytest.fixture(scope="module")
def decoder(pair) -> SpeculativeDecoder:
    target, drafter = pair
    return SpeculativeDecoder(target, drafter=drafter)


def run_with_prices(
    pair, prices: Prices, prompts=PROMPTS, model: bool = True, corpus: CorpusIndex | None = None
):
    """Greedy drafting `auto` on the tiny pair at the given prices -> (new tokens, stats)."""
    target, drafter = pair
    cfg = DecodeConfig(**GREEDY)
    sources = Sources(
        load_model=lambda: CachedModel(drafter, "drafter"),
        has_model=model,
        lookup=None,
        vocab_size=target.config.vocab_size,
        device=torch.device("cpu"),
        head=lambda: None,
        prices=lambda: prices,
        corpus=corpus,
    )
    drafting = make_drafter("auto", cfg, sources)
    stats = DecodeStats([RowStats() for _ in prompts])
    new: list[list[int]] = [[] for _ in prompts]
    rule = make_rule(None, cfg.sampling)
    for event in decode(CachedModel(target, "target"), drafting, rule, prompts, cfg, stats):
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            new[row].extend(tokens)
    return new, stats


# --- the priced planner --------------------------------------------------------------------------


def test_a_dear_drafter_step_is_never_planned(pair, decoder) -> None:
    plain = decoder.generate(PROMPTS, use_drafter=False, **GREEDY).new_tokens
    tokens, stats = run_with_prices(pair, priced(draft=5.0))
    assert tokens == plain
    assert stats.total.drafter_calls == 0 and stats.drafter_passes == 0  # the model: never
    assert stats.total.drafted > 0  # lookup (no drafter pass) still pays on repeating texts


def test_cheap_passes_make_the_model_draft(pair, decoder) -> None:
    plain = decoder.generate(PROMPTS, use_drafter=False, **GREEDY).new_tokens
    tokens, stats = run_with_prices(pair, priced(per_token_1=0.01, per_token_8=0.01))
    assert tokens == plain
    assert stats.total.drafter_calls > 0 and stats.drafter_passes > 0


def test_dear_passes_make_nothing_pay(pair) -> None:
    """Where every token in a pass costs a full step, no draft can pay: plain steps only."""
    _, stats = run_with_prices(pair, priced(per_token_1=1.0, per_token_8=1.0))
    assert stats.total.drafted == 0


def test_more_rows_at_a_dearer_token_draft_less() -> None:
    """The plan reads rows x tokens: the same rows' acceptance, one row alone against eight
    rows whose pass grows by a larger share of a step per token, drafts less a row."""
    prices = priced(per_token_1=0.05, per_token_8=0.2, draft=0.02)
    alone, _, _ = plan_lengths([0.8], [8], [8], [True], prices)
    eight, _, _ = plan_lengths([0.8] * 8, [8] * 8, [8] * 8, [True] * 8, prices)
    assert alone[0] > 0
    assert sum(eight) / 8 < alone[0]
    flat = priced(per_token_1=0.05, per_token_8=0.05, draft=0.02)  # as dear as one row
    assert sum(eight) < sum(plan_lengths([0.8] * 8, [8] * 8, [8] * 8, [True] * 8, flat)[0])


def test_plan_respects_caps_and_budgets() -> None:
    prices = priced(per_token_1=0.02, per_token_8=0.02, draft=0.6)
    rates, caps, budget = [0.9, 0.2, 0.9], [3, 8, 8], [8, 2, 8]
    real, pads, _ = plan_lengths(rates, caps, budget, [False, False, True], prices)
    assert real[0] == 3  # a likely lookup row drafts all it found
    assert all(r <= c for r, c in zip(real, [3, 8, 8], strict=True))
    assert all(r + p <= b for r, p, b in zip(real, pads, [8, 2, 8], strict=True))
    assert plan_lengths([0.9], [0], [8], [False], prices)[:2] == ([0], [0])  # nothing found
    assert plan_lengths([0.9], [4], [0], [False], prices)[:2] == ([0], [0])  # no room


def test_a_pass_run_by_levels_is_kept_even() -> None:
    """llama.cpp with a cache stream per row runs a ragged pass as a pass per level: where six
    of eight rows found a likely continuation, the two others pad with a filler so that the
    pass stays one even pass, not an even pass and another of six rows."""
    prices = priced(per_token_1=0.1, per_token_8=0.05, draft=None, layout="levels")
    rates, caps = [0.7] * 6 + [0.75, 0.75], [4] * 6 + [0, 0]
    real, pads, _ = plan_lengths(rates, caps, [4] * 8, [False] * 8, prices)
    assert real[6:] == [0, 0] and min(pads[6:]) > 0  # nothing to draft: a filler
    counts = [1 + r + p for r, p in zip(real, pads, strict=True)]
    assert len(set(counts)) == 1 and counts[0] > 1  # one even pass
    unpadded = prices.shape_cost([1 + r for r in real])
    assert prices.shape_cost(counts) < unpadded


def test_a_short_match_drafts_by_lookup_or_by_model_whichever_pays() -> None:
    """Eight rows whose texts end in a 2-token match (kept half the time) and a drafter model
    kept 9 times in 10: where a drafter step costs a good part of a target step, the rows draft
    their matches; where the drafter is nearly free, the model drafts them."""
    for draft, by_model in ((0.07, False), (0.001, True)):
        planner = PricedPlanner(4, True, priced(per_token_8=0.03, draft=draft), 4, first_ngram=3)
        planner.start(8)
        planner.by_ngram.kept[2], planner.by_ngram.rejected[2] = 1.0, 1.0
        planner.by_row.kept, planner.by_row.rejected = [9.0] * 8, [1.0] * 8
        plan = planner.plan([2] * 8, [4] * 8, [4] * 8, [0] * 8)
        assert plan.by_model == [by_model] * 8
        assert min(plan.lengths) > 0
    # a match of first_ngram tokens or more is always drafted by lookup
    planner = PricedPlanner(4, True, priced(draft=0.001), 4, first_ngram=3)
    planner.start(2)
    assert planner.plan([3, 0], [4, 0], [4, 4], [0, 0]).by_model == [False, True]


def test_corpus_drafts_keep_greedy_exact_and_are_drafted(pair, decoder) -> None:
    """A corpus holding the very texts plain decoding gives drafts them (more tokens kept than
    without it), and one of unrelated texts drafts wrong: greedy output is plain's either way."""
    plain = decoder.generate(PROMPTS, use_drafter=False, **GREEDY).new_tokens
    prices = priced(per_token_1=0.05, per_token_8=0.02, draft=None)
    _, alone = run_with_prices(pair, prices, model=False)
    right = CorpusIndex.build([p + t for p, t in zip(PROMPTS, plain, strict=True)] * 2)
    tokens, stats = run_with_prices(pair, prices, model=False, corpus=right)
    assert tokens == plain
    assert stats.total.accepted > alone.total.accepted
    g = torch.Generator().manual_seed(0)
    wrong = CorpusIndex.build([torch.randint(0, 32, (200,), generator=g).tolist()] * 2)
    tokens, stats = run_with_prices(pair, prices, model=False, corpus=wrong)
    assert tokens == plain


def test_a_corpus_draft_competes_with_the_model() -> None:
    """A corpus draft's key is no long match: where the drafter is nearly free and right far
    more often, the model drafts the row instead."""
    planner = PricedPlanner(
        4, True, priced(draft=0.001), 4, first_ngram=3, corpus_priors=(0.8, 0.6, 0.3)
    )
    planner.start(1)
    key = 4 + 1 + 2  # a corpus draft of the least clear band
    planner.by_ngram.kept[key], planner.by_ngram.rejected[key] = 1.0, 3.0
    planner.by_row.kept, planner.by_row.rejected = [9.0], [1.0]
    assert planner.plan([key], [4], [4], [0]).by_model == [True]


def test_a_corpus_band_starts_from_its_own_prior() -> None:
    """Before any draft is judged, a corpus draft whose choice was clear in the corpus drafts
    where one whose choice was not does not."""
    prices = priced(per_token_1=0.4, draft=None)
    planner = PricedPlanner(4, False, prices, 4, corpus_priors=(0.8, 0.6, 0.3))
    planner.start(1)
    clear, unclear = 4 + 1, 4 + 3
    assert planner.plan([clear], [2], [4], [0]).lengths[0] > 0
    assert planner.plan([unclear], [2], [4], [0]).lengths == [0]


def test_a_row_whose_prompt_the_corpus_missed_does_not_ask_it() -> None:
    """At one row, where a drafted token costs 0.4 of a step: a row whose prompt the corpus
    knew (its choices right 8 times in 10) drafts the corpus's clear guess, one whose prompt it
    missed (1 in 10) does not. A row's own refused drafts turn it off too, and the next row
    starts from the band's rate over the rows before it, which its own prompt can outweigh."""
    clear = 4 + 1

    def planner_for(evidence: list[tuple[int, int]] | None) -> PricedPlanner:
        planner = PricedPlanner(
            4, False, priced(per_token_1=0.4, draft=None), 4, corpus_priors=(0.8, 0.6, 0.3)
        )
        planner.start(1)
        if evidence is not None:
            planner.prime(0, evidence + [(0, 0), (0, 0)])
        return planner

    def drafts(planner: PricedPlanner) -> bool:
        return planner.plan([clear], [2], [4], [0]).lengths[0] > 0

    assert drafts(planner_for([(10, 8)]))
    assert not drafts(planner_for([(10, 1)]))
    planner = planner_for(None)
    assert drafts(planner)  # no evidence: the band's prior
    for _ in range(10):
        planner.observe([clear], [1], [0])
    assert not drafts(planner)
    planner.add_rows(1)
    planner.select_rows([1])  # a new row: the band's rate over the rows before, now low
    assert not drafts(planner)
    planner.prime(0, [(20, 19), (0, 0), (0, 0)])
    assert drafts(planner)


def test_a_row_is_primed_once_on_its_whole_prompt() -> None:
    """A row still prefilling (no budget this round) is not judged on the part of its prompt
    fed so far; once it has a budget, the corpus is run over all of it, and once only."""
    from specdecode.core.config import LOOKUP_ALONE
    from specdecode.core.drafting.mixed import MixedDrafter

    heard = []

    class Heard(PricedPlanner):
        def prime(self, row, evidence) -> None:
            heard.append((row, list(evidence)))
            super().prime(row, evidence)

    text = [1, 2, 3, 4] * 6  # [24]
    index = CorpusIndex.build([text, text])
    planner = Heard(4, False, priced(draft=None), 4, corpus_priors=(0.8, 0.6, 0.3))
    drafter = MixedDrafter(LOOKUP_ALONE, None, planner, 8, corpus=index)
    drafter.start(1)
    sequences = torch.tensor([text])  # [1, 24]
    drafter.propose(sequences, torch.tensor([8]), torch.tensor([0]), None)  # a first chunk
    assert heard == []
    for _ in range(2):
        drafter.propose(sequences, torch.tensor([24]), torch.tensor([4]), None)
        drafter.round = None
    assert heard == [(0, index.evidence(text))]
    assert sum(count for count, _ in heard[0][1]) == 23  # every position after the first


def test_fillers_keep_greedy_exact(pair, decoder, monkeypatch) -> None:
    """Rounds with filler tokens (prices where an even pass is cheap and a ragged one dear)
    give what plain decoding gives."""
    from specdecode.core.drafting import planners

    plain = decoder.generate(PROMPTS, use_drafter=False, **GREEDY).new_tokens
    planned = []
    real_plan = planners.plan_lengths

    def spy(*args, **kwargs):
        planned.append(real_plan(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(planners, "plan_lengths", spy)
    prices = priced(per_token_1=0.05, per_token_8=0.01, draft=None, layout="levels")
    tokens, stats = run_with_prices(pair, prices, model=False)
    assert tokens == plain
    assert any(sum(pads) for _, pads, _ in planned)  # fillers were drafted
    assert stats.total.drafted > 0


def test_priced_planner_learns_a_source_that_fails() -> None:
    """A model row whose drafts are all refused is planned shorter than at the start."""
    planner = PricedPlanner(4, True, priced(per_token_1=0.02, draft=0.05), max_tokens=8)
    planner.start(1)
    first = planner.plan([0], [0], [8], [1])[0][0]
    for _ in range(6):
        planner.observe([0], [max(first, 1)], [0])
    assert planner.plan([0], [0], [8], [1])[0][0] < first


def test_a_failing_match_length_stays_off_for_many_rounds() -> None:
    """One-token matches whose drafts fail are not drafted again after twenty rounds of other
    matches: a match length's acceptance is the texts', so it drifts back to the prior slowly
    (as fast as a model row's, it was tried again every third round), while a match length
    never tried still drafts at its prior."""
    planner = PricedPlanner(4, False, priced(per_token_1=0.3, draft=None), max_tokens=4)
    planner.start(1)
    for _ in range(8):
        planner.observe([1], [2], [0])
    for _ in range(20):
        planner.observe([4], [0], [0])
    assert planner.plan([1], [4], [4], [0]).lengths == [0]
    assert planner.plan([4], [4], [4], [0]).lengths[0] > 0


def test_a_match_length_that_failed_stays_off_in_the_next_call(pair) -> None:
    """What one call's plan learnt of a match length is where the next call's starts (a loop
    per `generate` call goes on as a server's one loop does): one-token matches that failed are
    not drafted at the next call's first round, while a fresh store drafts them at the prior.
    A new corpus starts the store afresh."""
    prices = priced(per_token_1=0.3, draft=None)
    texts: dict = {}
    first = PricedPlanner(4, False, prices, max_tokens=4, texts=texts)
    first.start(1)
    for _ in range(8):
        first.observe([1], [2], [0])
    later = PricedPlanner(4, False, prices, max_tokens=4, texts=texts)
    later.start(1)
    assert later.plan([1], [4], [4], [0]).lengths == [0]
    fresh = PricedPlanner(4, False, prices, max_tokens=4, texts={})
    fresh.start(1)
    assert fresh.plan([1], [4], [4], [0]).lengths[0] > 0
    target, draft = pair
    decoder = SpeculativeDecoder(target, drafter=draft)
    decoder.use_corpus(None)
    decoder.generate(PROMPTS, drafting="auto", prices=prices, **GREEDY)
    learnt = decoder._texts
    drafter = decoder._drafter(decoder.config(drafting="auto", prices=prices), True, None, None, 4)
    # the next call's planner reads what the first one learnt
    assert any(drafter.planner.by_ngram is rates for rates in learnt.values())
    decoder.use_corpus(None)
    assert decoder._texts == {}


def test_a_model_needs_a_priced_step() -> None:
    with pytest.raises(ValueError, match="needs its step's price"):
        PricedPlanner(4, True, priced(draft=None), max_tokens=8)


def test_fixed_planner_drafts_what_lookup_found_else_the_budget() -> None:
    planner = FixedPlanner(ConstantLength(4))
    budget = planner.budget(torch.tensor([6, 2, 4]))
    assert budget == [4, 2, 4]
    assert planner.plan([3, 0, 4], [2, 0, 4], budget, [0, 0, 0]) == (
        [2, 2, 4],
        [0, 0, 0],
        [False, True, False],
    )


# --- every setting is lossless ----------------------------------------------------------------


@pytest.mark.parametrize("drafting", [None, *DRAFTINGS])
def test_greedy_of_every_drafting_equals_plain(decoder, drafting) -> None:
    """None: the default setting, whatever it is."""
    plain = decoder.generate(PROMPTS, use_drafter=False, **GREEDY).new_tokens
    kwargs = {} if drafting is None else dict(drafting=drafting)
    out = decoder.generate(PROMPTS, num_draft_tokens=3, **kwargs, **GREEDY)
    assert out.new_tokens == plain
    if drafting in ("model", "lookup", "lookup-first"):  # not planned: they draft every round
        assert out.stats.total.drafted > 0
    if drafting == "lookup":
        assert out.stats.drafter_passes == 0


def test_auto_with_lookup_alone_equals_plain(pair) -> None:
    target, _ = pair
    decoder = SpeculativeDecoder(target, drafter=PromptLookup())
    plain = decoder.generate(PROMPTS, use_drafter=False, **GREEDY).new_tokens
    assert decoder.generate(PROMPTS, drafting="auto", **GREEDY).new_tokens == plain
    tokens, stats = run_with_prices(pair, priced(), model=False)
    assert tokens == plain and stats.total.drafted > 0 and stats.drafter_passes == 0


# --- one default, and the old spellings named ---------------------------------------------------


def test_the_default_drafting_agrees_everywhere() -> None:
    api = inspect.signature(SpeculativeDecoder.config).parameters["drafting"].default
    cli = build_parser().parse_args(["generate", "--prompt", "x"]).drafting
    assert api == cli == DecodeConfig().drafting == DEFAULT_DRAFTING
    assert LLAMA["specdecode"].drafting == CAUSAL["specdecode"].drafting == DEFAULT_DRAFTING
    assert "specdecode" in LLAMA and DEFAULT_DRAFTING in DRAFTINGS


def test_lookup_first_flag_is_the_drafting_setting() -> None:
    parse = build_parser().parse_args
    assert parse(["generate", "--prompt", "x", "--lookup-first"]).drafting == "lookup-first"
    assert parse(["generate", "--prompt", "x", "--drafting", "model"]).drafting == "model"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(drafting="auto", length_policy="confidence"), "use it with drafting 'model'"),
        (dict(drafting="lookup", length_policy="confidence"), "prompt lookup drafts without"),
        (dict(drafting="guess"), "unknown drafting 'guess'; known: auto"),
    ],
)
def test_settings_that_cannot_run_are_refused_at_construction(decoder, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        decoder.generate(PROMPTS, max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("drafting", ["model", "lookup-first"])
def test_model_settings_need_a_drafter_model(pair, drafting) -> None:
    alone = SpeculativeDecoder(pair[0])
    with pytest.raises(ValueError, match=f"drafting '{drafting}' drafts with a drafter model"):
        alone.generate(PROMPTS, max_new_tokens=2, drafting=drafting)


def test_a_drafter_far_behind_pays_its_catch_up_first() -> None:
    """A model row whose drafter cache lacks many tokens must feed them before it drafts: at
    prices where a row one token behind drafts, one a whole text behind does not."""
    prices = priced(per_token_1=0.05, draft=0.1)
    planner = PricedPlanner(4, True, prices, 4)
    planner.start(1)
    assert planner.plan([0], [0], [4], [1])[0][0] > 0
    assert planner.plan([0], [0], [4], [400])[0][0] == 0


def test_a_plan_drafts_only_where_its_gain_times_its_worth_beats_a_plain_step() -> None:
    """The worth drafting's judge measured scales what a drafting plan promises: at 1 the
    prices' own plan, lower fewer drafts (none where even the best promise falls short), 0 a
    plain round."""
    prices = Prices((1,), ((1.0, 1.3, 1.6, 1.9, 2.2, 2.5, 2.8, 3.1, 3.4),), (0.1,), 0.05)
    args = ([0.9, 0.6], [8, 8], [8, 8], [False, False], prices)
    full, _, promised = plan_lengths(*args)
    assert sum(full) > 0 and promised.ratio > 1
    fewer, _, _ = plan_lengths(*args, worth=0.9)
    assert sum(fewer) <= sum(full)
    plain = 2 / prices.even_cost(2, 1)  # a plain step's tokens per unit of cost
    none, pads, seen = plan_lengths(*args, worth=0.99 * plain / promised.ratio)
    assert sum(none) == sum(pads) == 0 and seen.ratio == pytest.approx(plain)
    assert plan_lengths(*args, worth=0.0)[0] == [0, 0]


def test_an_explored_drafting_round_drafts_one_token_a_row() -> None:
    """Where the judge explores drafting (its bolder worth), the plan drafts at most one token
    a row: on a machine where drafting loses every drafted token is paid for, and one measures
    the worth as well. Rounds that explore nothing plan as deep as the worth lets them."""
    prices = priced(per_token_1=0.1, per_token_8=0.1, draft=None)
    judge = Outcomes({4: 0.5}, explore_every=2)  # a worth that drafts nothing, explored soon
    planner = PricedPlanner(4, False, prices, 4, outcomes=judge)
    planner.start(4)
    depths = []
    for _ in range(12):
        plan = planner.plan([4] * 4, [4] * 4, [4] * 4, [0] * 4)
        depths.append((judge.explores(), max(plan.lengths), max(plan.fillers)))
        judge.observe([1 + max(plan.lengths)] * 4, 4, 1.0)
    explored = [d for kind, *d in depths if kind == "draft"]
    assert explored and all(k == 1 and f == 0 for k, f in explored)
    assert all(k == 0 for kind, k, _ in depths if kind is None)  # at 0.5 nothing pays
    bold = PricedPlanner(4, False, prices, 4)  # the same prices at worth 1: deeper drafts
    bold.start(4)
    assert max(bold.plan([4] * 4, [4] * 4, [4] * 4, [0] * 4).lengths) > 1


def test_an_explored_drafting_round_drafts_on_as_many_rows_as_the_machine_makes_cheap() -> None:
    """An exploration drafts one token on the row most likely to keep it, and on more rows
    only while the pass stays within `EXPLORED_COST` plain rounds (or costs no more: a padded
    pass): one row where each extra token costs most of a step, every row where rows are
    nearly free, never a row with nothing found."""
    caps, rates = [3, 3, 0, 3], [0.2, 0.9, 0.95, 0.5]
    dear = priced(per_token_1=0.9, per_token_8=0.9, layout="levels")
    assert explored_caps(caps, rates, dear) == [0, 1, 0, 0]
    cheap = priced(per_token_1=0.01, per_token_8=0.01, layout="levels")
    assert explored_caps(caps, rates, cheap) == [1, 1, 0, 1]
    padded = priced(per_token_1=0.9, per_token_8=0.9, layout="padded")
    assert explored_caps(caps, rates, padded) == [1, 1, 0, 1]
    judge = Outcomes({4: 0.5}, explore_every=2)
    planner = PricedPlanner(4, False, dear, 4, outcomes=judge)
    planner.start(4)
    drafted = []
    for _ in range(12):
        plan = planner.plan([4] * 4, [4] * 4, [4] * 4, [0] * 4)
        if judge.explores() == "draft":
            drafted.append(sum(k > 0 for k in plan.lengths) + sum(f > 0 for f in plan.fillers))
        judge.observe([1 + max(plan.lengths)] * 4, 4, 1.0)
    assert drafted and all(n <= 1 for n in drafted)


def test_a_mixed_drafter_times_its_searches_by_the_decoders_clock(decoder) -> None:
    """One clock per decoder: a caller that times the decoder its own way (a study that runs
    two decoders turn about, a simulated machine) has the search's rests timed the same way as
    the loop's rounds, not by the wall clock."""
    ticks = []

    def clock() -> float:
        ticks.append(1)
        return float(len(ticks))

    decoder.clock = clock
    try:
        loop = decoder.loop(max_rows=1, drafting="lookup-first")
    finally:
        decoder.clock = time.perf_counter
    assert loop.clock is clock and loop.drafter.rest.clock is clock


def test_a_search_that_keeps_nothing_rests_and_wakes_on_kept_drafts_or_a_new_row() -> None:
    """Rounds whose search keeps no token: after `QUIET` of them the search runs a round, then
    two, then at most `MOST_REST` rounds apart (a fifth of the rounds or fewer); searches
    whose drafts are kept run every round, and a row joining wakes a resting search."""
    from specdecode.core.config import LOOKUP_ALONE
    from specdecode.core.drafting.mixed import MOST_REST, QUIET, MixedDrafter

    searched, clock = [], [0.0]

    class Counted(MixedDrafter):
        def find(self, texts, lens, budget):
            searched.append(len(searched))
            clock[0] += 0.01  # a search's own time
            return super().find(texts, lens, budget)

    plain_text, repeating = list(range(10, 60)), [1, 2, 3, 4] * 12  # [50], [48]
    planner = PricedPlanner(4, False, priced(draft=None), 4)
    drafter = Counted(LOOKUP_ALONE, None, planner, 64, clock=lambda: clock[0])
    drafter.start(1)

    def rounds(text: list[int], count: int, kept: bool = True) -> list[int]:
        """Per round (its pass takes 1 s): the tokens drafted, all kept (`kept`) or all
        rejected."""
        lengths = []
        length = torch.tensor([len(text)])
        for _ in range(count):
            draft = drafter.propose(torch.tensor([text]), length, torch.tensor([4]), None)
            clock[0] += 1.0
            lengths.append(n := int(draft.lengths[0]))
            if n:
                drafter.rollback(length, torch.tensor([n]), torch.tensor([n if kept else 0]))
            else:
                drafter.round = None
        return lengths

    assert sum(rounds(plain_text, 400)) == 0
    assert QUIET + (400 - QUIET) // (MOST_REST + 1) <= len(searched) <= QUIET + 400 // MOST_REST
    assert any(rounds(repeating, 2 * MOST_REST))  # the text starts repeating mid-rest
    searched.clear()
    assert all(rounds(repeating, 20))  # drafts kept: a search every round
    assert len(searched) == 20
    searched.clear()
    rounds(repeating, 3 * QUIET, kept=False)  # drafts all rejected found nothing either
    assert drafter.rest.rest > 0 and len(searched) < 3 * QUIET
    drafter.add_rows([[7, 7]])  # a joining row wakes the search
    searched.clear()
    texts = torch.tensor([plain_text, plain_text])
    drafter.propose(texts, torch.tensor([50, 50]), torch.tensor([4, 4]), None)
    assert searched == [0]


@pytest.mark.parametrize(("search", "rests"), [(0.01, False), (0.06, True)])
def test_a_search_rests_where_what_it_keeps_does_not_pay_for_its_time(search, rests) -> None:
    """Searches that keep a token in ten, timed on the machine's clock against plain rounds
    of 1 s: at 0.01 s each they pay and run every round; at 0.06 s (0.1 kept a search is
    under `PAYS` times 0.06 plain rounds) they rest."""
    from specdecode.core.drafting.mixed import PAYS, QUIET, Rest

    assert (PAYS * search < 0.1) != rests
    clock = [0.0]
    rest = Rest(lambda: clock[0])
    searches = 0
    for i in range(20 * QUIET):
        if rest.begin():
            clock[0] += 1.0  # a plain round
            continue
        searches += 1
        clock[0] += search
        drafts = i % 2 == 0  # half the searches draft, one draft in five keeps a token
        rest.searched(drafts)
        clock[0] += 1.0
        if drafts:
            rest.found(1.0 if i % 10 == 0 else 0.0)
    assert (searches < 0.8 * 20 * QUIET) == rests
