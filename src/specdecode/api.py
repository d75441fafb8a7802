"""The Python API: models and a tokenizer in, strings or token ids in, an output object out.

    decoder = SpeculativeDecoder(target, tokenizer, drafter=draft_model)
    out = decoder.generate(["def fib(n):"], max_new_tokens=64, num_draft_tokens=4)
    out.texts[0], out.stats.summary()

    SpeculativeDecoder(target, tokenizer, drafter=PromptLookup())  # drafts with no model

`drafting` says how tokens are drafted (`config.DRAFTINGS`; default `config.DEFAULT_DRAFTING`,
"auto": lookup and the drafter model, each only as far as it pays at this machine's prices);
"model" with a length policy (`length_policy="head"`, ...) drafts with the model alone.

`generate` and `stream` take the same keyword arguments as `transformers` users expect
(`max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`); `use_drafter=False` runs plain
autoregressive decoding on the same engine, the baseline of every speedup.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdecode.backend_names import LLAMA_CPP, TORCH, TORCH_BACKENDS, TORCH_STATIC
from specdecode.backends.base import ModelBackend
from specdecode.core.checks import (
    check_prompts,
    check_same_device,
    check_same_vocabulary,
    check_vocab_covers_tokenizer,
)
from specdecode.core.config import (
    DEFAULT_CORPUS,
    DEFAULT_DRAFTING,
    DEFAULT_MAX_NEW_TOKENS,
    HEAD_POLICIES,
    UNNAMED_CONTEXT,
    DecodeConfig,
    PromptLookup,
    SamplingConfig,
)
from specdecode.core.drafting.base import Drafter
from specdecode.core.drafting.corpus import CorpusIndex
from specdecode.core.drafting.factory import Sources, make_drafter
from specdecode.core.drafting.planners import Acceptance
from specdecode.core.engine import DecodeLoop, StepEvent, decode
from specdecode.core.outcomes import Outcomes
from specdecode.core.prices import Prices
from specdecode.core.sampling import RowSampling
from specdecode.core.stats import DecodeStats, RowStats
from specdecode.core.verification import make_rule
from specdecode.loading import (
    DeferredModel,
    ModelSource,
    as_backend,
    load_pair,
)
from specdecode.pricebook import LivePrices, PriceBook
from specdecode.prompts import Prompts, encode_prompts

log = logging.getLogger("specdecode")


def _torch_backends():
    """`backends.torch_eager` where it has been imported, else None: a PyTorch backend exists
    only once it has, so the checks below need not import it (nor, with it, `transformers`,
    which the llama.cpp backend never reads and which costs seconds before a first token)."""
    return sys.modules.get("specdecode.backends.torch_eager")


def module_of(backend: ModelBackend):
    """The transformers module under a PyTorch backend; any other backend as it is."""
    eager = _torch_backends()
    return backend.model if eager and isinstance(backend, eager.TorchDecoderInfo) else backend


@dataclass
class GenerationOutput:
    sequences: list[list[int]]  # prompt + generated ids, per prompt, in input order
    new_tokens: list[list[int]]  # generated ids only
    texts: list[str] | None  # generated text, when a tokenizer is known
    stats: DecodeStats


class SpeculativeDecoder:
    """A target model, optionally a drafter, and the engine that pairs them.

    The drafter is a small causal LM sharing the target's vocabulary, or `PromptLookup()` for
    drafting by n-gram lookup in the text itself.
    """

    def __init__(
        self,
        target: torch.nn.Module | ModelBackend,
        tokenizer=None,
        drafter: torch.nn.Module | ModelBackend | PromptLookup | None = None,
        drafter_tokenizer=None,
        acceptance_head: torch.nn.Module | None = None,
    ) -> None:
        self._target_lm = as_backend(target, "target")
        check_vocab_covers_tokenizer(self._target_lm.vocab_size, tokenizer, "target")
        # the drafter's backend, or a `DeferredModel` that loads it at its first use
        self._draft: ModelBackend | DeferredModel | None = None
        self.lookup = drafter if isinstance(drafter, PromptLookup) else None
        if self.lookup is not None:
            drafter = None
        if isinstance(drafter, DeferredModel):
            self._draft = drafter
        elif drafter is not None:
            self._draft = as_backend(drafter, "drafter")
            modules = module_of(self._target_lm), module_of(self._draft)
            if all(isinstance(m, torch.nn.Module) for m in modules):
                check_same_device(*modules)
        if tokenizer is not None and drafter_tokenizer is not None:
            check_same_vocabulary(tokenizer, drafter_tokenizer)
        # the torch module where the backend is PyTorch (heads, peers and kernels read it);
        # the backend itself otherwise
        self.target = module_of(self._target_lm)
        self.tokenizer = tokenizer
        self.acceptance_head = acceptance_head
        self._shipped_heads: dict[str, torch.nn.Module | None] = {}
        self.vocab_size = self._target_lm.vocab_size
        self.context = self._target_lm.context_length
        # the prices and drafting's judge; a deferred drafter keys them unloaded
        self.price_book = PriceBook(
            self._target_lm, lambda: self._draft, lambda: self._draft_lm, self.vocab_size,
            self.context,
        )  # fmt: skip
        self.corpus: CorpusIndex | None = None  # drafting auto's corpus (`use_corpus`)
        self.clock: Callable[[], float] = time.perf_counter  # rounds' and timings' seconds
        self._default_corpus: str | None = None  # read at the first drafting auto, if not chosen
        # what drafting auto's plans learnt of each lookup match length and corpus band, kept
        # from call to call (`PricedPlanner`); a new corpus starts it afresh
        self._texts: dict[tuple[int, int], Acceptance] = {}

    @property
    def target_backend(self) -> ModelBackend:
        """The target's `ModelBackend` (what prices and benches time passes through)."""
        return self._target_lm

    def settle(self) -> None:
        """Do now what the models would do beside their first passes, before a long run: a
        llama.cpp model's move to 2 MiB pages (`LlamaCppModel.settle`), which otherwise waits
        until the passes have repaid it. A server calls it before it answers: it runs for long,
        and its requests would otherwise meet the move, and drafting's judge would wait for
        it (`observe_round`). A drafter not loaded yet is left as it is."""
        from specdecode.backends.llamacpp import LlamaCppModel  # no llama.cpp for torch models

        for model in (self._target_lm, self._draft):
            if isinstance(model, LlamaCppModel):
                model.settle()

    @property
    def drafter_backend(self) -> ModelBackend | None:
        return self._draft_lm

    @property
    def _draft_lm(self) -> ModelBackend | None:
        """The drafter's backend, loaded here if it was deferred."""
        if isinstance(self._draft, DeferredModel):
            self._draft = self._draft.load()
            check_vocab_covers_tokenizer(self._draft.vocab_size, self.tokenizer, "drafter")
        return self._draft

    @property
    def drafter(self) -> torch.nn.Module | ModelBackend | None:
        """The drafter's torch module where the backend is PyTorch, the backend otherwise."""
        return module_of(self._draft_lm) if self._draft is not None else None

    @property
    def backend(self) -> str:
        """Which backend runs the target: "torch", "torch-static" or "llama.cpp"."""
        eager = _torch_backends()
        if eager is None or not isinstance(self._target_lm, eager.TorchDecoderInfo):
            return LLAMA_CPP
        if isinstance(self._target_lm, eager.CachedModel):
            return TORCH
        from specdecode.backends.torch_static import StaticCachedModel

        return TORCH_STATIC if isinstance(self._target_lm, StaticCachedModel) else LLAMA_CPP

    @classmethod
    def from_pretrained(
        cls, target: str | ModelSource, drafter: str | None = None, **options: Any
    ) -> SpeculativeDecoder:
        """Load known model names, local model directories or GGUF files, offline; the drafter
        "prompt-lookup" drafts by n-gram lookup with no model (`PromptLookup`). `target` may be
        a `loading.ModelSource` the caller resolved already (`loading.resolve`): its files are
        not looked up again. `options` are `loading.load_pair`'s (backend, threads, context,
        dtype, device, ...: said there), each checked before any weights are read.

        Drafting `auto` then also drafts from the standard library's code where a row's text
        has no match, as `specdecode generate` and `serve` do (indexed at its first use,
        seconds, then cached; `use_corpus(None)` turns it off).
        """
        decoder = cls(*load_pair(target, drafter, **options))
        decoder._default_corpus = DEFAULT_CORPUS  # what `generate` and `serve` read
        return decoder

    def prices(
        self, rows: int = 1, retime: bool = False, cache_dir: str | Path | None = None
    ) -> Prices:
        """What passes cost on this backend here, for batches of up to `rows` rows (timed at
        `pricebook.timed_rows(rows)`): what the priced and head policies weigh drafting against.

        Kept for this decoder once known; read from the cache (`pricebook.prices_folder`:
        `<key>.json`, keyed by the model files, backend, threads and CPU) where an entry covers
        these rows,
        else timed (seconds; a minute or more for 8 rows on a CPU) and stored there. `retime`
        times afresh whatever is kept. A model built in memory (no files to key it by) is
        timed once per decoder and not cached.
        """
        return self.price_book.prices(rows, retime, cache_dir, self.clock)

    @property
    def known_prices(self) -> Prices | None:
        """The prices this decoder holds now, or None where it has timed or read none: unlike
        `prices()`, never a timing."""
        return self.price_book.known

    @property
    def outcomes(self) -> Outcomes | None:
        """Drafting's judge: what the plan's predicted gains have been worth here, by row count
        (`snapshot()`), and its corrections; None before any prices are known."""
        return self.price_book.outcomes

    def use_prices(self, prices: Prices) -> None:
        """Take prices another decoder of the same model files found (`prices()` of a decoder
        closed to free its memory, now loaded again): its timing stands, where a model built
        in memory has no cache entry and a reload would time a minute afresh. They are not
        stored anew; what drafting has been worth starts afresh."""
        self.price_book.use(prices)

    def use_corpus(
        self, corpus: str | CorpusIndex | None, cache_dir: str | Path | None = None
    ) -> None:
        """Draft from a corpus where a row's own text has no match (drafting `auto`): "stdlib"
        (this Python's standard library, for code), a text file or a folder of them, an index
        built already, or None (no corpus). A named corpus is tokenized and indexed once, then
        read from the cache (`<cache>/corpora`)."""
        self._default_corpus = None  # chosen
        self._texts = {}  # its bands are another corpus's
        if corpus is None or isinstance(corpus, CorpusIndex):
            self.corpus = corpus
            return
        from specdecode.corpora import named_index

        self.corpus = named_index(corpus, self.tokenizer, cache_dir)

    def _read_default_corpus(self) -> None:
        """The default corpus, indexed (or read from the cache) once; a Python without its
        standard library's sources drafts without one, and says so."""
        name = self._default_corpus
        try:
            self.use_corpus(name)
        except ValueError as error:
            self.use_corpus(None)
            log.warning("drafting auto drafts without the %s corpus: %s", name, error)

    def _live_prices(self, rows: int) -> LivePrices:
        """This decoder's prices as they stand at each reading (a later `prices()` may read a
        larger timing)."""
        self.prices(rows)
        return LivePrices(self.price_book)

    def observe_round(self, fed: Sequence[int], committed: int, seconds: float) -> bool:
        """Feed one timed decoding round (the tokens its target pass took per row, the tokens
        it committed, its seconds) to drafting's judge (`outcomes.Outcomes`). True when it
        corrected what the plan's predicted gains are worth; the correction holds in memory at
        once and is stored beside the prices outside any round (`store_outcomes`). Rounds of a
        backend still moving its weights (`ModelBackend.moving_pages`) are slower for now, not
        mispriced, and are not fed."""
        return self.price_book.observe(fed, committed, seconds)

    def store_outcomes(self) -> None:
        """Store what drafting has been worth beside the prices, where it changed: called
        between rounds (the end of a generation, a server's idle moment or its stop), never
        inside one. A cache that cannot be written leaves the worth in memory."""
        self.price_book.store()

    def load_head(self, path: str | Path) -> torch.nn.Module:
        """Load an acceptance head for `length_policy="head"`; refused if made for another pair."""
        from specdecode.acceptance.head import load_head

        if self.drafter is None:
            raise ValueError("an acceptance head needs a drafter; this decoder has none")
        self.acceptance_head = load_head(path, drafter=self.drafter, target=self.target)
        return self.acceptance_head

    def encode(self, prompts: Prompts, chat: bool = False) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, chat)

    def default_stop_ids(self) -> tuple[int, ...]:
        ids: set[int] = set(self._target_lm.stop_token_ids())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def config(
        self,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_draft_tokens: int = 4,
        seed: int | None = None,
        row_seeds: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        drafting: str = DEFAULT_DRAFTING,
        length_policy: str = "constant",
        stop_threshold: float | None = None,
        bound: tuple[int, int] | None = None,
        coupled: bool = False,
        max_draft_batch: int | None = None,
        prices: Prices | None = None,
        **unknown,
    ) -> DecodeConfig:
        """The call's `DecodeConfig`; an argument it does not know is refused by name."""
        for name in unknown:
            raise TypeError(f"unknown decoding argument {name!r}")
        return DecodeConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            sampling=SamplingConfig(temperature, top_k, top_p),
            stop_token_ids=tuple(
                self.default_stop_ids() if stop_token_ids is None else stop_token_ids
            ),
            seed=seed,
            row_seeds=tuple(row_seeds) if row_seeds is not None else None,
            drafting=drafting,
            length_policy=length_policy,
            stop_threshold=stop_threshold,
            bound=tuple(bound) if bound is not None else None,
            coupled=coupled,
            max_draft_batch=max_draft_batch,
            prices=prices,
        )

    def stream(
        self,
        prompts: Prompts,
        *,
        use_drafter: bool = True,
        chat: bool = False,
        stats: DecodeStats | None = None,
        rule: str | None = None,
        lookup: PromptLookup | None = None,
        drafter: Drafter | None = None,
        **kwargs,
    ) -> Iterator[StepEvent]:
        """Yield the tokens each step commits, per row (original prompt indices).

        `drafting` (in `kwargs`, see `config`) says how tokens are drafted; `lookup`: the
        n-grams lookup drafting reads (default: the decoder's `PromptLookup`, else the
        setting's own). `use_drafter=False` decodes plainly. `drafter`: the call's drafter,
        built already (`drafter_for`; the controlled-acceptance bench wraps the drafter model's
        so that it pays its passes but proposes a script); default: the one `drafting` asks for.
        """
        cfg = self.config(**kwargs)
        ids = self.encode(prompts, chat)
        check_prompts(ids, cfg.max_new_tokens, self.context)
        verification = make_rule(rule, cfg.sampling)
        if not use_drafter:
            drafter = None
        elif drafter is None:
            drafter = self._drafter(cfg, use_drafter, verification.name, lookup, len(ids))
        events = decode(self._target_lm, drafter, verification, ids, cfg, stats,
                        observe=self._watch(drafter), clock=self.clock)  # fmt: skip
        return self._storing(events)

    def drafter_for(
        self,
        rows: int,
        *,
        rule: str | None = None,
        lookup: PromptLookup | None = None,
        **kwargs,
    ) -> Drafter | None:
        """The drafter a call of `rows` rows with these settings (`stream`'s keywords) drafts
        with, for a caller that wraps it and hands it to `stream(drafter=...)`."""
        cfg = self.config(**kwargs)
        return self._drafter(cfg, True, make_rule(rule, cfg.sampling).name, lookup, rows)

    def _storing(self, events: Iterator[StepEvent]) -> Iterator[StepEvent]:
        """The events, then what drafting was worth stored (after the last round)."""
        try:
            yield from events
        finally:
            self.store_outcomes()

    def loop(
        self,
        *,
        max_rows: int = 8,
        prefill_chunk: int | None = 256,
        use_drafter: bool = True,
        **kwargs,
    ) -> DecodeLoop:
        """The engine's loop for rows that come and go (a server): each row brings its own
        prompt ids, budget, law and seed (`RowRequest`); up to `max_rows` decode together and
        a long prompt is fed `prefill_chunk` tokens a round. The drafting settings are the
        keyword arguments `generate` takes; sampling ones are per row here."""
        sampling = RowSampling()
        cfg = replace(self.config(**kwargs), sampling=sampling)
        if cfg.length_policy in HEAD_POLICIES:
            raise ValueError(
                "a head policy reads a head trained for one verification rule; a loop's rows "
                "mix greedy and sampled laws: use another length policy"
            )
        drafter = self._drafter(cfg, use_drafter, None, None, max_rows)
        capacity = (self.context or UNNAMED_CONTEXT) + cfg.row_slack
        return DecodeLoop(
            self._target_lm, drafter, cfg, sampling=sampling, max_rows=max_rows,
            capacity=capacity, joins=True, prefill_chunk=prefill_chunk,
            observe=self._watch(drafter), clock=self.clock,
        )  # fmt: skip

    def _watch(self, drafter: Drafter | None):
        """Timed rounds go to the prices' watch where a drafter plans from measured prices."""
        planned = drafter is not None and self.price_book.known is not None
        return self.observe_round if planned else None

    def _drafter(
        self,
        cfg: DecodeConfig,
        use_drafter: bool,
        rule: str | None,
        lookup: PromptLookup | None,
        rows: int,
    ) -> Drafter | None:
        """The drafter `cfg.drafting` asks for (`drafting.factory`); None: plain decoding."""
        if not use_drafter:
            return None
        if cfg.drafting == "auto" and self._default_corpus is not None:
            self._read_default_corpus()
        drafting_rows = min(rows, cfg.max_draft_batch or rows)
        sources = Sources(
            load_model=lambda: self._draft_lm,
            has_model=self._draft is not None,
            model_context=getattr(self._draft, "context_length", None),
            lookup=lookup or self.lookup,
            vocab_size=self.vocab_size,
            device=self._target_lm.device,
            head=lambda: self._checked_head(cfg, rule),
            prices=lambda: cfg.prices or self._live_prices(drafting_rows),
            outcomes=lambda: self.price_book.outcomes if cfg.prices is None else None,
            rows=drafting_rows,
            corpus=self.corpus,
            texts=self._texts,
            clock=self.clock,
        )
        return make_drafter(cfg.drafting, cfg, sources)

    def _checked_head(self, cfg: DecodeConfig, rule: str) -> torch.nn.Module | None:
        """The head, if the policy needs one and it learnt the acceptance of this rule.

        With no head loaded, a head shipped with the package for this exact pair and rule is
        used, so the default models run `length_policy="head"` without any training. Whichever
        head it is (given, loaded or shipped) runs where the drafter's hidden states are.
        """
        if cfg.length_policy not in HEAD_POLICIES:
            return self.acceptance_head
        if self.backend not in TORCH_BACKENDS:
            raise ValueError(
                f"length policy {cfg.length_policy!r} decodes with an acceptance head on the "
                "PyTorch backends only (on llama.cpp a head does not pay at measured prices; "
                "`specdecode head replay` shows it); use drafting 'auto' (the default), or "
                "--backend torch"
            )
        head = self.acceptance_head
        if head is None:
            if rule not in self._shipped_heads:
                from specdecode.acceptance.head import find_shipped_head, load_head

                found = find_shipped_head(self.drafter, self.target, rule)
                self._shipped_heads[rule] = load_head(found, rule=rule) if found else None
            head = self._shipped_heads[rule]
            if head is None:
                return None
        elif head.config.rule != rule:
            raise ValueError(
                f"the acceptance head learnt {head.config.rule} acceptance, but this call "
                f"verifies with the {rule} rule; train a head with "
                f"`specdecode head train --rule {rule}`"
            )
        return head.to(self._draft_lm.device)

    def generate(
        self,
        prompts: Prompts,
        *,
        chat: bool = False,
        on_step: Callable[[StepEvent, list[list[int]]], None] | None = None,
        **kwargs,
    ) -> GenerationOutput:
        """Decode to the end; `on_step(event, new_tokens_so_far)` sees every step (streaming)."""
        ids = self.encode(prompts, chat)
        stats = DecodeStats([RowStats() for _ in ids])
        new_tokens: list[list[int]] = [[] for _ in ids]
        for event in self.stream(ids, stats=stats, **kwargs):
            for row, tokens in zip(event.rows, event.new_tokens, strict=True):
                new_tokens[row].extend(tokens)
            if on_step is not None:
                on_step(event, new_tokens)
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in new_tokens]
        sequences = [p + t for p, t in zip(ids, new_tokens, strict=True)]
        return GenerationOutput(sequences, new_tokens, texts, stats)
