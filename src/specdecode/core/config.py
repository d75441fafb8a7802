"""Decoding configuration: frozen dataclasses validated once, at construction.

Every knob a user can turn lives here, so that the engine never re-checks arguments in its hot
loop and the command line is built from the same fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
# 2.7 of 4 at a time, against 2.4 with 2-gram matches allowed (`drafters.LookupFirstDrafter`)


@dataclass(frozen=True)
class RoundPrices:
    """What a round costs on this machine, in steps of plain decoding (one target pass of one
    token): `draft` a drafted token, `verify[m - 1]` the verify pass over m drafted tokens.

    The SpecDec++ threshold rule is the optimal stop when every verify pass costs the same. A
    real pass does not: on a 2-core CPU one of 1 to 6 drafted tokens costs about one step and
    one of 6 or more about 1.1 to 1.35, as its products turn compute-bound; on a GPU the same
    happens at a tile boundary or a larger batch. A head policy given prices weighs each
    further token against what it adds to the round's cost (`length_policies.HeadLength`).
    `SpeculativeDecoder.measure_round_prices` times them; the bench uses its calibration.
    """

    draft: float
    verify: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify", tuple(float(v) for v in self.verify))
        if not (math.isfinite(self.draft) and self.draft > 0):
            raise ValueError(f"a drafted token's price must be finite and > 0, got {self.draft}")
        if not self.verify:
            raise ValueError("round prices need the verify pass's price for at least 1 token")
        bad = [v for v in self.verify if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"verify prices must be finite numbers > 0, got {bad}")

    def describe(self) -> str:
        verify = " / ".join(f"{v:.2f}" for v in self.verify)
        return f"a drafted token {self.draft:.3f} steps; a verify pass of 1.. drafted: {verify}"

    def added_cost(self, drafted: int, more: int) -> float:
        """Steps that drafting `more` tokens after `drafted` adds to the round (drafts and the
        verify pass's growth); drafted = 0 is the round's start (no verify pass priced yet)."""
        if drafted + more > len(self.verify):
            raise ValueError(
                f"round prices cover rounds of up to {len(self.verify)} drafted tokens, not "
                f"{drafted + more}"
            )
        grown = self.verify[drafted + more - 1] - (self.verify[drafted - 1] if drafted else 0.0)
        return more * self.draft + grown


@dataclass(frozen=True)
class PassPrices:
    """What passes cost on this backend and machine, in plain steps (a one-token target pass):
    `target[t - 1]` a target pass over t tokens in all (the rows of a batch together), `draft`
    a one-token drafter step (None: no drafter model).

    The priced policy (`length_policy="priced"`) plans every round from these. A pass's cost is
    read as a function of the tokens it holds in all: on llama.cpp a batch of 8 rows of one
    token costs about what one row of 8 tokens does (121 against 106 ms on the 1.5B target, 2
    cores), and a verify pass grows about half a step per token, so whether drafting pays
    depends on the batch and the machine, not only on the drafter.
    """

    target: tuple[float, ...]
    draft: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", tuple(float(v) for v in self.target))
        if not self.target or any(not (math.isfinite(v) and v > 0) for v in self.target):
            raise ValueError(f"pass prices must be finite numbers > 0, got {self.target}")
        if self.draft is not None and not (math.isfinite(self.draft) and self.draft > 0):
            raise ValueError(f"a drafter step's price must be finite and > 0, got {self.draft}")

    def pass_cost(self, tokens: int) -> float:
        """A target pass over `tokens` tokens; beyond the measured range, the line through the
        upper half of the measured passes. Not the last step's slope: two neighbouring timings
        are as noisy as their difference, and a flat last step once priced a batch of 8 rows
        of 9 tokens at the cost of 12 tokens, which made the priced policy draft at batch 8
        where it lost 40% to plain decoding."""
        known = len(self.target)
        if tokens <= known:
            return self.target[max(tokens, 1) - 1]
        half = max(known // 2, 1)
        if known - half >= 1 and known > 1:
            slope = (self.target[-1] - self.target[half - 1]) / (known - half)
        else:
            slope = self.target[-1]
        slope = max(slope, (self.target[-1] - 1.0) / max(known - 1, 1), 0.0)
        return self.target[-1] + slope * (tokens - known)

    def describe(self) -> str:
        passes = " / ".join(f"{v:.2f}" for v in self.target)
        drafter = f"; a drafter step {self.draft:.2f}" if self.draft is not None else ""
        return f"a target pass of 1.. tokens: {passes} steps{drafter}"


# the one default budget of new tokens: the API, the command line and every bench take it
# (the README's and the records' figures are at this length)
DEFAULT_MAX_NEW_TOKENS = 128


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
    length_policy: str = "constant"  # see `length_policies.POLICIES`
    stop_threshold: float | None = None  # confidence: least top probability; head: SpecDec++ h
    bound: tuple[int, int] | None = None  # (MIN, MAX) tokens per round of adaptive policies
    # sampling only: numbers keyed to positions and the bonus token drawn via the drafter, so
    # every length policy commits the same text for a seed (see `sampling.PositionRandom`)
    coupled: bool = False
    # rounds draft only while at most this many rows are running (None: always). Above it a
    # round is a plain step of every row: where a batch makes the target's pass compute-bound
    # (a CPU at batch 8 or more, `docs/findings.md`), verifying k + 1 positions a row costs
    # more than the drafts save. Rows that finish shrink the batch and drafting resumes.
    max_draft_batch: int | None = None
    # head policies: what a round costs here; None prices every verify pass alike (SpecDec++)
    round_prices: RoundPrices | None = None
    # the priced policy: this backend's pass prices (`PassPrices`); None: measured at first use
    pass_prices: PassPrices | None = None

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
        if self.pass_prices is not None and self.length_policy != "priced":
            raise ValueError(
                f"pass_prices are read by the priced policy, not {self.length_policy!r}"
            )
        if self.bound is not None:
            if self.length_policy == "constant":
                raise ValueError(
                    "bound (MIN, MAX) applies to the adaptive length policies; the constant "
                    "policy drafts num_draft_tokens every round"
                )
            low, high = self.bound
            if not (1 <= low <= high):
                raise ValueError(f"bound must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")

        if self.round_prices is not None:
            if self.length_policy not in HEAD_POLICIES:
                raise ValueError(
                    f"round_prices are read by the head policies, not {self.length_policy!r}"
                )
            if len(self.round_prices.verify) < self.draft_bound[1]:
                raise ValueError(
                    f"round_prices cover rounds of up to {len(self.round_prices.verify)} drafted "
                    f"tokens; the bound allows {self.draft_bound[1]}"
                )

    @property
    def policy_threshold(self) -> float:
        default = POLICY_DEFAULT_THRESHOLDS[self.length_policy]
        return default if self.stop_threshold is None else self.stop_threshold

    @property
    def draft_bound(self) -> tuple[int, int]:
        return self.bound if self.bound is not None else DEFAULT_BOUND

    @property
    def max_draft_tokens(self) -> int:
        """The longest round: sizes the verify window and the token buffer."""
        if self.length_policy == "constant":
            return self.num_draft_tokens
        return self.draft_bound[1]


# `transformers`' assistant_confidence_threshold default; for the head, the threshold that led
# most of the recorded SpecDec++ runs of the default pair (docs/adaptive-length.md)
POLICY_DEFAULT_THRESHOLDS = {
    "constant": 0.0,
    "heuristic": 0.0,
    "confidence": 0.4,
    "head": 0.7,
    "head-u": 0.8,  # its predictions also read the acceptance number: led on both sets replayed
    "priced": 0.0,  # no threshold: drafts as far as this machine's prices say it pays
}
POLICIES = tuple(POLICY_DEFAULT_THRESHOLDS)  # the length policies, by name (`length_policies`)
HEAD_POLICIES = ("head", "head-u")  # the policies that read an acceptance head
# the priced policy drafts only while this many rows run (unless max_draft_batch says otherwise):
# its prices are timed on one row, and a pass of 8 rows costs about 20% more than one row of as
# many tokens, which its plan does not see (measured at batch 8 on 2 cores: 0.69x plain decoding)
PRICED_DRAFT_BATCH = 1
DEFAULT_BOUND = (1, 8)  # at most 8: on a CPU a verify pass over more tokens is compute-bound


def max_draft_batch_option(value: int | None) -> int | None:
    """`--max-draft-batch` of the command line, where 0 means always draft (None here)."""
    if value is None or value == 0:
        return None
    if value < 0:
        raise ValueError(f"--max-draft-batch must be >= 0 (0: always draft), got {value}")
    return value
