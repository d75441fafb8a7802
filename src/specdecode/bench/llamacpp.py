"""The bench on llama.cpp: this engine on GGUF files as shipped, against what a CPU user runs.

A speedup counts against what a user would run instead, so a llama.cpp run puts beside this
engine's methods on the llama.cpp backend the peers a CPU user picks: llama-cpp-python's own
generation loop (plain, one sequence at a time; a batch is its prompts one after another) and
its prompt-lookup decoding. All share the same threads and run interleaved by the one runner
(`runner.measure`); `ar` is this engine's plain decoding on llama.cpp, the baseline of every
ratio. Optional `torch-*` methods put the PyTorch backend (fp32 target, int8 drafter) in the
same table (they convert the GGUF to fp32 once).

llama.cpp does not promise the same logits for a token scored in passes of different shapes, so
"the same output" is checked as agreement with `ar` except after a near tie: a text that
differs is rescored at its first divergence, and the divergence passes if the top-2 gap there is
within the backend's noise, measured at the start of the run (`measure_noise`). Peak memory is
measured per method in a process of its own (`--rss`), since one process holding every method's
models says nothing about any one of them.
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.hugepages import anonymous_regions, collapse_new_regions
from specdecode.backends.llamacpp import DEFAULT_CONTEXT, LlamaCppModel
from specdecode.backends.llamacpp_lib import physical_cores
from specdecode.bench.config import DEFAULT_METHODS_OF, REFERENCE, PromptBenchConfig
from specdecode.bench.methods import Registry, Result, Settings, SharedModels, T
from specdecode.bench.runner import bench_record, measure_shared, speed_rows
from specdecode.core.config import DEFAULT_DRAFTING, PromptLookup
from specdecode.core.prices import PRICE_CONTEXT_TOKENS, PRICED_TOKENS, Prices
from specdecode.loading import gguf_path

LLAMA = Registry("llama.cpp")


@dataclass(frozen=True, kw_only=True)
class LlamaBenchConfig(PromptBenchConfig):
    """The causal bench on llama.cpp: the shared settings, and peak memory per method."""

    DEFAULT_METHODS: ClassVar[tuple[str, ...]] = DEFAULT_METHODS_OF["llama.cpp"]

    rss: bool = False  # peak RSS per method, each in a process of its own

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.methods:
            LLAMA.lookup(name)

    def specs(self) -> list[tuple[str, int | None]]:
        """(method, k) for every row: methods with a draft length once per k."""
        return [
            (name, k)
            for name in self.methods
            for k in (self.num_draft_tokens if LLAMA[name].takes_k else [None])
        ]


ENGINE = "engine"  # the holder of this engine's models (`Shared.hold`)


@dataclass
class Shared(SharedModels):
    """The models of one run (`SharedModels`): this engine's llama.cpp target, drafter and
    decoders, shared by every engine method (each call resets their sequences); and each
    peer's models. One holder's models are loaded at a time: this engine's, or one peer's
    (`hold`).

    Why one at a time: every peer loads the target's weights again (llama-cpp-python reads the
    file mapped and copies the repacked part out of it; the huge-page peer reads it all into
    memory), so the default run holding all of them beside this engine's own copy peaked near
    four copies of the target; holding the peers one at a time beside this engine's target and
    drafter still peaked at 4.20 GiB (`specdecode bench --limit 3 --max-new-tokens 64`), since
    this engine's 2.3 GiB stayed loaded while a peer ran. Now this engine's models are closed
    too when a peer's turn comes, and loaded again at the turn of an engine method, so the
    peak is the larger holder's, not their sum.

    What it costs: a load is untimed (the method warms up after it and waits for the weights'
    move to 2 MiB pages, `LlamaMethod.run`), but it takes seconds of wall time, once or twice
    per batch (the rotation of the order splits the engine's methods on some batches). The
    methods stay interleaved batch by batch: the fairness on a shared machine that the runner
    is built for is worth more than a shorter run. The prices of this engine's decoders are
    timed once per run and carried over a reload (`kept_prices`), so a reload times nothing.
    """

    cfg: LlamaBenchConfig
    context: int = DEFAULT_CONTEXT  # tokens of a row's context: the longest prompt's and more
    holder: str | None = None  # whose models are loaded now: ENGINE, or a peer's key
    held: dict[str, str] = field(default_factory=dict)  # a built model's key -> its holder
    kept_prices: dict[str | None, Prices] = field(default_factory=dict)  # by decoder drafter

    def hold(self, holder: str) -> None:
        """Make `holder` the one whose models are loaded, closing another holder's first."""
        if self.holder not in (None, holder):
            self.drop([key for key, by in self.held.items() if by == self.holder])
        self.holder = holder

    def drop(self, keys: Sequence[str]) -> None:
        """Close and forget these models: llama.cpp's memory now, not at garbage collection;
        an engine decoder's prices are kept for its next load."""
        dropped = [self.built.pop(key, None) for key in keys]
        for key, old in zip(keys, dropped, strict=True):
            self.held.pop(key, None)
            prices = old.known_prices if isinstance(old, SpeculativeDecoder) else None
            if key.startswith("decoder ") and prices is not None:
                self.kept_prices[key.removeprefix("decoder ")] = prices
        for old in dropped:
            close = getattr(old, "close", None)
            if close is not None:
                close()
        del dropped
        gc.collect()

    def held_model(self, holder: str, key: str, build: Callable[[], T]) -> T:
        """A model of `holder`'s, built if need be, after closing another holder's."""
        self.hold(holder)
        self.held[key] = holder
        return self.shared(key, build)

    def peer_model(self, key: str, build: Callable[[], T]) -> T:
        """A peer's model, built if need be, after closing this engine's or another peer's."""
        return self.held_model(key, key, build)

    def loaded(self, key: str) -> bool:
        return key in self.built

    def release(self) -> None:
        """Close every model now (`SharedModels.release`)."""
        self.drop(list(self.held))
        self.holder = None
        super().release()

    def threads(self) -> int:
        return self.cfg.threads or physical_cores()

    def engine_context(self) -> int:
        """Tokens of a row of this engine's contexts: the run's rows, as a peer's, and room for
        the passes its prices time (`pricebook.measure_prices`): a context sized for them, not the
        4096 a row may reach, holds a smaller cache and times the prices a decoder loaded by
        `specdecode generate` would time."""
        return max(self.context, peer_context(PRICE_CONTEXT_TOKENS + PRICED_TOKENS + 1))

    def _llama_model(self, role: str, name: str) -> LlamaCppModel:
        path = gguf_path(name)
        return self.held_model(
            ENGINE,
            role,
            lambda: LlamaCppModel(
                path, role=role, threads=self.threads(), context=self.engine_context()
            ),
        )

    def target(self) -> LlamaCppModel:
        return self._llama_model("target", self.cfg.target)

    def drafter(self) -> LlamaCppModel:
        return self._llama_model("drafter", self.cfg.draft)

    def tokenizer(self):
        from specdecode.models.tokenizer import gguf_tokenizer

        # not a holder's: a vocabulary, small, and read again only at a cost
        return self.shared("tokenizer", lambda: gguf_tokenizer(gguf_path(self.cfg.target)))

    def decoder(self, drafter: str | None) -> SpeculativeDecoder:
        """This engine's decoder with the drafter named: None, "model" or "lookup"."""

        def build() -> SpeculativeDecoder:
            other = {None: None, "model": self.drafter(), "lookup": PromptLookup()}[drafter]
            decoder = SpeculativeDecoder(self.target(), self.tokenizer(), other)
            if drafter in self.kept_prices:  # loaded again: the prices this run timed
                decoder.use_prices(self.kept_prices[drafter])
            elif drafter is not None:  # a run records this machine now, not a cached timing
                decoder.prices(retime=True)
            return decoder

        return self.held_model(ENGINE, f"decoder {drafter}", build)

    def settle(self) -> None:
        """Wait for this engine's weights to end their move to 2 MiB pages (passes run slower
        during it, and it takes one of the threads a timed pass would have)."""
        for role in ("target", "drafter"):
            model = self.built.get(role)
            if model is not None:
                model.huge_page_bytes  # noqa: B018 - the property joins the move


class LlamaMethod:
    """A method of the llama.cpp bench: the `BenchMethod` protocol over `Shared` models."""

    name: ClassVar[str]
    takes_k: ClassVar[bool] = False

    def __init__(self, k: int | None, shared: Shared, settings: Settings) -> None:
        self.k, self.shared, self.settings = k, shared, settings

    @property
    def label(self) -> str:
        return f"{self.name}[k={self.k}]" if self.k is not None else self.name

    @property
    def exact(self) -> bool:
        return self.settings.temperature == 0

    @property
    def pairing(self) -> str | None:
        return None

    def skips(self, batch_size: int) -> str | None:
        return None

    def loaded(self) -> bool:
        """Whether its models are loaded (a holder's are closed at another's turn:
        `Shared.hold`)."""
        raise NotImplementedError

    def prepare(self, sample: Sequence[list[int]]) -> None:
        from dataclasses import replace

        self.generate(list(sample), replace(self.settings, max_new_tokens=8))

    def run(self, batch: Sequence[list[int]]) -> Result:
        if not self.loaded():  # closed for another holder: loaded and warmed up, untimed
            self.prepare(batch[:1])
        return self.generate(list(batch), self.settings)

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        raise NotImplementedError


def engine_run(
    decoder: SpeculativeDecoder,
    prompts: list[list[int]],
    s: Settings,
    drafts: bool,
    k: int | None,
    options: dict,
) -> Result:
    """One timed call of this engine, on whichever backend the decoder runs."""
    out = decoder.generate(
        prompts,
        use_drafter=drafts,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
        stop_token_ids=s.stop_token_ids,
        num_draft_tokens=k or 1,
        **options,
    )
    return Result(out.new_tokens, out.stats.wall_seconds, out.stats)


class EngineOnLlama(LlamaMethod):
    """This engine on the llama.cpp backend."""

    drafter: ClassVar[str | None] = "model"  # what its decoder holds: `Shared.decoder`
    drafting: ClassVar[str] = "model"  # how it drafts (`config.DRAFTINGS`)

    def loaded(self) -> bool:
        return self.shared.loaded(f"decoder {self.drafter}")

    def prepare(self, sample: Sequence[list[int]]) -> None:
        super().prepare(sample)
        self.shared.settle()  # the timed run after a load finds the weights where they stay

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        decoder = self.shared.decoder(self.drafter)
        drafts = self.drafter is not None
        return engine_run(decoder, prompts, s, drafts, self.k, {"drafting": self.drafting})


@LLAMA.add
class PlainOnLlama(EngineOnLlama):
    name = "ar"
    drafter = None


@LLAMA.add
class DefaultOnLlama(EngineOnLlama):
    name = "specdecode"  # as `specdecode generate` drafts, with the drafter model
    drafting = DEFAULT_DRAFTING


@LLAMA.add
class DefaultLookupOnLlama(EngineOnLlama):
    name = "specdecode-lookup"  # the same with lookup alone (no drafter model)
    drafter = "lookup"
    drafting = DEFAULT_DRAFTING


@LLAMA.add
class DraftModelOnLlama(EngineOnLlama):
    name = "sd"
    takes_k = True


@LLAMA.add
class LookupOnLlama(EngineOnLlama):
    name = "sd-lookup"
    takes_k = True
    drafter = "lookup"
    drafting = "lookup"


@LLAMA.add
class LlamaCppPython(LlamaMethod):
    """llama-cpp-python's own generation loop (`Llama.generate`, which `create_completion`
    wraps, without its text handling): one sequence at a time, so a batch is its prompts one
    after another. Its cache is cleared before each prompt: no prefix is reused."""

    name = "llama-cpp-python"

    def make(self):
        from llama_cpp import Llama

        threads = self.shared.threads()
        return Llama(
            str(gguf_path(self.shared.cfg.target)),
            n_ctx=self.shared.context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **self.extra(),
        )

    def extra(self) -> dict:
        return {}

    def llama(self):
        return self.shared.peer_model(self.label, self.make)

    def loaded(self) -> bool:
        return self.shared.loaded(self.label)

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        import time

        llm = self.llama()
        stops = set(s.stop_token_ids)
        greedy = s.temperature == 0
        out: list[list[int]] = []
        t0 = time.perf_counter()
        for prompt in prompts:
            llm.reset()
            tokens: list[int] = []
            for token in llm.generate(
                prompt,
                temp=s.temperature,
                top_k=1 if greedy else s.top_k,
                top_p=s.top_p,
                reset=True,
            ):
                if token in stops:
                    tokens.append(token)
                    break
                tokens.append(token)
                if len(tokens) >= s.max_new_tokens:
                    break
            out.append(tokens)
        return Result(out, time.perf_counter() - t0)


@LLAMA.add
class LlamaCppPythonHugePages(LlamaCppPython):
    """llama-cpp-python plain with its weights read into memory (`use_mmap=False`) and moved
    to 2 MiB pages, as this engine's llama.cpp backend does (`backends.hugepages`): what the
    same page size gives llama-cpp-python, so a table separates that gain from speculation's."""

    name = "llama-cpp-python-huge"

    def make(self):
        before = anonymous_regions()
        llm = super().make()
        collapse_new_regions(before)
        return llm

    def extra(self) -> dict:
        return {"use_mmap": False}


@LLAMA.add
class LlamaCppPythonLookup(LlamaCppPython):
    """llama-cpp-python's prompt-lookup decoding (`LlamaPromptLookupDecoding`, k tokens)."""

    name = "llama-cpp-python-lookup"
    takes_k = True

    def extra(self) -> dict:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        return {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=self.k)}


class TorchMethod(LlamaMethod):
    """This engine on the PyTorch backend (fp32 target), beside the llama.cpp rows."""

    drafter_int8: ClassVar[bool] = False

    def loaded(self) -> bool:
        return self.shared.loaded(self.name)

    def generate(self, prompts: list[list[int]], s: Settings) -> Result:
        cfg = self.shared.cfg

        def build() -> SpeculativeDecoder:
            draft = cfg.draft if self.drafter_int8 else None
            return SpeculativeDecoder.from_pretrained(
                cfg.target, draft, backend="torch", drafter_int8=self.drafter_int8
            )

        decoder = self.shared.peer_model(self.name, build)
        options = {"drafting": "lookup-first"}
        return engine_run(decoder, prompts, s, self.drafter_int8, self.k, options)


@LLAMA.add
class TorchPlain(TorchMethod):
    name = "torch-ar"


@LLAMA.add
class TorchInt8LookupFirst(TorchMethod):
    name = "torch-sd-int8-lookup-first"  # the torch backend's best (int8 drafter, lookup first)
    takes_k = True
    drafter_int8 = True


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def measure_noise(target: LlamaCppModel, prompt: list[int], text: list[int]) -> float:
    """How far a logit moves with the shape of the pass that scores it: the text's positions
    scored in one pass, in passes of 5 and one at a time; the largest difference of any logit,
    doubled (a top-2 gap is a difference of two logits)."""
    ids = prompt + text
    n = len(text)
    ones = torch.ones(1, len(ids), dtype=torch.bool)
    target.reset(1)
    whole, _ = target.forward(torch.tensor([ids]), ones, logits_to_keep=n)  # [1, n, vocab]
    worst = 0.0
    for width in (1, 5):
        target.reset(1)
        target.forward(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool))
        parts = []
        for start in range(0, n, width):
            piece = torch.tensor([text[start : start + width]])
            logits, _ = target.forward(piece, torch.ones_like(piece, dtype=torch.bool),
                                       logits_to_keep=piece.shape[1])  # fmt: skip
            parts.append(logits)
        stepped = torch.cat(parts, 1)[:, :n]  # [1, n, vocab], after each text token
        worst = max(worst, float((stepped[0] - whole[0]).abs().max()))
    target.reset(0)
    return 2 * worst


def divergences(
    target: LlamaCppModel, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]
) -> list[dict]:
    """Each text differing from `ar`'s: where it first differs and the top-2 gap there."""
    found = []
    for index, (prompt, a, b) in enumerate(zip(prompts, got, want, strict=True)):
        if a == b:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None:  # one text is a prefix of the other: a stop decided differently
            first = min(len(a), len(b))
        ids = prompt + b[:first]
        target.reset(1)
        logits, _ = target.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
        target.reset(0)
        found.append({"input": index, "token": first, "top2_gap": top2_gap(logits[0, -1])})
    return found


def run_llama_bench(
    cfg: LlamaBenchConfig, prompt_ids: list[list[int]], progress: bool = True
) -> dict | None:
    longest = max(map(len, prompt_ids)) + cfg.max_new_tokens + max(cfg.num_draft_tokens) + 1
    shared = Shared(cfg, context=peer_context(longest))
    stop_ids = shared.decoder(None).default_stop_ids()  # no decoder held past a peer's turn
    settings = Settings(
        cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, stop_ids
    )
    methods = [LLAMA[name](k, shared, settings) for name, k in cfg.specs()]
    records, skipped, main = measure_shared(
        methods, prompt_ids, cfg.batch_sizes, cfg.repeats, progress
    )
    if not main:
        return None  # the main process writes the run's one record
    target = shared.target()
    sample = records[(REFERENCE, cfg.batch_sizes[0])].outputs[0][:48]
    noise = measure_noise(target, prompt_ids[0], sample) if sample else 0.0
    default = shared.decoder("model") if DefaultOnLlama.name in cfg.methods else None
    prices = default.prices() if default is not None else None

    def extras(row: dict, method: LlamaMethod, rec, base) -> None:
        if rec.stats is not None:
            total = rec.stats.total
            row["tokens_per_target_call"] = total.tokens_per_target_call
            row["acceptance"] = total.acceptance_rate
            row["drafted"] = total.drafted
        if method.exact and method.label != REFERENCE:
            found = divergences(target, prompt_ids, rec.outputs, base.outputs)
            row["divergences"] = found
            row["mismatches"] = [d["input"] for d in found if d["top2_gap"] > noise]

    rows = speed_rows(methods, records, "tokens", extras, also_against=("llama-cpp-python",))
    if cfg.rss:
        shared.release()  # held alongside a torch method's child, an fp32 target ran out of 24 GB
        for row in rows:
            row["peak_rss_gib"] = peak_rss(cfg, row["method"], prompt_ids[0])
    return bench_record(
        cfg,
        rows,
        skipped,
        backend="llama.cpp",
        threads=shared.threads(),
        noise_bound=noise,
        noise_how="twice the largest logit difference between the first prompt's ar text scored "
        "in one pass, in passes of 5 and one token at a time",
        prices=prices.to_json() if prices is not None else None,
    )


def peer_context(tokens: int) -> int:
    """A context for rows of `tokens` tokens: whole blocks of 256 (llama.cpp pads its cache to
    them), not the 4096 a row may reach, since each peer, and this engine's target and drafter
    (`Shared.engine_context`), hold a cache of their own."""
    return min(DEFAULT_CONTEXT, -(-tokens // 256) * 256)


def peak_rss(cfg: LlamaBenchConfig, label: str, prompt: list[int]) -> float:
    """Peak resident memory (GiB) of a process that loads one method and decodes one prompt."""
    job = json.dumps({"config": asdict(cfg), "label": label, "prompt": prompt})
    run = subprocess.run(
        [sys.executable, "-m", "specdecode.bench.llamacpp"],
        input=job,
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the memory probe of {label} failed: {run.stderr.strip()[-400:]}")
    return float(run.stdout.strip().splitlines()[-1])


def _probe() -> None:
    job = json.loads(sys.stdin.read())
    config = job["config"]
    config = {
        key: tuple(tuple(v) if isinstance(v, list) else v for v in value)
        if isinstance(value, list)
        else value
        for key, value in config.items()
    }
    cfg = LlamaBenchConfig(**config)
    name, _, rest = job["label"].partition("[k=")
    k = int(rest.rstrip("]")) if rest else None
    settings = Settings(
        cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, _stop_ids(cfg)
    )
    longest = len(job["prompt"]) + cfg.max_new_tokens + max(cfg.num_draft_tokens) + 1
    LLAMA[name](k, Shared(cfg, context=peer_context(longest)), settings).run([job["prompt"]])
    print(high_water_gib())


def high_water_gib() -> float:
    """This process's peak resident memory. Not `getrusage`'s ru_maxrss: Linux carries it over
    an exec from the forked copy of the parent, so a probe started by a 7 GiB bench process
    would report 7 GiB whatever it loads; the memory map's own high-water mark starts afresh."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _stop_ids(cfg: LlamaBenchConfig) -> tuple[int, ...]:
    """The ids every method stops at, as `generate` and llama.cpp's own tools do (every
    end-of-generation id of the GGUF), read without loading the weights."""
    from specdecode.backends.llamacpp_lib import gguf_stop_ids

    return gguf_stop_ids(gguf_path(cfg.target))


if __name__ == "__main__":
    _probe()
