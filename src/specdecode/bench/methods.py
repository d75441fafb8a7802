"""Decoding methods behind one signature: prompts (token ids) in, new tokens and time out.

* `ar`: this engine's plain autoregressive decoding of the target (the baseline).
* `hf`: `transformers` `generate` on the same target.
* `hf-assisted`: `transformers` assisted generation with the fp32 drafter, its defaults
  (heuristic schedule from 20 tokens, confidence threshold 0.4); batch size 1 only.
* `hf-assisted-k`: the same with the constant schedule of k tokens and no confidence cut.
* `sd`: this engine with the fp32 drafter (the same one `hf-assisted` gets), k draft tokens.
* `sd-int8`: this engine with an int8 dynamically quantized copy of the drafter.
* `sd-lookup`: this engine drafting by prompt lookup (`PromptLookup`: n-grams of 3 down to 1,
  the latest earlier occurrence), no drafter model; k tokens at most a round.
* `sd-int8-lookup`: `sd-int8` where a row's last 3 or 4 tokens occurred before, prompt lookup
  drafts instead of the model for that round (`LookupFirstDrafter`, `config.LOOKUP_FIRST`).
* `hf-lookup`: `transformers` prompt lookup decoding (`prompt_lookup_num_tokens=k`, n-grams of 3
  down to 1 as ours, its first occurrence); batch size 1 only.

A `+dense` suffix runs a method with the default PyTorch kernels instead of the prepacked ones
(target and fp32 drafter alike).

`sd` and `sd-int8` run under every length policy asked for (see `length_policies`): `constant`
once per k, `heuristic` starting from the largest k, `confidence` and `head` once per threshold,
the adaptive ones once per (MIN, MAX) bound of tokens per round (a sweep, like the thresholds:
SpecDec++'s own evaluation drafts at least 2 a round, and the floor decides how often a round is
cut after its first token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.kernels import quantize_int8, use_prepacked
from specdecode.backends.torch_eager import model_device
from specdecode.config import HEAD_POLICIES, LOOKUP_FIRST, PromptLookup, RoundPrices
from specdecode.stats import DecodeStats

KINDS_WITH_K = ("hf-assisted-k", "sd", "sd-int8", "sd-int8-lookup", "sd-lookup", "hf-lookup")
KINDS = ("ar", "hf", "hf-assisted", *KINDS_WITH_K)
BATCH1_ONLY = ("hf-assisted", "hf-assisted-k", "hf-lookup")
LOOKUP_KINDS = ("sd-lookup", "hf-lookup")  # no drafter model


ENGINE_KINDS = ("sd", "sd-int8", "sd-int8-lookup")  # the kinds that take a length policy


@dataclass(frozen=True)
class Method:
    kind: str
    k: int | None = None
    dense: bool = False
    policy: str = "constant"
    threshold: float | None = None  # confidence / head policies
    bound: tuple[int, int] | None = None  # adaptive policies: (MIN, MAX) tokens per round
    priced: bool = False  # head policies: weigh tokens against the run's calibrated prices

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown method {self.kind!r}; known: {', '.join(KINDS)}")
        if (self.k is not None) != (self.kind in KINDS_WITH_K):
            raise ValueError(
                f"method {self.kind!r}: k is {'required' if self.k is None else 'unused'}"
            )
        if self.policy != "constant" and self.kind not in ENGINE_KINDS:
            raise ValueError(f"method {self.kind!r} has no length policy {self.policy!r}")
        if (self.bound is not None) != self.adaptive:
            raise ValueError(
                f"method {self.kind!r} with policy {self.policy!r}: a bound is "
                f"{'required' if self.bound is None else 'unused'}"
            )
        if self.priced and self.policy not in HEAD_POLICIES:
            raise ValueError(f"only head policies are priced, not {self.policy!r}")

    @property
    def label(self) -> str:
        span = f" {self.bound[0]}..{self.bound[1]}" if self.bound is not None else ""
        if self.policy == "constant":
            inner = f"[k={self.k}]" if self.k is not None else ""
        elif self.policy == "heuristic":
            inner = f"[heuristic k0={self.k}{span}]"
        else:
            priced = " priced" if self.priced else ""
            inner = f"[{self.policy} t={self.threshold:g}{span}{priced}]"
        return self.kind + inner + ("+dense" if self.dense else "")

    @property
    def adaptive(self) -> bool:
        return self.policy != "constant"

    @classmethod
    def expand(
        cls,
        names: list[str],
        ks: list[int],
        policies: list[str] = ("constant",),
        thresholds: dict[str, list[float]] | None = None,
        bounds: list[tuple[int, int]] = ((1, 8),),
        priced: bool = False,
    ) -> list[Method]:
        """`sd` with ks [3, 4] gives sd[k=3] and sd[k=4]; `+dense` keeps default kernels.

        Adaptive policies run once per bound (and per threshold), labelled `... 1..12]`; with
        `priced`, head policies run once more with the calibrated round prices."""
        thresholds = thresholds or {}
        methods = []
        for name in names:
            kind, dense = name.removesuffix("+dense"), name.endswith("+dense")
            if kind not in KINDS_WITH_K:
                methods.append(cls(kind, None, dense))
                continue
            for policy in policies if kind in ENGINE_KINDS else ["constant"]:
                if policy == "constant":
                    methods += [cls(kind, k, dense) for k in ks]
                elif policy == "heuristic":
                    methods += [cls(kind, max(ks), dense, policy, None, b) for b in bounds]
                else:
                    pricing = (False, True) if priced and policy in HEAD_POLICIES else (False,)
                    methods += [
                        cls(kind, max(ks), dense, policy, t, b, p)
                        for p in pricing
                        for b in bounds
                        for t in thresholds.get(policy, [])
                    ]
        return methods


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    coupled: bool = False


@dataclass
class Result:
    new_tokens: list[list[int]]
    seconds: float
    stats: DecodeStats | None = None


@dataclass
class Models:
    """The models every method shares, so all of them run on the same weights."""

    target: torch.nn.Module
    tokenizer: object
    drafter: torch.nn.Module
    head: str | None = None  # acceptance head directory, for the `head` policy
    round_prices: dict[str, RoundPrices] = field(default_factory=dict)  # by kind, calibrated
    _decoders: dict[str, SpeculativeDecoder] = field(default_factory=dict)

    def decoder(self, kind: str) -> SpeculativeDecoder:
        if kind == "sd-int8-lookup":  # the same decoder (one int8 copy), looking up first
            return self.decoder("sd-int8")
        if kind not in self._decoders:
            drafter = None if kind == "ar" else self.drafter
            if kind == "sd-int8":
                drafter = quantize_int8(self.drafter)
            if kind == "sd-lookup":
                drafter = PromptLookup()
            decoder = SpeculativeDecoder(self.target, self.tokenizer, drafter)
            if self.head is not None and decoder.drafter is not None:
                decoder.load_head(self.head)
            self._decoders[kind] = decoder
        return self._decoders[kind]

    def drafter_model(self, kind: str) -> torch.nn.Module | None:
        if kind in ("ar", "hf", *LOOKUP_KINDS):
            return None
        return self.decoder(kind).drafter if kind.startswith("sd") else self.drafter


def run_engine(method: Method, models: Models, prompts: list[list[int]], s: Settings) -> Result:
    decoder = models.decoder(method.kind)
    out = decoder.generate(
        prompts,
        use_drafter=method.kind != "ar",
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        num_draft_tokens=method.k or 1,
        seed=s.seed,
        stop_token_ids=s.stop_token_ids,
        length_policy=method.policy,
        stop_threshold=method.threshold,
        bound=method.bound,
        coupled=s.coupled,
        round_prices=models.round_prices[method.kind] if method.priced else None,
        lookup_first=LOOKUP_FIRST if method.kind == "sd-int8-lookup" else None,
    )
    # A coupled run's extra drafter passes (bonus tokens drawn via the drafter) belong to the
    # pairing, not to the method: the time they took, measured on their own, is left out.
    return Result(out.new_tokens, out.stats.wall_seconds - out.stats.coupling_seconds, out.stats)


def run_transformers(method: Method, models: Models, prompts: list[list[int]], s: Settings):
    pad = models.tokenizer.pad_token_id if models.tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    device = model_device(models.target)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs: dict = dict(
        max_new_tokens=s.max_new_tokens,
        attention_mask=mask,
        pad_token_id=pad,
        eos_token_id=list(s.stop_token_ids) or None,
    )
    if s.temperature > 0:
        kwargs.update(do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if method.kind.startswith("hf-assisted"):
        kwargs["assistant_model"] = models.drafter
        config = models.drafter.generation_config
        if method.kind == "hf-assisted-k":
            config.num_assistant_tokens_schedule = "constant"
            config.num_assistant_tokens = method.k
            config.assistant_confidence_threshold = 0.0
        else:  # the library's defaults
            config.num_assistant_tokens_schedule = "heuristic"
            config.num_assistant_tokens = 20
            config.assistant_confidence_threshold = 0.4
    if method.kind == "hf-lookup":
        kwargs.update(prompt_lookup_num_tokens=method.k, max_matching_ngram_size=3)
    torch.manual_seed(s.seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = models.target.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    new = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in s.stop_token_ids), len(row))
        new.append(row[:cut])
    return Result(new, seconds)


RUNNERS: dict[str, Callable[[Method, Models, list[list[int]], Settings], Result]] = {
    "ar": run_engine,
    "sd": run_engine,
    "sd-int8": run_engine,
    "sd-int8-lookup": run_engine,
    "sd-lookup": run_engine,
    "hf-lookup": run_transformers,
    "hf": run_transformers,
    "hf-assisted": run_transformers,
    "hf-assisted-k": run_transformers,
}


def run_method(method: Method, models: Models, prompts: list[list[int]], s: Settings) -> Result:
    for model in (models.target, models.drafter):  # an int8 copy has no packed weights
        use_prepacked(model, not method.dense)
    try:
        return RUNNERS[method.kind](method, models, prompts, s)
    finally:
        for model in (models.target, models.drafter):
            use_prepacked(model, True)
