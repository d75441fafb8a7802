"""The one place a drafting setting (`config.DRAFTINGS`) becomes a drafter.

`make_drafter(setting, cfg, sources)` builds it from what the caller has loaded (`Sources`: the
drafter model if any, the lookup's n-grams if given) and refuses, at construction, what cannot
run: a setting that needs a drafter model without one, a length policy a drafter cannot read.
The acceptance head and the machine's prices are asked for only by the settings that read
them (a shipped head is loaded, prices are timed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.backends.base import ModelBackend
from specdecode.core.config import (
    DRAFTINGS,
    LOOKUP_ALONE,
    LOOKUP_FIRST,
    DecodeConfig,
    PromptLookup,
)
from specdecode.core.drafting.base import Drafter
from specdecode.core.drafting.corpus import BAND_PRIORS, CorpusIndex
from specdecode.core.drafting.lookup import PromptLookupDrafter
from specdecode.core.drafting.mixed import MixedDrafter
from specdecode.core.drafting.model import DeferredModelDrafter, ModelDrafter
from specdecode.core.drafting.planners import (
    Acceptance,
    FixedPlanner,
    PricedPlanner,
    PriceModel,
    model_can_pay,
)
from specdecode.core.length_policies import ConstantLength, make_policy
from specdecode.core.outcomes import Outcomes

LOOKUP_POLICIES = ("constant", "heuristic")  # fix a round's length with no drafter law to read


@dataclass(frozen=True)
class Sources:
    """What a drafter may be built from."""

    load_model: Callable[[], ModelBackend | None]  # the drafter model (loaded when asked for)
    lookup: PromptLookup | None  # the lookup's n-grams; None: the setting's own
    vocab_size: int  # the target's
    device: torch.device  # the target's
    head: Callable[[], torch.nn.Module | None]  # the acceptance head, for the head policies
    prices: Callable[[], PriceModel]  # this machine's prices, for drafting auto
    # what the plan's predicted gains have been worth here (asked after `prices`)
    outcomes: Callable[[], Outcomes | None] = lambda: None
    has_model: bool = True  # whether there is a drafter model to load
    model_context: int | None = None  # its tokens per row, known before it loads (None: none)
    rows: int = 1  # the most rows a batch of this drafter holds
    corpus: CorpusIndex | None = None  # drafts where the row's own text has none (auto only)
    # what drafting auto's planners learnt of each match length and corpus band, shared by the
    # planners of one decoder (`PricedPlanner`); None: each starts from the priors
    texts: dict[tuple[int, int], Acceptance] | None = None
    # the decoder's clock: a mixed drafter times its searches by it (`mixed.Rest`), as the
    # loop times its rounds and the prices their passes
    clock: Callable[[], float] = time.perf_counter

    @property
    def model(self) -> ModelBackend | None:
        return self.load_model() if self.has_model else None


def check_lookup_policy(name: str) -> None:
    """Lookup drafts without a model: policies that read a drafter's law or state cannot run."""
    if name not in LOOKUP_POLICIES:
        raise ValueError(
            f"prompt lookup drafts without a model, so the length policy {name!r} has no "
            "drafter law or hidden state to read; use constant or heuristic"
        )


def _needs_model(setting: str, sources: Sources) -> ModelBackend:
    if sources.model is None:
        raise ValueError(
            f"drafting {setting!r} drafts with a drafter model, and none is loaded: give one "
            "(drafter=..., --draft MODEL), or use drafting 'lookup' or 'auto'"
        )
    return sources.model


def _model(setting: str, cfg: DecodeConfig, sources: Sources) -> Drafter:
    model = _needs_model(setting, sources)
    policy = make_policy(cfg, sources.head())
    return ModelDrafter(model, cfg.sampling, sources.vocab_size, policy)


def _lookup(setting: str, cfg: DecodeConfig, sources: Sources) -> Drafter:
    check_lookup_policy(cfg.length_policy)  # before make_policy asks for a head
    lookup = sources.lookup or PromptLookup()
    return PromptLookupDrafter(lookup, make_policy(cfg), sources.vocab_size, sources.device)


def _lookup_first(setting: str, cfg: DecodeConfig, sources: Sources) -> Drafter:
    model = _model(setting, cfg, sources)
    planner = FixedPlanner(model.policy)
    return MixedDrafter(
        sources.lookup or LOOKUP_FIRST, model, planner, sources.vocab_size, clock=sources.clock
    )


def _auto(setting: str, cfg: DecodeConfig, sources: Sources) -> Drafter:
    """Lookup, the corpus (if any) and the drafter model (if any), each as far as it pays at
    this machine's prices: matches of 3-4 tokens before a drafter model (of 1-4 with none), and
    the corpus's drafts where the plan finds them worth more than the model's
    (`PricedPlanner`)."""
    if cfg.length_policy != "constant":
        raise ValueError(
            f"drafting {setting!r} plans each round's length from this machine's prices, so it "
            f"reads no length policy; {cfg.length_policy!r} decides how far a drafter model "
            "drafts: use it with drafting 'model' or 'lookup-first' (--drafting model)"
        )
    model = None
    prices = sources.prices()
    # a drafter model that could not pay here at any length or batch is not even loaded
    if sources.has_model and model_can_pay(prices, cfg.max_draft_tokens, sources.rows):
        policy = ConstantLength(cfg.max_draft_tokens)  # it drafts what the plan tells it

        def made() -> ModelDrafter:  # at the first round whose plan drafts by model
            return ModelDrafter(sources.model, cfg.sampling, sources.vocab_size, policy)

        model = DeferredModelDrafter(made, sources.model_context)
    lookup = sources.lookup or (LOOKUP_FIRST if model is not None else LOOKUP_ALONE)
    planner = PricedPlanner(
        lookup.max_ngram,
        model is not None,
        prices,
        cfg.max_draft_tokens,
        LOOKUP_FIRST.min_ngram,
        corpus_priors=BAND_PRIORS if sources.corpus is not None else (),
        outcomes=sources.outcomes(),
        texts=sources.texts,
    )
    return MixedDrafter(
        lookup, model, planner, sources.vocab_size, sources.corpus, clock=sources.clock
    )


BUILDERS: dict[str, Callable[[str, DecodeConfig, Sources], Drafter]] = {
    "auto": _auto,
    "model": _model,
    "lookup": _lookup,
    "lookup-first": _lookup_first,
}
assert tuple(sorted(BUILDERS)) == tuple(sorted(DRAFTINGS))


def make_drafter(setting: str, cfg: DecodeConfig, sources: Sources) -> Drafter:
    """A fresh drafter (drafters keep per-row state) for one decoding call."""
    if setting not in BUILDERS:
        raise ValueError(f"unknown drafting {setting!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[setting](setting, cfg, sources)
