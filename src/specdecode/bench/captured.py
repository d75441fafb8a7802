"""The captured path's bench: models of published shapes with random weights, acceptance set.

Real weights cannot reach every machine (a GPU host may be offline), and speed on a GPU depends
on shapes, not on what the weights say. So this bench builds the pair from config files of the
published sizes (`models/shapes/*.json`), with random weights, and controls acceptance: plain
decoding on the static path runs first and its text becomes each prompt's script; the
speculative methods then draft with the drafter model, which pays every one of its passes, but
propose the script's tokens instead of its own, each replaced by another token with probability
1 - acceptance (`ScriptedDrafter`). Greedy verification accepts exactly the script's tokens, so
the per-token acceptance is the one set, and every cost (drafter passes, verify passes,
rollback) is real. The record says so (`acceptance_control`) and gives the acceptance measured.

Random weights give logits without margins: the top two of 151,936 random logits lie so close
that a verify pass's arithmetic (another shape than a single step's) flips the argmax in
bfloat16, and greedy verification then rejects tokens the script holds. So the target gets
margins (`with_margins`): its layers' output projections are scaled down until the token's own
embedding rules the residual stream, and its output head maps each token's embedding to the
next token of a fixed random permutation, which then leads by a margin no rounding reaches.
Every matrix keeps its shape, so every pass costs what it costs with the published weights.

Methods, all on the same weights, interleaved by the one runner (`runner.measure`):
  ar             plain decoding on the static path (on a GPU its passes captured as CUDA graphs
                 by hand; `compile`: through torch.compile instead): the reference
  sd             speculative decoding on the static path, scripted drafter, per acceptance and k
  eager-ar/-sd   the same two on the eager DynamicCache path (`torch_eager`)
  hf-static      transformers `generate` with its static cache (compiled by transformers on GPUs)
  hf-assisted    transformers assisted generation with the drafter (acceptance not controlled:
                 random weights agree by chance only)
  graph-ar       plain decoding by a hand-captured CUDA graph of one step over transformers'
                 StaticCache (CUDA only): the floor a captured step can reach
The Leviathan bound at batch 1 comes from prices measured on the static path (a drafter step and a
verify pass of k + 1 tokens, in target steps) at the acceptance measured (the per-token acceptance
that explains the tokens per target call), so `of_bound` says how much of what the prices allow
the loop turns into speed. At each batch size the record also says what drafting `auto` plans
there (`auto_plans`): the draft length its planner picks at that row count's measured prices and
each acceptance set, so the speed of `sd` at that length is what a user of `auto` gets.

What a GPU user waits for is recorded too (`startup`): building the pair, the first call
(prefill, then every shape's capture), and each capture's time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.torch_eager import CachedModel, cache_kwargs
from specdecode.backends.torch_static import MAX_FIXED_WIDTH, StaticCachedModel
from specdecode.bench.config import (
    DEFAULT_ACCEPTANCE,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_METHODS_OF,
    REFERENCE,
    BenchConfig,
)
from specdecode.bench.methods import Registry, Result, Settings, SharedModels, timed_generate
from specdecode.bench.metrics import alpha_from_tokens_per_call, expected_tokens_per_call
from specdecode.bench.runner import bench_record, measure, speed_rows
from specdecode.core.drafting.base import Draft, Drafter
from specdecode.core.drafting.planners import plan_lengths
from specdecode.core.prices import Prices
from specdecode.pricebook import pass_seconds

CAPTURED = Registry("captured")
CONTROL = (
    "controlled: the drafter model runs every pass but proposes the text plain decoding on the "
    "static path wrote for the prompt, each token replaced by another with probability "
    "1 - acceptance; weights are random, shapes are the published ones, and the target's next "
    "token leads by a wide margin (layers' outputs scaled down, the head a permutation of the "
    "embeddings), so bfloat16 arithmetic cannot flip it"
)
QUIET = 1e-4  # the scale of the layers' output projections in a margined target
RESIDUAL_OUTPUTS = ("o_proj", "down_proj")  # what writes into the residual stream (Llama, Qwen)


def shape_names() -> list[str]:
    folder = resources.files("specdecode.models") / "shapes"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def shape_fields(name: str) -> dict:
    """A published shape's config fields (`models/shapes/NAME.json`), or a config .json file's."""
    path = Path(name)
    if not (name.endswith(".json") and path.is_file()):
        path = resources.files("specdecode.models") / "shapes" / f"{name}.json"
        if not path.is_file():
            raise ValueError(
                f"unknown shape {name!r}; known: {', '.join(shape_names())}, or a config .json file"
            )
    return json.loads(path.read_text())


def shape_config(name: str):
    """The transformers config of a shape (a name or a config file)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**shape_fields(name))


def random_model(name: str, dtype: torch.dtype, device: str, seed: int) -> torch.nn.Module:
    """A model of a published shape with random weights, built on its device (a 7B model in
    fp32 on the host would need 30 GB)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype)
    return model.eval()


@torch.no_grad()
def with_margins(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The model with a wide margin between its top logit and the rest, every shape kept.

    Each projection that writes into the residual stream is scaled by `QUIET`, so the stream
    stays the input token's embedding e_t up to a small remainder; the output head (untied:
    transformers ties Qwen3's to the embedding) holds e_t as the row of next(t), a random
    permutation's image. Then logit next(t) = |e_t|^2 / rms(e_t), about 0.02 x hidden (51 at
    the Qwen3-4B width), where the others are about N(0, 1), at most about 5 among 151,936:
    bfloat16 rounds a logit of 50 by 0.2.
    """
    quieted = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS and isinstance(module, torch.nn.Linear):
            module.weight.mul_(QUIET)
            quieted += 1
    if quieted < model.config.num_hidden_layers:
        raise ValueError(
            f"{type(model).__name__}: margins need projections named {RESIDUAL_OUTPUTS} in "
            "every layer (Llama and Qwen names); this architecture has other names"
        )
    embeddings = model.get_input_embeddings().weight  # [vocab, hidden]
    order = torch.randperm(embeddings.shape[0], generator=torch.Generator().manual_seed(seed)).to(
        embeddings.device
    )  # [vocab]: next(t) = order[t]
    head = torch.empty_like(embeddings)  # [vocab, hidden]
    head[order] = embeddings
    model.get_output_embeddings().weight = torch.nn.Parameter(head, requires_grad=False)
    model.config.tie_word_embeddings = False
    return model


class ScriptedDrafter:
    """Pays the wrapped drafter's passes, proposes the script's tokens (some replaced).

    scripts: [rows, capacity] each row's prompt and the plain text after it (by original row);
    a drafted position p of row b proposes scripts[b, p], replaced with probability
    1 - acceptance by a different token drawn uniformly.
    """

    def __init__(
        self, inner: Drafter, scripts: torch.Tensor, acceptance: float, vocab: int, seed: int
    ) -> None:
        self.inner = inner
        self.scripts = scripts
        self.acceptance = acceptance
        self.vocab = vocab
        self.gen = torch.Generator(device=scripts.device).manual_seed(seed)

    def start(self, batch_size: int) -> None:
        self.inner.start(batch_size)
        self.rows = torch.arange(batch_size, device=self.scripts.device)

    def rests(self) -> bool:
        return False  # its every round may draft

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        draft = self.inner.propose(sequences, seq_lens, max_tokens, rng)
        if draft.probs is not None:
            raise ValueError("scripted drafting controls greedy acceptance only")
        batch, k = draft.tokens.shape
        slots = torch.arange(k, device=seq_lens.device)
        index = (seq_lens[:, None] + slots).clamp(max=self.scripts.shape[1] - 1)  # [batch, k]
        truth = self.scripts.index_select(0, self.rows).gather(1, index)  # [batch, k]
        dev = self.scripts.device
        replaced = torch.rand(batch, k, generator=self.gen, device=dev) >= self.acceptance
        other = torch.randint(1, self.vocab, (batch, k), generator=self.gen, device=dev)
        tokens = torch.where(replaced, (truth + other) % self.vocab, truth)
        return replace(draft, tokens=tokens)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        self.inner.rollback(lengths, num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)
        self.rows = self.rows.index_select(0, rows.to(self.rows.device))

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        return self.inner.next_law(sequences, seq_lens, rows)


@dataclass(frozen=True, kw_only=True)
class CapturedBenchConfig(BenchConfig):
    """The captured path's bench: the shared settings, a pair of shapes, the acceptance held,
    and random prompts."""

    DEFAULT_METHODS: ClassVar[tuple[str, ...]] = DEFAULT_METHODS_OF["captured"]

    target: str  # a shape name (models/shapes) or a config .json file
    draft: str
    device: str = "cpu"
    dtype: str = "bfloat16"
    compile: bool = False  # torch.compile the static passes (else captured by hand on CUDA)
    acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE
    num_draft_tokens: tuple[int, ...] = DEFAULT_DRAFT_TOKENS
    prompts: int | None = None  # None: the largest batch size
    prompt_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.methods:
            CAPTURED.lookup(name)
        for name in (self.target, self.draft):
            shape_fields(name)  # a known shape or a readable config file, before any model
        if any(not 0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"acceptance must lie in [0, 1], got {self.acceptance}")
        if any(k < 1 for k in self.num_draft_tokens):
            raise ValueError(f"draft lengths must be >= 1, got {self.num_draft_tokens}")
        if self.prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens must be >= 1, got {self.prompt_tokens}")
        if self.prompts is not None and self.prompts < 1:
            raise ValueError(f"--limit (random prompts) must be >= 1, got {self.prompts}")

    @property
    def captured(self) -> bool:
        return self.device.startswith("cuda") and not self.compile

    @property
    def prompt_count(self) -> int:
        return self.prompts or max(self.batch_sizes)


class Pair(SharedModels):
    """The random-weight pair, its backends and decoders, and each prompt's script."""

    def __init__(self, cfg: CapturedBenchConfig) -> None:
        super().__init__()
        dtype = getattr(torch, cfg.dtype)
        self.cfg = cfg
        self.target = with_margins(random_model(cfg.target, dtype, cfg.device, cfg.seed), cfg.seed)
        self.drafter = random_model(cfg.draft, dtype, cfg.device, cfg.seed + 1)
        self.vocab = self.target.get_output_embeddings().weight.shape[0]
        self.scripts: dict[tuple[int, ...], list[int]] = {}
        gen = torch.Generator().manual_seed(cfg.seed)
        self.prompts: list[list[int]] = torch.randint(
            1, self.vocab, (cfg.prompt_count, cfg.prompt_tokens), generator=gen
        ).tolist()  # the bench's random prompts

    def decoder(self, static: bool) -> SpeculativeDecoder:
        def build() -> SpeculativeDecoder:
            if static:  # a row's cache sized once: prompt, new tokens, a verify pass
                cfg = self.cfg
                room = cfg.prompt_tokens + cfg.max_new_tokens + MAX_FIXED_WIDTH
                return SpeculativeDecoder(
                    StaticCachedModel(self.target, "target", cfg.compile, capacity=room),
                    drafter=StaticCachedModel(self.drafter, "drafter", cfg.compile, capacity=room),
                )
            return SpeculativeDecoder(CachedModel(self.target), drafter=CachedModel(self.drafter))

        return self.shared(f"decoder static={static}", build)

    def script_rows(self, prompts: list[list[int]]) -> torch.Tensor:
        """[rows, capacity]: each prompt followed by the static path's plain text for it (as
        long as the run's longest), decoded alone the first time the prompt is seen (untimed)."""
        decoder = self.decoder(static=True)
        longest = Settings(self.cfg.max_new_tokens)
        for prompt in prompts:
            if tuple(prompt) not in self.scripts:
                out = decoder.generate([prompt], use_drafter=False, **engine_options(longest))
                self.scripts[tuple(prompt)] = out.sequences[0]
        texts = [self.scripts[tuple(p)] for p in prompts]
        rows = torch.zeros(len(texts), max(map(len, texts)) + 1, dtype=torch.long)
        for i, text in enumerate(texts):
            rows[i, : len(text)] = torch.tensor(text)
        return rows.to(self.cfg.device)


def engine_options(s: Settings) -> dict[str, Any]:
    return dict(max_new_tokens=s.max_new_tokens, stop_token_ids=[])  # random text: no stop


def synced_seconds(device: torch.device, started: float) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


class CapturedMethod:
    """A method of this bench: the runner's `BenchMethod`."""

    name: ClassVar[str]
    batch1_only: ClassVar[bool] = False
    cuda_only: ClassVar[bool] = False
    exact: ClassVar[bool] = False  # greedy and on the reference's own path: must equal `ar`
    pairing = None

    def __init__(self, pair: Pair, settings: Settings, acceptance=None, k=None) -> None:
        self.pair = pair
        self.settings = settings
        self.acceptance = acceptance
        self.k = k

    @property
    def label(self) -> str:
        if self.k is None:
            return self.name
        return f"{self.name}[k={self.k},a={self.acceptance:g}]"

    def unavailable(self) -> str | None:
        """Why this method cannot run in this bench at all (None: it can)."""
        if self.cuda_only and not self.pair.cfg.device.startswith("cuda"):
            return "CUDA only"
        return None

    def skips(self, batch_size: int) -> str | None:
        if self.batch1_only and batch_size > 1:
            return "runs one prompt at a time"
        return self.unavailable()

    warm_up_seconds: float | None = None

    def prepare(self, sample: Sequence[list[int]]) -> None:
        """Warm-up on the first batch of every batch size this method runs, as long as the
        timed runs: each shape's capture (or compile) is paid here and timed
        (`warm_up_seconds`). A shorter warm-up misses the row buckets a batch meets as its rows
        finish at different rounds (seeded drafts finish them in the same order again), and
        the first timed run would pay their captures (docs/backends.md has the case)."""
        if self.unavailable() is not None:
            return
        started = time.perf_counter()
        for rows in self.pair.cfg.batch_sizes:
            if self.skips(rows) is None:
                self.decode(self.pair.prompts[:rows], self.settings)
        self.warm_up_seconds = synced_seconds(torch.device(self.pair.cfg.device), started)

    def run(self, batch: Sequence[list[int]]) -> Result:
        return self.decode(list(batch), self.settings)

    def decode(self, prompts: list[list[int]], s: Settings) -> Result:
        raise NotImplementedError


class EngineRun(CapturedMethod):
    static: ClassVar[bool] = True
    drafts: ClassVar[bool] = False

    def decode(self, prompts: list[list[int]], s: Settings) -> Result:
        decoder = self.pair.decoder(self.static)
        options = engine_options(s)
        if self.drafts:
            scripts = self.pair.script_rows(prompts)
            seed = self.pair.cfg.seed
            options.update(drafting="model", num_draft_tokens=self.k)
            model = decoder.drafter_for(len(prompts), **options)
            if model is not None:  # it pays the model's passes, but proposes the script
                options["drafter"] = ScriptedDrafter(
                    model, scripts, self.acceptance, self.pair.vocab, seed
                )
        out = decoder.generate(prompts, use_drafter=self.drafts, **options)
        return Result(out.new_tokens, out.stats.wall_seconds, out.stats)


@CAPTURED.add
class StaticPlain(EngineRun):
    name = "ar"


@CAPTURED.add
class StaticSpeculative(EngineRun):
    name = "sd"
    drafts = True
    exact = True


@CAPTURED.add
class EagerPlain(EngineRun):
    name = "eager-ar"
    static = False


@CAPTURED.add
class EagerSpeculative(EngineRun):
    name = "eager-sd"
    static = False
    drafts = True


class TransformersRun(CapturedMethod):
    def options(self) -> dict[str, Any]:
        return {}

    def decode(self, prompts: list[list[int]], s: Settings) -> Result:
        model = self.pair.target
        ids = torch.tensor(prompts, device=model.device)  # [batch, prompt] (equal lengths)
        options = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=s.max_new_tokens,
            min_new_tokens=s.max_new_tokens,  # random text: no early stop
            do_sample=False,
            temperature=None,
            top_k=None,
            top_p=None,
            pad_token_id=0,
        )
        return timed_generate(
            model, lambda: {"input_ids": ids, **options, **self.options()}, ids.shape[1], list
        )


@CAPTURED.add
class TransformersStatic(TransformersRun):
    name = "hf-static"

    def options(self) -> dict[str, Any]:
        return {"cache_implementation": "static"}


@CAPTURED.add
class TransformersAssisted(TransformersRun):
    name = "hf-assisted"
    batch1_only = True

    def unavailable(self) -> str | None:
        if self.pair.drafter.config.vocab_size != self.pair.target.config.vocab_size:
            return "transformers assisted generation needs the pair's vocabularies equal"
        return super().unavailable()

    def options(self) -> dict[str, Any]:
        return {"assistant_model": self.pair.drafter}


@CAPTURED.add
class GraphPlain(CapturedMethod):
    """Greedy decoding by replaying one hand-captured CUDA graph of a one-token step over
    transformers' StaticCache: no Python engine, no compiler guards, one replay a token."""

    name = "graph-ar"
    cuda_only = True

    def decode(self, prompts: list[list[int]], s: Settings) -> Result:
        from transformers import StaticCache

        model = self.pair.target
        ids = torch.tensor(prompts, device=model.device)  # [batch, prompt]
        batch, width = ids.shape
        started = time.perf_counter()
        cache = StaticCache(config=model.config, max_cache_len=width + s.max_new_tokens + 1)
        kwargs = cache_kwargs(model, cache)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=True, **kwargs).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)  # [batch, 1]
            position = torch.full((batch, 1), width, dtype=torch.long, device=model.device)

            def step() -> torch.Tensor:
                out = model(input_ids=token, position_ids=position, use_cache=True, **kwargs)
                return out.logits

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up on a side stream, as capture requires; it wrote one slot ...
            torch.cuda.current_stream().wait_stream(side)
            for layer in cache.layers:  # ... which the first replay writes again
                layer.cumulative_length.fill_(width)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()  # [batch, 1, vocab]; the cache's write offset advances in-graph
            tokens = [token.clone()]
            for _ in range(s.max_new_tokens - 1):
                graph.replay()
                token.copy_(out[:, -1].argmax(-1, keepdim=True))
                position.add_(1)
                tokens.append(token.clone())
        new = torch.cat(tokens, 1)  # [batch, new]
        return Result(new.tolist(), synced_seconds(model.device, started))


def captured_methods(cfg: CapturedBenchConfig, pair: Pair, settings: Settings) -> list:
    methods = []
    for name in cfg.methods:
        cls = CAPTURED.lookup(name)
        if issubclass(cls, EngineRun) and cls.drafts:
            methods += [cls(pair, settings, a, k) for a in cfg.acceptance
                        for k in cfg.num_draft_tokens]  # fmt: skip
        else:
            methods.append(cls(pair, settings))
    return methods


Timed = dict[int, tuple[dict[int, float], float]]  # rows -> (target seconds by width, drafter)


def timed_passes(pair: Pair, cfg: CapturedBenchConfig) -> Timed:
    """Seconds of even passes on the static path at each batch size (and one row): the target
    holding 1 to K + 1 tokens a row (K the longest draft asked for), a drafter step."""
    decoder = pair.decoder(static=True)
    widths = list(range(1, max(cfg.num_draft_tokens) + 2))
    context = [(1000 + i) % pair.vocab for i in range(cfg.prompt_tokens)]
    timed: Timed = {}
    for rows in sorted({1, *cfg.batch_sizes}):
        target, drafted = pass_seconds(
            [(decoder.target_backend, widths), (decoder.drafter_backend, [1])], context, 5, rows
        )
        timed[rows] = (target, drafted[1])
    return timed


def static_prices(timed: Timed, cfg: CapturedBenchConfig) -> dict:
    """Prices on the static path at batch 1: a target step (ms), verify passes of k + 1 tokens
    and a drafter step (in target steps), what the Leviathan bound is computed from."""
    target, draft = timed[1]
    return {
        "target_step_ms": target[1] * 1e3,
        "verify_steps": {str(k): target[k + 1] / target[1] for k in cfg.num_draft_tokens},
        "drafter_step": draft / target[1],
    }


def auto_plans(timed: Timed, cfg: CapturedBenchConfig) -> list[dict]:
    """What drafting `auto`'s planner drafts per row at each batch size and acceptance set: its
    plan (`plan_lengths`) at that row count's measured prices, every row drafting by the model
    at that acceptance, at most K tokens (the longest draft asked for, so the plan's length is
    one the bench measured). `gain`: the plan's expected tokens per unit of cost over a plain
    step's, at those prices."""
    most = max(cfg.num_draft_tokens)
    step = timed[1][0][1]
    plans = []
    for rows in cfg.batch_sizes:
        counts = sorted({1, rows})
        prices = Prices(
            tuple(counts),
            tuple(tuple(timed[r][0][w] / step for w in range(1, most + 2)) for r in counts),
            tuple(timed[r][1] / step for r in counts),
        )
        one_token = prices.even_cost(rows, 1)  # a plain round
        for a in cfg.acceptance:
            k, _, outlook = plan_lengths(
                [a] * rows, [most] * rows, [most] * rows, [True] * rows, prices
            )
            plans.append({
                "batch_size": rows,
                "acceptance": a,
                "k": sorted(set(k)),
                "gain": outlook.ratio * one_token / rows,
                "verify_steps": prices.even_cost(rows, most + 1) / one_token,
                "drafter_step": (prices.draft_cost(rows) or 0.0) / one_token,
            })  # fmt: skip
    return plans


def leviathan_bound(prices: dict, alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(k c + v)): the speedup these prices allow a loop with
    no overhead, at per-token acceptance alpha."""
    cost = k * prices["drafter_step"] + prices["verify_steps"][str(k)]
    return expected_tokens_per_call(alpha, k) / cost


def run_captured_bench(cfg: CapturedBenchConfig, progress: bool = True) -> dict:
    if cfg.device == "cpu":
        # random weights shrink activations layer by layer into subnormal floats, which the CPU
        # computes with 10-100x slowdowns (a 0.5B drafter step measured at 5.6 steps of the
        # 1.5B target); trained weights stay normal, so flushing them keeps the costs real
        torch.set_flush_denormal(True)
    try:
        return _run(cfg, progress)
    finally:
        torch.set_flush_denormal(False)  # torch's default, for the rest of the process


def _run(cfg: CapturedBenchConfig, progress: bool) -> dict:
    device = torch.device(cfg.device)
    started = time.perf_counter()
    pair = Pair(cfg)
    built = synced_seconds(device, started)
    prompts = pair.prompts
    started = time.perf_counter()  # a user's first token: the prompt's pass, nothing captured
    pair.decoder(static=True).generate(prompts[:1], max_new_tokens=1, use_drafter=False)
    startup = {"build_seconds": built, "first_token_seconds": synced_seconds(device, started)}
    settings = Settings(cfg.max_new_tokens, seed=cfg.seed)
    methods = captured_methods(cfg, pair, settings)
    records, skipped = measure(methods, prompts, cfg.batch_sizes, cfg.repeats, progress)
    drafts = any(m.k is not None for m in methods)
    timed = timed_passes(pair, cfg) if drafts else None
    prices = static_prices(timed, cfg) if timed is not None and 1 in cfg.batch_sizes else None

    def extras(row: dict, method: CapturedMethod, rec, base) -> None:
        row["warm_up_seconds"] = method.warm_up_seconds
        if rec.stats is None or method.k is None:
            return
        tau = rec.stats.total.tokens_per_target_call
        alpha = alpha_from_tokens_per_call(min(max(tau, 1.0), method.k + 1), method.k)
        row.update(acceptance_set=method.acceptance, k=method.k, acceptance_measured=alpha,
                   tokens_per_target_call=tau)  # fmt: skip
        if prices is not None and row["batch_size"] == 1 and method.name == "sd":
            bound = leviathan_bound(prices, alpha, method.k)
            row.update(leviathan_bound=bound, of_bound=row["speedup"]["geomean"] / bound)

    rows = speed_rows(methods, records, "tokens", extras, also_against=("hf-static", "eager-ar"))
    decoder = pair.decoder(static=True)
    backends = {"target": decoder.target_backend, "drafter": decoder.drafter_backend}
    startup["captures"] = {r: [asdict(t) for t in b.capture_times] for r, b in backends.items()}
    startup["capture_failures"] = {r: b.capture_failure for r, b in backends.items()}
    return bench_record(cfg, rows, skipped, acceptance_control=CONTROL, prices=prices,
                        auto_plans=auto_plans(timed, cfg) if timed is not None else None,
                        startup=startup, captured=cfg.captured, compiled=cfg.compile,
                        reference=REFERENCE)  # fmt: skip
