"""Decoding configuration: frozen dataclasses validated once, at construction.

Every knob a user can turn lives here, so that the engine never re-checks arguments in its hot
loop and the command line is built from the same fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model's module imports torch; a config is read before torch loads
    from specdecode.core.prices import Prices


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution; applied identically to the target and the drafter.

    `temperature == 0` means greedy decoding. `top_k == 0` disables top-k; `top_p == 1.0`
    disables nucleus filtering.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


PROMPT_LOOKUP = "prompt-lookup"  # the drafter name that asks for `PromptLookup` (CLI, bench)


@dataclass(frozen=True)
class PromptLookup:
    """Drafting by n-gram lookup in the text so far (prompt lookup decoding): no drafter model.

    The last `max_ngram` committed tokens are looked for earlier in the row's text (prompt and
    output), then the last `max_ngram - 1`, down to `min_ngram`; the tokens that followed their
    most recent earlier occurrence are the draft. A draft costs no model pass, so it pays
    wherever the output copies its context (code edits, quoting, extraction) and costs only
    the longer verify pass where it does not.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        for name in ("min_ngram", "max_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got min_ngram "
                f"{self.min_ngram} and max_ngram {self.max_ngram}"
            )


LOOKUP_FIRST = PromptLookup(max_ngram=4, min_ngram=3)  # lookup before a drafter model: only
# matches of 3 tokens or more, whose drafts the default pair's greedy HumanEval outputs accept
# 2.7 of 4 at a time, against 2.4 with 2-gram matches allowed (`drafting.mixed.MixedDrafter`)
LOOKUP_ALONE = PromptLookup(max_ngram=4, min_ngram=1)  # priced lookup with no drafter model:
# every match length, each priced by its own acceptance (`drafting.planners.PricedPlanner`)

# Where drafting auto drafts from a corpus (`drafting.corpus`): "stdlib" (this Python's standard
# library sources: code every machine holds; `corpora.STDLIB`), a text file or folder,
# or "none". The standard library by default under drafting auto: a row asks the corpus only
# as far as it knew the row's prompt and its drafts are kept, so a chat row soon stops
NO_CORPUS = "none"
DEFAULT_CORPUS = "stdlib"

# How tokens are drafted, one setting apart from how many (the length policy); built by
# `drafting.factory.make_drafter`, which alone maps these names to drafters.
DRAFTINGS = {
    "auto": "lookup where the text repeats itself, the drafter model elsewhere (if one is "
    "loaded), each only as far as this machine's prices say it pays, down to a plain step",
    "model": "the drafter model, under the length policy",
    "lookup": "prompt lookup: n-grams of the text itself, no drafter model",
    "lookup-first": "prompt lookup where the text's last 3-4 tokens occurred before, else the "
    "drafter model under the length policy",
}
DEFAULT_DRAFTING = "auto"  # the one default of the API, `specdecode generate`, bench and server
PLANNED_DRAFTINGS = ("auto",)  # settings that plan each round's length themselves (from prices,
# up to the bound's MAX), so they read no length policy


# the one default budget of new tokens: the API, the command line and every bench take it
# (the README's and the records' figures are at this length)
DEFAULT_MAX_NEW_TOKENS = 128
# the row length of a loop over a model that states no context (the server's bound for it too)
UNNAMED_CONTEXT = 1 << 16


@dataclass(frozen=True)
class DecodeConfig:
    """One generation call: budget, stopping, speculation length and randomness.

    `seed` seeds every row the same way; `row_seeds` (one per prompt) overrides it per row, so a
    row's output does not depend on which other prompts share its batch.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    num_draft_tokens: int = 4
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    row_seeds: tuple[int, ...] | None = None
    drafting: str = DEFAULT_DRAFTING  # how tokens are drafted: one of `DRAFTINGS`
    length_policy: str = "constant"  # how many a round (`length_policies`); `auto` plans its own
    stop_threshold: float | None = None  # confidence: least top probability; head: SpecDec++ h
    bound: tuple[int, int] | None = None  # (MIN, MAX) tokens per round of adaptive policies
    # sampling only: numbers keyed to positions and the bonus token drawn via the drafter, so
    # every length policy commits the same text for a seed (see `sampling.PositionRandom`)
    coupled: bool = False
    # rounds draft only while at most this many rows are running (None: always), an explicit
    # choice of the user's: above it a round is a plain step of every row. Rows that finish
    # shrink the batch and drafting resumes. Drafting `auto` needs none: its plan prices rows.
    max_draft_batch: int | None = None
    # what passes cost here (`prices.Prices`), read by the head policies (None: every verify
    # pass alike, SpecDec++) and drafting `auto`'s plan (None: timed or cached at first use)
    prices: Prices | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.num_draft_tokens, bool) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if self.row_seeds is not None and any(not isinstance(s, int) for s in self.row_seeds):
            raise ValueError(f"row_seeds must be integers, got {self.row_seeds}")
        if self.coupled and self.sampling.greedy:
            raise ValueError(
                "coupled randomness pairs sampled text across draft lengths; greedy decoding "
                "commits the same text under every length policy already (use temperature > 0)"
            )
        if self.length_policy == "head-u" and self.sampling.greedy:
            raise ValueError(
                "length policy 'head-u' reads each drafted token's acceptance number, which "
                "only sampling draws; greedy verdicts have none (use 'head')"
            )
        if self.max_draft_batch is not None and (
            isinstance(self.max_draft_batch, bool)
            or not isinstance(self.max_draft_batch, int)
            or self.max_draft_batch < 1
        ):
            raise ValueError(
                f"max_draft_batch must be an integer >= 1 (None: always draft), got "
                f"{self.max_draft_batch!r}"
            )
        if self.drafting not in DRAFTINGS:
            known = ", ".join(DRAFTINGS)
            raise ValueError(f"unknown drafting {self.drafting!r}; known: {known}")
        if self.length_policy not in POLICIES:
            known = ", ".join(POLICIES)
            raise ValueError(f"unknown length policy {self.length_policy!r}; known: {known}")
        if self.stop_threshold is not None:
            if self.length_policy not in ("confidence", *HEAD_POLICIES):
                raise ValueError(
                    f"stop_threshold is used by the confidence and head policies, not "
                    f"{self.length_policy!r}"
                )
            if not (math.isfinite(self.stop_threshold) and 0.0 < self.stop_threshold < 1.0):
                raise ValueError(f"stop_threshold must be in (0, 1), got {self.stop_threshold}")
        if (
            self.prices is not None
            and self.drafting not in PLANNED_DRAFTINGS
            and self.length_policy not in HEAD_POLICIES
        ):
            raise ValueError(
                f"prices are read by drafting auto and the head policies, not drafting "
                f"{self.drafting!r} with length policy {self.length_policy!r}"
            )
        if self.bound is not None:
            if not self.plans_lengths and self.length_policy == "constant":
                raise ValueError(
                    "bound (MIN, MAX) applies to the adaptive length policies and drafting "
                    "auto; the constant policy drafts num_draft_tokens every round"
                )
            low, high = self.bound
            if not (1 <= low <= high):
                raise ValueError(f"bound must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")

    @property
    def policy_threshold(self) -> float:
        default = POLICY_DEFAULT_THRESHOLDS[self.length_policy]
        return default if self.stop_threshold is None else self.stop_threshold

    @property
    def draft_bound(self) -> tuple[int, int]:
        return self.bound if self.bound is not None else DEFAULT_BOUND

    @property
    def plans_lengths(self) -> bool:
        """Whether the drafting plans each round's length itself (up to the bound's MAX)."""
        return self.drafting in PLANNED_DRAFTINGS

    def drafts_at(self, rows: int) -> bool:
        """Whether a round of `rows` running rows asks the drafter (`max_draft_batch`)."""
        return self.max_draft_batch is None or rows <= self.max_draft_batch

    @property
    def max_draft_tokens(self) -> int:
        """The longest round: sizes the verify window and the token buffer."""
        if self.length_policy == "constant" and not self.plans_lengths:
            return self.num_draft_tokens
        return self.draft_bound[1]

    @property
    def row_slack(self) -> int:
        """The room a row keeps past its prompt and budget: a last round may start a token
        short of the budget and still write its longest draft and the bonus token; one more
        is spare."""
        return self.max_draft_tokens + 2


# `transformers`' assistant_confidence_threshold default; for the head, the threshold that led
# most of the recorded SpecDec++ runs of the default pair (docs/adaptive-length.md)
POLICY_DEFAULT_THRESHOLDS = {
    "constant": 0.0,
    "heuristic": 0.0,
    "confidence": 0.4,
    "head": 0.7,
    "head-u": 0.8,  # its predictions also read the acceptance number: led on both sets replayed
}
POLICIES = tuple(POLICY_DEFAULT_THRESHOLDS)  # the length policies, by name (`length_policies`)
HEAD_POLICIES = ("head", "head-u")  # the policies that read an acceptance head
DEFAULT_BOUND = (1, 8)  # at most 8: on a CPU a verify pass over more tokens is compute-bound


def max_draft_batch_option(value: int | None) -> int | None:
    """`--max-draft-batch` of the command line, where 0 means always draft (None here)."""
    if value is None or value == 0:
        return None
    if value < 0:
        raise ValueError(f"--max-draft-batch must be >= 0 (0: always draft), got {value}")
    return value
