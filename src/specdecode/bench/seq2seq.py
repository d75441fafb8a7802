"""`specdecode bench --pair DIR`: translation speed and quality of SpecDec against its peers.

Methods (`SEQ2SEQ`), all on the same verifier:

* `ar`: this engine without a drafter (greedy), the baseline of every ratio;
* `hf`, `hf-beam5`: `transformers` `generate`, greedy and beam 5;
* `hf-assisted`: `transformers` assisted generation with the pair's small autoregressive
  assistant (the verifier's encoder and one decoder layer, trained on the same distilled data);
  its defaults (heuristic schedule from 20 tokens, confidence 0.4); batch size 1 only;
* `specdec[k=K]`: the block drafter with exact greedy verification (beta = 1);
* `specdec[k=K,b=B,t=T]`: the relaxed top-beta/tau rule; approximate, marked so everywhere;
* `specdec[k=K,draft<=N]` (with `max_draft_batch`): exact SpecDec drafting only while at most
  N rows of a batch are running, plain steps above (`DecodeConfig.max_draft_batch`); run
  beside the ungated method at batch sizes above N;
* `specdec-int8`: the same with an int8 copy of the drafter; `specdec-alt` and
  `specdec-alt-int8`: with another drafter for the same verifier (`alt_drafter`), so that two
  drafters are compared in one interleaved run rather than across runs on a noisy machine.

Measured by the one runner (`runner.measure`, with its warm-up, rotation and `repeats`); speed
counts sentences, since a translation's time is what a reader waits. Exact methods must
reproduce `ar` token for token (a mismatch fails the run); the others are scored by BLEU, the
extra figure of these rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdecode.backends.kernels import kernel_summary, model_bytes, prepack_linears
from specdecode.bench.config import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_METHODS_OF,
    DEFAULT_RELAXED,
    DEFAULT_SENTENCE_LIMIT,
    BenchConfig,
)
from specdecode.bench.methods import Registry, Result, SharedModels, SpecMethod, timed_generate
from specdecode.bench.runner import MethodRecord, bench_record, measure_shared, speed_rows
from specdecode.core.verification import TopBetaTau
from specdecode.seq2seq.api import TranslationPair
from specdecode.seq2seq.block_drafter import BlockDrafter
from specdecode.seq2seq.corpus import Verse

SEQ2SEQ = Registry("seq2seq")
RELAXED_ONLY = "specdec-relaxed"  # asks for specdec's relaxed runs without its exact ones


@dataclass(frozen=True)
class Seq2SeqMethod:
    """A translation method as asked for: its kind (a `SEQ2SEQ` name) and settings."""

    kind: str
    k: int | None = None
    relaxed: TopBetaTau | None = None
    dense: bool = False  # default PyTorch kernels where the run prepacks (`+dense`)
    max_draft_batch: int | None = None  # draft only while at most this many rows run

    @property
    def label(self) -> str:
        suffix = "+dense" if self.dense else ""
        if not self.speculative:
            return self.kind + suffix
        extra = f",{self.relaxed.label}" if self.relaxed is not None else ""
        if self.max_draft_batch is not None:
            extra += f",draft<={self.max_draft_batch}"
        return f"{self.kind}[k={self.k}{extra}]{suffix}"

    @property
    def speculative(self) -> bool:
        return SEQ2SEQ.lookup(self.kind).speculative

    @property
    def exact(self) -> bool:
        return SEQ2SEQ.lookup(self.kind).exact_output and self.relaxed is None


@dataclass(frozen=True, kw_only=True)
class Seq2SeqBenchConfig(BenchConfig):
    """The translation bench: the shared settings, a pair, its sentences and SpecDec's sweeps."""

    DEFAULT_METHODS: ClassVar[tuple[str, ...]] = DEFAULT_METHODS_OF["seq2seq"]

    pair: str
    split: str = "test"
    limit: int | None = DEFAULT_SENTENCE_LIMIT  # the split's first N sentences (None or 0: all)
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    relaxed: tuple[tuple[int, float], ...] = DEFAULT_RELAXED
    prepack: bool = True  # oneDNN-packed kernels for multi-row products (`kernels`), all models
    alt_drafter: str | None = None  # a second block drafter directory (`specdec-alt*` methods)
    max_draft_batch: int | None = None  # > 0: exact SpecDec methods also run gated at this

    def __post_init__(self) -> None:
        super().__post_init__()
        known = (*SEQ2SEQ, RELAXED_ONLY)
        unknown = [m for m in self.methods if m.removesuffix("+dense") not in known]
        if unknown:
            raise ValueError(
                f"unknown seq2seq methods {unknown}; known: {', '.join(known)} (each may end in "
                "+dense: default kernels)"
            )
        alt = [m for m in self.methods if _kind(m) in SEQ2SEQ and SEQ2SEQ[_kind(m)].needs_alt]
        if alt and self.alt_drafter is None:
            raise ValueError(f"methods {alt} need a second drafter: give --alt-drafter DIR")
        if not self.prepack and any(m.endswith("+dense") for m in self.methods):
            raise ValueError("+dense compares with packed kernels; drop it or --no-prepack")
        if any(k < 1 for k in self.block_sizes):
            raise ValueError(f"block sizes must be >= 1, got {self.block_sizes}")
        if self.max_draft_batch is not None and self.max_draft_batch < 1:
            raise ValueError(f"max_draft_batch must be >= 1, got {self.max_draft_batch}")

    def method_list(self) -> list[Seq2SeqMethod]:
        out = []
        for dense in (False, True):
            names = [_kind(m) for m in self.methods if m.endswith("+dense") is dense]
            plain = [m for m in names if m in SEQ2SEQ and not SEQ2SEQ[m].speculative]
            out += [Seq2SeqMethod(m, dense=dense) for m in plain]
            for kind in (kind for kind, cls in SEQ2SEQ.items() if cls.speculative):
                relaxed_only = kind == "specdec" and RELAXED_ONLY in names
                if kind in names:
                    out += [Seq2SeqMethod(kind, k, dense=dense) for k in self.block_sizes]
                if kind in names and self.max_draft_batch is not None:
                    out += [
                        Seq2SeqMethod(kind, k, dense=dense, max_draft_batch=self.max_draft_batch)
                        for k in self.block_sizes
                    ]
                if kind in names or relaxed_only:
                    out += [
                        Seq2SeqMethod(kind, k, TopBetaTau(beta, tau), dense)
                        for k in self.block_sizes
                        for beta, tau in self.relaxed
                        if beta > 1
                    ]
        return out


def _kind(name: str) -> str:
    return name.removesuffix("+dense")


@dataclass
class PairModels(SharedModels):
    """The pair every translation method shares, and what some build from it."""

    pair: TranslationPair
    cfg: Seq2SeqBenchConfig

    def assistant(self) -> torch.nn.Module:
        return self.shared("assistant", self._load_assistant)

    def _load_assistant(self) -> torch.nn.Module:
        from transformers import AutoModelForSeq2SeqLM

        assistant_dir = Path(self.cfg.pair) / "assistant"
        if not (assistant_dir / "config.json").exists():
            raise FileNotFoundError(
                f"{assistant_dir} missing: run `specdecode seq2seq train-assistant` and export"
            )
        assistant = AutoModelForSeq2SeqLM.from_pretrained(str(assistant_dir), dtype=torch.float32)
        assistant.eval()
        if self.cfg.prepack:
            # the switch the verifier got, so that both decode plain steps on one kernel
            prepack_linears(assistant, kernel_summary(self.pair.verifier)["packed_from_rows"])
        return assistant

    def alt_drafters(self) -> tuple[BlockDrafter, BlockDrafter]:
        """The second drafter, dense and int8; the int8 copy is taken before the dense one is
        packed onto the verifier's kernels (`with_drafter`)."""

        def load() -> tuple[BlockDrafter, BlockDrafter]:
            alt = BlockDrafter.load(Path(self.cfg.alt_drafter))
            return alt, alt.int8()

        return self.shared("alt", load)


class Translation(SpecMethod):
    """A method translating source sentences with the pair's verifier."""

    speculative: ClassVar[bool] = False  # drafts with a block drafter: swept over block sizes
    exact_output: ClassVar[bool] = True  # greedy output of the verifier (beam search is not)
    needs_alt: ClassVar[bool] = False  # drafts with `--alt-drafter`

    def __init__(self, spec: Seq2SeqMethod, models: PairModels) -> None:
        super().__init__(spec)
        self.models = models

    @property
    def exact(self) -> bool:
        return self.spec.exact

    def skips(self, batch_size: int) -> str | None:
        gate = self.spec.max_draft_batch
        if gate is not None and batch_size <= gate:
            return f"the ungated method at {gate} rows or fewer"
        return super().skips(batch_size)

    def translating_pair(self) -> TranslationPair:
        return self.models.pair

    def modules(self) -> list[torch.nn.Module]:
        pair = self.translating_pair()
        return [m for m in (pair.verifier, pair.drafter) if m is not None]


class EngineTranslation(Translation):
    """This engine (`TranslationPair.translate`), with the drafter of `translating_pair`."""

    def decode(self, batch: Sequence[str], warm: bool) -> Result:
        method = self.spec
        relaxed = method.relaxed or TopBetaTau(1)
        start = time.perf_counter()
        out = self.translating_pair().translate(
            list(batch),
            block_size=method.k or 1,
            beta=relaxed.beta,
            tau=relaxed.tau,
            use_drafter=method.speculative,
            batch_size=len(batch),
            max_new_tokens=self.models.cfg.max_new_tokens,
            max_draft_batch=method.max_draft_batch,  # None: every round drafts
        )
        return Result(out.token_ids, time.perf_counter() - start, out.stats)


@SEQ2SEQ.add
class PlainTranslation(EngineTranslation):
    name = "ar"


@SEQ2SEQ.add
class SpecDec(EngineTranslation):
    name = "specdec"
    speculative = True


@SEQ2SEQ.add
class SpecDecInt8(SpecDec):
    name = "specdec-int8"

    def translating_pair(self) -> TranslationPair:
        pair = self.models.pair
        return self.models.shared(self.name, lambda: pair.with_drafter(pair.drafter.int8()))


@SEQ2SEQ.add
class SpecDecAlt(SpecDec):
    name = "specdec-alt"
    needs_alt = True

    def translating_pair(self) -> TranslationPair:
        dense, _ = self.models.alt_drafters()  # packed as the verifier is
        return self.models.shared(self.name, lambda: self.models.pair.with_drafter(dense))


@SEQ2SEQ.add
class SpecDecAltInt8(SpecDec):
    name = "specdec-alt-int8"
    needs_alt = True

    def translating_pair(self) -> TranslationPair:
        _, int8 = self.models.alt_drafters()
        return self.models.shared(self.name, lambda: self.models.pair.with_drafter(int8))


class GenerateTranslation(Translation):
    """`transformers` `generate` on the verifier, its options given by `options`."""

    def options(self) -> dict[str, Any]:
        return {}

    def decode(self, batch: Sequence[str], warm: bool) -> Result:
        pair = self.models.pair
        tok = pair.tokenizer
        kwargs: dict[str, Any] = dict(
            max_new_tokens=pair.output_cap(self.models.cfg.max_new_tokens),
            do_sample=False,
            num_beams=1,
        )
        kwargs.update(self.options())

        def inputs() -> dict[str, Any]:  # ids, mask [batch, source]; the decoder's own kwargs
            return {**tok(list(batch), return_tensors="pt", padding=True), **kwargs}

        def upto_eos(row: list[int]) -> list[int]:  # without </s> and padding
            cut = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
            return [t for t in row[:cut] if t != tok.pad_token_id]

        return timed_generate(pair.verifier, inputs, 1, upto_eos)  # after the start token


@SEQ2SEQ.add
class GenerateGreedy(GenerateTranslation):
    name = "hf"


@SEQ2SEQ.add
class GenerateBeam5(GenerateTranslation):
    name = "hf-beam5"
    exact_output = False

    def options(self) -> dict[str, Any]:
        return {"num_beams": 5}


@SEQ2SEQ.add
class GenerateAssisted(GenerateTranslation):
    """Its defaults: heuristic schedule from 20 tokens, confidence threshold 0.4."""

    name = "hf-assisted"
    batch1_only = True

    def modules(self) -> list[torch.nn.Module]:
        return [*super().modules(), self.models.assistant()]

    def options(self) -> dict[str, Any]:
        assistant = self.models.assistant()
        gc = assistant.generation_config
        gc.num_assistant_tokens_schedule, gc.num_assistant_tokens = "heuristic", 20
        gc.assistant_confidence_threshold = 0.4
        return {"assistant_model": assistant}


def bleu_scores(hyps: list[str], refs: list[str], refs2: list[str]) -> dict:
    import sacrebleu

    out = {
        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
    }
    if all(refs2):
        out["bleu_two_refs"] = sacrebleu.corpus_bleu(hyps, [refs, refs2]).score
    return out


def run_seq2seq_bench(cfg: Seq2SeqBenchConfig, progress: bool = True) -> dict | None:
    from specdecode.seq2seq.corpus import read_split

    verses = read_split(cfg.split)
    if cfg.limit:
        verses = verses[: cfg.limit]
    pair = TranslationPair.from_dir(cfg.pair, prepack=cfg.prepack)
    specs = cfg.method_list()
    if any(m.speculative for m in specs) and pair.drafter is None:
        raise ValueError(f"{cfg.pair} has no drafter; drop the specdec methods")
    models = PairModels(pair, cfg)
    methods = [SEQ2SEQ.lookup(spec.kind)(spec, models) for spec in specs]
    sources = [v.src for v in verses]
    records, skipped, main = measure_shared(
        methods, sources, cfg.batch_sizes, cfg.repeats, progress
    )
    if not main:
        return None  # the main process writes the run's one record

    def extras(row: dict, method: Translation, rec: MethodRecord, base: MethodRecord) -> None:
        row.update(translation_figures(method.spec, rec, verses, pair))

    rows = speed_rows(methods, records, "sentences", extras)
    outputs: dict[str, list[list[int]]] = {}  # by label, at the first batch size it ran
    for (label, _), rec in records.items():
        outputs.setdefault(label, rec.outputs)
    sample = examples(verses, outputs, pair)
    return bench_record(cfg, rows, skipped, **model_sizes(models), examples=sample)


def translation_figures(
    spec: Seq2SeqMethod, rec: MethodRecord, verses: list[Verse], pair: TranslationPair
) -> dict:
    """Quality against the references, and the verifier's and drafter's calls."""
    texts = pair.tokenizer.batch_decode(rec.outputs, skip_special_tokens=True)
    row: dict[str, Any] = {
        "k": spec.k,
        "dense": spec.dense,
        "approximate": not spec.exact and spec.speculative,
        **bleu_scores(texts, [v.tgt for v in verses], [v.ref2 for v in verses]),
    }
    if rec.stats is None:
        return row
    st = rec.stats.total
    if st.target_calls:
        row.update(
            tokens_per_verifier_call=st.tokens_per_target_call,
            acceptance_rate=st.acceptance_rate if st.drafted else None,
            accepted_at_least=st.accepted_at_least() if st.drafted else None,
            verifier_calls=st.target_calls,
        )
    if rec.stats.target_passes:
        row["ms_per_verifier_call"] = 1000 * rec.stats.verify_seconds / rec.stats.target_passes
    if rec.stats.drafter_passes:
        row["ms_per_drafter_call"] = 1000 * rec.stats.draft_seconds / rec.stats.drafter_passes
    return row


def model_sizes(models: PairModels) -> dict:
    """Parameter sizes as loaded, and in memory with the packed weight copies (`prepack`),
    which double the linear weights."""
    pair = models.pair

    def mib(model: torch.nn.Module) -> float:
        return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20

    int8 = models.built.get("specdec-int8")
    assistant = models.built.get("assistant")
    return {
        "verifier_mib": mib(pair.verifier),
        "drafter_mib": mib(pair.drafter) if pair.drafter is not None else 0.0,
        "assistant_mib": mib(assistant) if assistant is not None else None,
        "verifier_mib_in_memory": model_bytes(pair.verifier) / 2**20,
        "drafter_mib_in_memory": (
            model_bytes(pair.drafter) / 2**20 if pair.drafter is not None else 0.0
        ),
        "drafter_int8_mib": model_bytes(int8.drafter) / 2**20 if int8 is not None else None,
        "kernels": kernel_summary(pair.verifier),
    }


def examples(
    verses: list[Verse], outputs: dict[str, list[list[int]]], pair: TranslationPair, n: int = 3
) -> list[dict]:
    """The first few translations of every method beside source and reference."""
    out = []
    for i in range(min(n, len(verses))):
        row = {"ref": verses[i].ref, "source": verses[i].src, "reference": verses[i].tgt}
        for label, ids in outputs.items():
            row[label] = pair.tokenizer.decode(ids[i], skip_special_tokens=True)
        out.append(row)
    return out
