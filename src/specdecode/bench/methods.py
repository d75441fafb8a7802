"""Decoding methods behind one protocol, named in registries: what the runner measures.

The runner (`runner.measure`) knows nothing of models, tokenizers or backends: it asks a method
for its label, whether its output must equal the reference's, why it would not run at a batch
size, a warm-up (`prepare`) and a timed `run` on a batch of inputs. Causal and seq2seq methods
differ in what they take in (prompt token ids, source sentences) and how they decode, not in
how they are measured, so one runner and one report serve both. A method is one class
registered under its name (`CAUSAL.add` here, `SEQ2SEQ.add` in `seq2seq`): a new backend (say
llama.cpp: plain completion, its prompt-lookup decoding, this engine on its model) adds its
classes and nothing else; no list of names elsewhere needs it.

Causal methods (prompts in, new token ids out):

* `ar`: this engine's plain autoregressive decoding of the target (the baseline).
* `hf`: `transformers` `generate` on the same target.
* `hf-assisted`: `transformers` assisted generation with the fp32 drafter, its defaults
  (heuristic schedule from 20 tokens, confidence threshold 0.4); batch size 1 only.
* `hf-assisted-k`: the same with the constant schedule of k tokens and no confidence cut.
* `sd`: this engine with the fp32 drafter (the same one `hf-assisted` gets), k draft tokens.
* `sd-int8`: this engine with an int8 dynamically quantized copy of the drafter.
* `sd-lookup`: this engine drafting by prompt lookup (`PromptLookup`: n-grams of 3 down to 1,
  the latest earlier occurrence), no drafter model; k tokens at most a round.
* `sd-int8-lookup-first`: `sd-int8` where a row's last 3 or 4 tokens occurred before, prompt
  lookup drafts instead of the model for that round (drafting `lookup-first`).
* `specdecode`: this engine as `specdecode generate` runs it (`config.DEFAULT_DRAFTING`) with
  the fp32 drafter.
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

import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.kernels import quantize_int8, use_prepacked
from specdecode.backends.torch_eager import model_device
from specdecode.core.config import DEFAULT_DRAFTING, HEAD_POLICIES, PromptLookup
from specdecode.core.prices import Prices
from specdecode.core.stats import DecodeStats


@dataclass
class Result:
    """One timed call of a method on a batch."""

    token_ids: list[list[int]]  # per input row, the new tokens
    seconds: float
    stats: DecodeStats | None = None  # this engine's counts; None for other libraries' loops


class BenchMethod(Protocol):
    """What the runner needs of a decoding method, whatever its backend or model family."""

    @property
    def label(self) -> str:
        """The name of its row in the record: kind and settings, e.g. `sd[k=4]`."""
        ...

    @property
    def exact(self) -> bool:
        """Whether its output must equal the reference method's token for token (greedy and
        lossless); a difference is a mismatch, which fails the run."""
        ...

    @property
    def pairing(self) -> str | None:
        """Methods sharing a pairing must commit the same text (coupled sampling); None: no
        such promise."""
        ...

    def skips(self, batch_size: int) -> str | None:
        """Why it does not run at this batch size (said in the record), or None."""
        ...

    def prepare(self, sample: Sequence[Any]) -> None:
        """Build what it needs and run once: first calls pay for loading, allocation and lazy
        set-up, which must not land on the first measured batch."""
        ...

    def run(self, batch: Sequence[Any]) -> Result: ...


M = TypeVar("M", bound=type)


class Registry(dict[str, type]):
    """Method names to classes, filled by `add` where each class is defined."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family

    def add(self, cls: M) -> M:
        """Class decorator: the class's `name` now names it in `--methods`."""
        if cls.name in self:
            raise ValueError(f"{self.family} method {cls.name!r} registered twice")
        self[cls.name] = cls
        return cls

    def lookup(self, name: str) -> type:
        if name not in self:
            raise ValueError(f"unknown method {name!r}; known: {', '.join(self)}")
        return self[name]


CAUSAL = Registry("causal")

T = TypeVar("T")


@dataclass
class SharedModels:
    """What the methods of one run share (models, decoders, quantized copies), each built once
    on first use: a method asks for what it runs on, so a run loads only what its methods
    need, and a new backend's methods keep their model here beside the others'."""

    built: dict[str, Any] = field(default_factory=dict, kw_only=True, repr=False)

    def shared(self, key: str, build: Callable[[], T]) -> T:
        if key not in self.built:
            self.built[key] = build()
        return self.built[key]

    def release(self) -> None:
        """Drop every model now: a phase that starts processes of its own (peak memory per
        method) must not add their memory to all of this one's."""
        self.built.clear()
        gc.collect()


@contextmanager
def kernels(models: Sequence[torch.nn.Module], dense: bool) -> Iterator[None]:
    """Default PyTorch kernels instead of the prepacked ones for one call (`+dense`), then back:
    the models are shared by every method, and only the `+dense` ones run unpacked."""
    for model in models:
        use_prepacked(model, not dense)
    try:
        yield
    finally:
        for model in models:
            use_prepacked(model, True)


class SpecMethod:
    """The part every method built from a spec shares: label, batch-size limits, the kernel
    switch around its calls, and a warm-up that is one run. The spec is a frozen dataclass
    with `label` and `dense` (`Method`, `seq2seq.Seq2SeqMethod`)."""

    name: ClassVar[str]
    batch1_only: ClassVar[bool] = False

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def pairing(self) -> str | None:
        return None

    def skips(self, batch_size: int) -> str | None:
        return "batch size 1 only" if self.batch1_only and batch_size > 1 else None

    def prepare(self, sample: Sequence[Any]) -> None:
        self._switched(sample, warm=True)

    def run(self, batch: Sequence[Any]) -> Result:
        return self._switched(batch, warm=False)

    def _switched(self, batch: Sequence[Any], warm: bool) -> Result:
        with kernels(self.modules(), self.spec.dense):
            return self.decode(batch, warm)

    def modules(self) -> list[torch.nn.Module]:
        """The models its calls run, whose kernels `+dense` switches."""
        raise NotImplementedError

    def decode(self, batch: Sequence[Any], warm: bool) -> Result:
        raise NotImplementedError


# ---- causal language models ----


@dataclass(frozen=True)
class Method:
    """A causal method as asked for: its kind (a `CAUSAL` name) and settings."""

    kind: str
    k: int | None = None
    dense: bool = False
    policy: str = "constant"
    threshold: float | None = None  # confidence / head policies
    bound: tuple[int, int] | None = None  # adaptive policies: (MIN, MAX) tokens per round
    priced: bool = False  # head policies: weigh tokens against the run's calibrated prices

    def __post_init__(self) -> None:
        cls = CAUSAL.lookup(self.kind)
        if (self.k is not None) != cls.takes_k:
            raise ValueError(
                f"method {self.kind!r}: k is {'required' if self.k is None else 'unused'}"
            )
        if self.policy != "constant" and not cls.takes_policy:
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
        policies: Sequence[str] = ("constant",),
        thresholds: dict[str, list[float]] | None = None,
        bounds: Sequence[tuple[int, int]] = ((1, 8),),
        priced: bool = False,
    ) -> list[Method]:
        """`sd` with ks [3, 4] gives sd[k=3] and sd[k=4]; `+dense` keeps default kernels.

        Adaptive policies run once per bound (and per threshold), labelled `... 1..12]`; with
        `priced`, head policies run once more with the calibrated round prices."""
        thresholds = thresholds or {}
        methods = []
        for name in names:
            kind, dense = name.removesuffix("+dense"), name.endswith("+dense")
            traits = CAUSAL.lookup(kind)
            if not traits.takes_k:
                methods.append(cls(kind, None, dense))
                continue
            for policy in policies if traits.takes_policy else ["constant"]:
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
class Models(SharedModels):
    """The models every causal method shares, so all of them run on the same weights."""

    target: torch.nn.Module
    tokenizer: Any
    drafter: torch.nn.Module
    head: str | None = None  # acceptance head directory, for the `head` policy
    prices: dict[str, Prices] = field(default_factory=dict)  # by kind, calibrated (one row)

    def decoder(self, kind: str = "ar") -> SpeculativeDecoder:
        """The engine method `kind`'s decoder, built once and shared (`ar`'s encodes)."""
        cls = CAUSAL.lookup(kind)
        if not issubclass(cls, EngineMethod):
            raise ValueError(f"{kind!r} does not run this engine")

        def build() -> SpeculativeDecoder:
            decoder = SpeculativeDecoder(self.target, self.tokenizer, cls.make_drafter(self))
            if self.head is not None and decoder.drafter is not None:
                decoder.load_head(self.head)
            return decoder

        return self.shared(f"decoder {cls.decoder_of or cls.name}", build)


def build_causal(specs: Sequence[Method], models: Models, settings: Settings) -> list[CausalMethod]:
    return [CAUSAL.lookup(spec.kind)(spec, models, settings) for spec in specs]


class CausalMethod(SpecMethod):
    """A method decoding prompts (token ids) with a causal target; the traits say which
    settings the spec takes (`Method`) and where it runs."""

    takes_k: ClassVar[bool] = False  # swept over the numbers of draft tokens
    takes_policy: ClassVar[bool] = False  # runs under every length policy asked for
    cpu_kernels: ClassVar[bool] = False  # CPU kernels only (int8): refused on a GPU

    def __init__(self, spec: Method, models: Models, settings: Settings) -> None:
        super().__init__(spec)
        self.models = models
        self.settings = settings

    @property
    def exact(self) -> bool:
        return self.settings.temperature == 0

    @property
    def drafter_model(self) -> torch.nn.Module | None:
        """The model it drafts with (calibrated for c, counted in its memory); None for
        plain decoding and for lookup."""
        return None

    def modules(self) -> list[torch.nn.Module]:
        return [self.models.target, self.models.drafter]  # an int8 copy has no packed weights

    def decode(self, batch: Sequence[list[int]], warm: bool) -> Result:
        settings = replace(self.settings, max_new_tokens=8) if warm else self.settings
        return self.generate(list(batch), settings)

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        raise NotImplementedError


class EngineMethod(CausalMethod):
    """This engine (`SpeculativeDecoder.generate`) with the drafter `make_drafter` gives."""

    decoder_of: ClassVar[str | None] = None  # another kind whose decoder this one shares
    drafts: ClassVar[bool] = True  # False: plain decoding of the target
    drafting: ClassVar[str] = "model"  # how it drafts (`config.DRAFTINGS`)

    @classmethod
    def make_drafter(cls, models: Models) -> torch.nn.Module | PromptLookup | None:
        return models.drafter

    @property
    def pairing(self) -> str | None:
        # --coupled: every method of one drafter draws the same text
        return self.spec.kind if self.settings.coupled and self.drafts else None

    @property
    def drafter_model(self) -> torch.nn.Module | None:
        return self.models.decoder(self.spec.kind).drafter

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        method = self.spec
        out = self.models.decoder(method.kind).generate(
            prompts,
            use_drafter=self.drafts,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            num_draft_tokens=method.k or 1,
            seed=s.seed,
            stop_token_ids=s.stop_token_ids,
            drafting=self.drafting,
            length_policy=method.policy,
            stop_threshold=method.threshold,
            bound=method.bound,
            coupled=s.coupled,
            prices=self.models.prices[method.kind] if method.priced else None,
        )
        # A coupled run's extra drafter passes (bonus tokens drawn via the drafter) belong to
        # the pairing, not to the method: the time they took, measured on their own, is left out.
        seconds = out.stats.wall_seconds - out.stats.coupling_seconds
        return Result(out.new_tokens, seconds, out.stats)


@CAUSAL.add
class PlainDecoding(EngineMethod):
    name = "ar"
    drafts = False

    @classmethod
    def make_drafter(cls, models: Models) -> None:
        return None


@CAUSAL.add
class Speculative(EngineMethod):
    name = "sd"
    takes_k = takes_policy = True


@CAUSAL.add
class SpeculativeInt8(Speculative):
    name = "sd-int8"
    cpu_kernels = True

    @classmethod
    def make_drafter(cls, models: Models) -> torch.nn.Module:
        return quantize_int8(models.drafter)


@CAUSAL.add
class SpeculativeInt8LookupFirst(SpeculativeInt8):
    name = "sd-int8-lookup-first"
    decoder_of = "sd-int8"  # the same decoder (one int8 copy), looking up first
    drafting = "lookup-first"


@CAUSAL.add
class SpeculativeDefault(EngineMethod):
    name = "specdecode"  # as `specdecode generate` drafts
    decoder_of = "sd"  # the same decoder (the fp32 drafter)
    drafting = DEFAULT_DRAFTING


@CAUSAL.add
class SpeculativeLookup(EngineMethod):
    name = "sd-lookup"
    takes_k = True
    drafting = "lookup"

    @classmethod
    def make_drafter(cls, models: Models) -> PromptLookup:
        return PromptLookup()


class TransformersMethod(CausalMethod):
    """`transformers` `generate` on the target, its options given by `options`."""

    def options(self) -> dict[str, Any]:
        return {}

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        tokenizer, target = self.models.tokenizer, self.models.target
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        width = max(map(len, prompts))
        device = model_device(target)
        # left-padded: ids, mask [batch, width]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=s.max_new_tokens,
            attention_mask=mask,
            pad_token_id=pad,
            eos_token_id=list(s.stop_token_ids) or None,
        )
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        kwargs.update(self.options())
        torch.manual_seed(s.seed)

        def upto_stop(row: list[int]) -> list[int]:  # the stop token kept, as the engine does
            ends = [i + 1 for i, t in enumerate(row) if t in s.stop_token_ids]
            return row[: ends[0]] if ends else row

        return timed_generate(target, lambda: {"input_ids": ids, **kwargs}, width, upto_stop)


class InternalDeprecation(logging.Filter):
    """Drops the one deprecation notice transformers (5.x) logs about its own call: assisted
    generation calls `generate` on the assistant with the assistant's generation config and
    `min_new_tokens`/`max_new_tokens` beside it, which `generate`'s own check then reports as
    deprecated. Our calls pass keyword arguments only; the notice is about transformers'
    internals, printed on every run, and nothing a user of the bench can act on."""

    NOTICE = "Passing `generation_config` together with generation-related arguments"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.NOTICE not in record.getMessage()


@contextmanager
def quiet_generate() -> Iterator[None]:
    """`InternalDeprecation` on transformers' generation logger for the span of a call."""
    logger = logging.getLogger("transformers.generation.utils")
    notice = InternalDeprecation()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def timed_generate(
    model: torch.nn.Module,
    inputs: Callable[[], dict[str, Any]],
    start: int,
    cut: Callable[[list[int]], list[int]],
) -> Result:
    """`transformers` `generate`, timed from building its inputs (a tokenizer's work, where
    a method's input is text) to its output; each row's tokens from `start`, ended by `cut`.
    Its keyword arguments alone set the generation (no `generation_config` beside them)."""
    with quiet_generate(), torch.no_grad():
        started = time.perf_counter()
        out = model.generate(**inputs())  # [batch, start + new]
        seconds = time.perf_counter() - started
    return Result([cut(row) for row in out[:, start:].tolist()], seconds)


@CAUSAL.add
class Transformers(TransformersMethod):
    name = "hf"


@CAUSAL.add
class TransformersAssisted(TransformersMethod):
    """Its defaults: heuristic schedule from 20 tokens, confidence threshold 0.4."""

    name = "hf-assisted"
    batch1_only = True

    @property
    def drafter_model(self) -> torch.nn.Module:
        return self.models.drafter

    def schedule(self, config: Any) -> None:
        config.num_assistant_tokens_schedule = "heuristic"
        config.num_assistant_tokens = 20
        config.assistant_confidence_threshold = 0.4

    def options(self) -> dict[str, Any]:
        self.schedule(self.models.drafter.generation_config)  # shared: set on every call
        return {"assistant_model": self.models.drafter}


@CAUSAL.add
class TransformersAssistedK(TransformersAssisted):
    """The constant schedule of k tokens, no confidence cut."""

    name = "hf-assisted-k"
    takes_k = True

    def schedule(self, config: Any) -> None:
        config.num_assistant_tokens_schedule = "constant"
        config.num_assistant_tokens = self.spec.k
        config.assistant_confidence_threshold = 0.0


@CAUSAL.add
class TransformersLookup(TransformersMethod):
    name = "hf-lookup"
    takes_k = True
    batch1_only = True

    def options(self) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": self.spec.k, "max_matching_ngram_size": 3}


def drafter_kinds(methods: Sequence[CausalMethod]) -> dict[str, torch.nn.Module]:
    """Each kind's drafter model, for the kinds that draft with one (calibration, memory)."""
    return {m.spec.kind: m.drafter_model for m in methods if m.drafter_model is not None}
