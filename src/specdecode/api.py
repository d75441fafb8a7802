"""The Python API: models and a tokenizer in, strings or token ids in, an output object out.

    decoder = SpeculativeDecoder(target, tokenizer, drafter=draft_model)
    out = decoder.generate(["def fib(n):"], max_new_tokens=64, num_draft_tokens=4)
    out.texts[0], out.stats.summary()

    SpeculativeDecoder(target, tokenizer, drafter=PromptLookup())  # drafts with no model

`generate` and `stream` take the same keyword arguments as `transformers` users expect
(`max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`); `use_drafter=False` runs plain
autoregressive decoding on the same engine, the baseline of every speedup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.backends.torch_eager import CachedModel, context_length
from specdecode.checks import (
    check_prompts,
    check_same_device,
    check_same_vocabulary,
    check_vocab_covers_tokenizer,
)
from specdecode.config import (
    DEFAULT_BOUND,
    HEAD_POLICIES,
    PROMPT_LOOKUP,
    DecodeConfig,
    PromptLookup,
    RoundPrices,
    SamplingConfig,
)
from specdecode.drafters import (
    LookupFirstDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    check_lookup_policy,
)
from specdecode.engine import StepEvent, decode
from specdecode.length_policies import make_policy
from specdecode.prompts import render_chat
from specdecode.stats import DecodeStats, RowStats
from specdecode.verification import make_rule

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


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
        target: torch.nn.Module,
        tokenizer=None,
        drafter: torch.nn.Module | PromptLookup | None = None,
        drafter_tokenizer=None,
        acceptance_head: torch.nn.Module | None = None,
    ) -> None:
        check_vocab_covers_tokenizer(target, tokenizer, "target")
        self._target_lm = CachedModel(target.eval(), "target")
        self._draft_lm = None
        self.lookup = drafter if isinstance(drafter, PromptLookup) else None
        if self.lookup is not None:
            drafter = None
        if drafter is not None:
            check_same_device(target, drafter)
            self._draft_lm = CachedModel(drafter.eval(), "drafter")
            if tokenizer is not None and drafter_tokenizer is not None:
                check_same_vocabulary(tokenizer, drafter_tokenizer)
        self.target = self._target_lm.model
        self.drafter = self._draft_lm.model if self._draft_lm is not None else None
        self.tokenizer = tokenizer
        self.acceptance_head = acceptance_head
        self._shipped_heads: dict[str, torch.nn.Module | None] = {}
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.context = context_length(target)

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        drafter: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        prepack: bool | None = None,
        drafter_int8: bool = False,
    ) -> SpeculativeDecoder:
        """Load local model directories (or known model names) offline; the drafter
        "prompt-lookup" drafts by n-gram lookup with no model (`PromptLookup`).

        `prepack` gives the target's linear layers oneDNN-packed copies for products of 2+ rows
        (`kernels.prepack_linears`): on CPUs where the default fp32 kernel runs a few rows at
        two to three times the cost of one, a verify pass otherwise costs that much more than
        a decoding step, which eats most of the speedup. None (the default): on for fp32 on
        the CPU where this torch build has the kernels. It doubles the target's linear weights
        in memory. An fp32 drafter gets the same packing: it decodes one row at a time, which
        the timed switch packs where that is faster (the 0.5B default drafter on a 2-core AMD
        EPYC: 100 ms a token packed against 150 on MKL). `drafter_int8` drafts with an int8
        dynamically quantized copy of the drafter (CPU) instead: cheaper drafts, the same output
        law (every token is verified).
        """
        from specdecode.backends.kernels import (
            cpu_fp32,
            prepack_available,
            prepack_linears,
            quantize_int8,
        )
        from specdecode.models.store import load_causal_lm

        fits = cpu_fp32(device, dtype)
        if prepack and not (fits and prepack_available()):
            raise ValueError(
                "prepack needs float32 on the CPU and a torch build with oneDNN kernels; got "
                f"{dtype} on {device}"
            )
        if drafter_int8 and not fits:
            raise ValueError(f"an int8 drafter needs float32 on the CPU; got {dtype} on {device}")
        if drafter_int8 and drafter in (None, PROMPT_LOOKUP):
            raise ValueError("drafter_int8 needs a drafter model")
        target_model, tokenizer = load_causal_lm(target, dtype=dtype, device=device)
        pack = prepack or (prepack is None and fits and prepack_available())
        if pack:
            prepack_linears(target_model)
        if drafter is None:
            return cls(target_model, tokenizer)
        if drafter == PROMPT_LOOKUP:
            return cls(target_model, tokenizer, PromptLookup())
        draft_model, draft_tokenizer = load_causal_lm(drafter, dtype=dtype, device=device)
        if drafter_int8:
            draft_model = quantize_int8(draft_model)
        if pack:  # an int8 copy has no fp32 Linear left, so packing leaves it as it is
            prepack_linears(draft_model)
        return cls(target_model, tokenizer, draft_model, draft_tokenizer)

    def load_head(self, path: str | Path) -> torch.nn.Module:
        """Load an acceptance head for `length_policy="head"`; refused if made for another pair."""
        from specdecode.acceptance.head import load_head

        if self.drafter is None:
            raise ValueError("an acceptance head needs a drafter; this decoder has none")
        self.acceptance_head = load_head(path, drafter=self.drafter, target=self.target)
        return self.acceptance_head

    def encode(self, prompts: Prompts, chat: bool = False) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or a tokenizer")
            if chat:
                prompts = [render_chat(self.tokenizer, p) for p in prompts]
                return [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
            return [self.tokenizer(p).input_ids if p else [] for p in prompts]
        if any(isinstance(p, str) for p in prompts):
            raise ValueError("mix of text and token-id prompts; give one kind")
        return [[int(t) for t in p] for p in prompts]

    def default_stop_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def config(
        self,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        num_draft_tokens: int = 4,
        seed: int | None = None,
        row_seeds: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        length_policy: str = "constant",
        stop_threshold: float | None = None,
        bound: tuple[int, int] | None = None,
        coupled: bool = False,
        max_draft_batch: int | None = None,
        round_prices: RoundPrices | None = None,
    ) -> DecodeConfig:
        return DecodeConfig(
            max_new_tokens=max_new_tokens,
            num_draft_tokens=num_draft_tokens,
            sampling=SamplingConfig(temperature, top_k, top_p),
            stop_token_ids=tuple(
                self.default_stop_ids() if stop_token_ids is None else stop_token_ids
            ),
            seed=seed,
            row_seeds=tuple(row_seeds) if row_seeds is not None else None,
            length_policy=length_policy,
            stop_threshold=stop_threshold,
            bound=tuple(bound) if bound is not None else None,
            coupled=coupled,
            max_draft_batch=max_draft_batch,
            round_prices=round_prices,
        )

    def measure_round_prices(self, max_tokens: int = DEFAULT_BOUND[1]) -> RoundPrices:
        """Time this pair's passes here (a few seconds): what a round of up to `max_tokens`
        drafted tokens costs, for a head policy to weigh (`generate(..., round_prices=...)`)."""
        if self.drafter is None:
            raise ValueError("round prices price a drafter's tokens; this decoder has none")
        from specdecode.backends.timing import measure_round_prices

        return measure_round_prices(self.target, self.drafter, max_tokens)

    def stream(
        self,
        prompts: Prompts,
        *,
        use_drafter: bool = True,
        chat: bool = False,
        stats: DecodeStats | None = None,
        rule: str | None = None,
        lookup_first: PromptLookup | None = None,
        **kwargs,
    ) -> Iterator[StepEvent]:
        """Yield the tokens each step commits, per row (original prompt indices).

        `lookup_first` (with a drafter model): a row whose text repeats itself drafts by that
        lookup, the others with the model (`LookupFirstDrafter`; `config.LOOKUP_FIRST`).
        """
        cfg = self.config(**kwargs)
        ids = self.encode(prompts, chat)
        check_prompts(ids, cfg.max_new_tokens, self.context)
        drafter = None
        verification = make_rule(rule, cfg.sampling)
        if lookup_first is not None and not (use_drafter and self._draft_lm is not None):
            raise ValueError(
                "lookup_first looks up before a drafter model: it needs a decoder with a "
                "drafter model, drafting (use_drafter=True)"
            )
        if use_drafter and self._draft_lm is not None:
            policy = make_policy(cfg, self._checked_head(cfg, verification.name))
            drafter = ModelDrafter(self._draft_lm, cfg.sampling, self.vocab_size, policy)
            if lookup_first is not None:
                drafter = LookupFirstDrafter(lookup_first, drafter)
        elif use_drafter and self.lookup is not None:
            check_lookup_policy(cfg.length_policy)  # before make_policy asks for a head
            policy = make_policy(cfg)
            drafter = PromptLookupDrafter(
                self.lookup, policy, self.vocab_size, self._target_lm.device
            )
        return decode(self._target_lm, drafter, verification, ids, cfg, stats)

    def _checked_head(self, cfg: DecodeConfig, rule: str) -> torch.nn.Module | None:
        """The head, if the policy needs one and it learnt the acceptance of this rule.

        With no head loaded, a head shipped with the package for this exact pair and rule is
        used, so the default models run `length_policy="head"` without any training. Whichever
        head it is (given, loaded or shipped) runs where the drafter's hidden states are.
        """
        if cfg.length_policy not in HEAD_POLICIES:
            return self.acceptance_head
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
