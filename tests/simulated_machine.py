"""A simulated machine for drafting `auto`: the real loop, plan and judge, no model, virtual time.

Drafting `auto` must hold on machines the project never runs on. This module runs the engine's
own `DecodeLoop`, the mixed drafter and its `PricedPlanner`, the timing of prices
(`measure_prices`) and drafting's judge (`Outcomes`) over backends that run no model:

* `Machine`: a virtual clock. Each target pass advances it by what a cost curve (`Curve`, in
  steps; the project's own `Prices` interpolates it) gives for its rows and tokens, as the
  backend runs a ragged pass (`levels` for llama.cpp, `padded` for PyTorch); a drafter step by
  its rows. Times carry multiplicative noise, a slow drift, step changes (another process
  starts) and rare stalls.
* `World`: what every row's text is (a script of tokens per row) and, per source (lookup,
  corpus, drafter model), at which positions that source's guess is right: independent per
  token, bursty along the text, varying by row. A drafted token is the script's where its
  source is right there, another token elsewhere, so the real verification rule accepts what
  the process says.
* `SimModel`: the `ModelBackend` of the target (logits on the script's next token) or of the
  drafter model (on the script's token where the model is right, another elsewhere).
* `SimDrafter`: the real `MixedDrafter`, whose drafts free of model passes (lookup, corpus)
  come from the world rather than from an n-gram search.

`run` keeps `rows` rows decoding (a row that ends is replaced, as on a server) for a number of
rounds and returns tokens and virtual seconds; thousands of rounds take seconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

import torch

from specdecode.backends.base import PendingFromLengths, StepFromForward
from specdecode.core.config import LOOKUP_ALONE, LOOKUP_FIRST, DecodeConfig
from specdecode.core.drafting.corpus import BAND_PRIORS
from specdecode.core.drafting.mixed import MixedDrafter, corpus_key
from specdecode.core.drafting.model import ModelDrafter
from specdecode.core.drafting.planners import FixedPlanner, PricedPlanner, model_can_pay
from specdecode.core.engine import DecodeLoop, RowRequest
from specdecode.core.length_policies import ConstantLength
from specdecode.core.outcomes import Outcomes
from specdecode.core.prices import PRICED_TOKENS, Prices
from specdecode.core.sampling import RowSampling
from specdecode.pricebook import measure_prices

VOCAB = 64
TEXT = 1024  # positions of a row's script (prompt, new tokens, drafts)
PROMPT = 24  # a row's prompt tokens
KEYS = 1 << 20  # distinct rows before their scripts repeat


# ---- machines ----


@dataclass(frozen=True)
class Curve:
    """A machine's true costs, in steps: `passes[i][t - 1]` an even pass of `rows[i]` rows of t
    tokens, `drafts[i]` a drafter step over `rows[i]` rows; `step_ms` a one-row step.
    `plan_steps`: host work of a round that searches for drafts and plans them, whether it
    then drafts or not (the lookup, the corpus, the plan), which no pass holds."""

    name: str
    rows: tuple[int, ...]
    passes: tuple[tuple[float, ...], ...]
    drafts: tuple[float, ...]
    layout: str
    step_ms: float
    plan_steps: float = 0.0

    @property
    def prices(self) -> Prices:
        return Prices(self.rows, self.passes, self.drafts, self.step_ms / 1e3, self.layout)

    def with_drafter(self, step: float) -> Curve:
        """The same machine with a drafter whose one-row step costs `step` target steps."""
        scale = step / self.drafts[0]
        drafts = tuple(d * scale for d in self.drafts)
        return replace(self, name=f"{self.name}, drafter {step:g}", drafts=drafts)


def _filled(points: dict[int, float]) -> tuple[float, ...]:
    """A curve over 1..PRICED_TOKENS tokens from measured points, linear between them."""
    known = sorted(points)
    out = []
    for t in range(1, PRICED_TOKENS + 1):
        if t in points:
            out.append(points[t])
            continue
        low = max(k for k in known if k < t)
        high = min(k for k in known if k > t)
        share = (t - low) / (high - low)
        out.append(points[low] + share * (points[high] - points[low]))
    return tuple(out)


def _formula(base: dict[int, float], slope: dict[int, float]) -> tuple[tuple[float, ...], ...]:
    return tuple(
        tuple(base[r] * (1 + slope[r] * (t - 1)) for t in range(1, PRICED_TOKENS + 1))
        for r in sorted(base)
    )


ROWS = (1, 2, 4, 8)
# a 2-core AMD EPYC VM, the default pair on llama.cpp (compute-bound steps), the middle of each
# measured range; tokens between the measured counts read linearly
EPYC = Curve(
    "EPYC CPU",
    ROWS,
    (
        _filled({1: 1.0, 2: 1.72, 3: 2.36, 4: 3.04, 5: 3.63, 6: 4.33, 8: 6.63, 12: 8.12}),
        _filled({1: 1.68, 2: 2.79, 3: 3.94, 4: 6.33, 5: 7.24, 6: 7.94, 8: 8.28, 12: 11.39}),
        _filled({1: 2.97, 2: 6.66, 3: 8.05, 4: 8.05, 5: 10.56, 6: 12.50, 8: 13.23, 12: 18.57}),
        _filled({1: 7.12, 2: 7.73, 3: 12.02, 4: 13.38, 5: 18.95, 6: 20.22, 8: 24.93, 12: 35.40}),
    ),
    (0.69, 1.14, 1.67, 3.29),
    "levels",
    37.5,
    plan_steps=0.03,
)


def _cpu(name: str, base: dict[int, float], slope: dict[int, float], drafts, ms: float) -> Curve:
    """A llama.cpp CPU whose pass of r rows of t tokens costs base[r] (1 + slope[r] (t - 1))."""
    return Curve(name, ROWS, _formula(base, slope), drafts, "levels", ms, plan_steps=0.02)


# the development VM (2-core Intel Xeon, memory-bound): about 0.35 of a step a token, 8 rows
# twice the tokens/s of one
XEON = _cpu(
    "Xeon CPU", {1: 1.0, 2: 1.3, 4: 2.2, 8: 4.0}, {1: 0.35, 2: 0.35, 4: 0.38, 8: 0.40},
    (0.65, 0.85, 1.3, 2.3), 55.0,
)  # fmt: skip
# a CPU where every token of a pass costs a full step, and rows no less
FULL_STEP = _cpu(
    "full-step CPU", {r: float(r) for r in ROWS}, dict.fromkeys(ROWS, 1.0),
    (0.4, 0.8, 1.6, 3.2), 40.0,
)  # fmt: skip
# a GPU, passes captured: up to 8 tokens within 1.1 steps, rows nearly free
GPU = Curve(
    "GPU",
    ROWS,
    tuple(
        tuple(1 + 0.014 * (t - 1) + 0.02 * (r - 1) + 0.004 * r * (t - 1) for t in range(1, 13))
        for r in ROWS
    ),
    (0.2, 0.21, 0.22, 0.25),
    "padded",
    12.0,
    plan_steps=0.05,
)
CURVES = {"xeon": XEON, "epyc": EPYC, "full-step": FULL_STEP, "gpu": GPU}


@dataclass(frozen=True)
class Weather:
    """What a machine's times suffer besides its curve: uniform noise of +-`noise`, a slow
    drift of +-`drift` over `drift_rounds` rounds, a factor `shift` on every cost once the
    machine has shifted (another process started: `Machine.shifted`), a stall of `stall` one-row
    steps added, on average once in `stall_every` steps of work (the process preempted, a page
    fault: a wait that comes as often in a long pass as in as many short ones, and does not grow
    with the pass it falls in)."""

    noise: float = 0.0
    drift: float = 0.0
    drift_rounds: int = 3000
    shift: float = 1.0
    stall: float = 5.0
    stall_every: int = 0


class Machine:
    """A virtual clock that passes advance by what they cost on `curve` in `weather`; once
    `shifted`, on `after_shift` (where given) instead."""

    def __init__(
        self,
        curve: Curve,
        weather: Weather = Weather(),
        seed: int = 0,
        after_shift: Curve | None = None,
    ) -> None:
        self.weather, self.seed = weather, seed
        # each curve with its prices, built once (every pass reads them)
        self.curves = [(c, c.prices) for c in (curve, after_shift or curve)]
        self.now = 0.0
        self.round = -1  # the run's round (-1: timing prices)
        self.passes = 0
        self.random: dict[str, random.Random] = {}  # per kind of work (`spend`), this round's
        self.shifted = False

    @property
    def curve(self) -> Curve:
        """The curve in effect now."""
        return self.curves[self.shifted][0]

    def clock(self) -> float:
        return self.now

    def at_round(self, index: int) -> None:
        """The run's round `index` starts: its passes draw their weather from it."""
        self.round, self.passes = index, 0
        self.random = {}

    def spend(self, steps: float, kind: str = "target", prompt: int | None = None) -> None:
        """Advance the clock by `steps` of `kind` of work ("target", "drafter", "host").

        Each kind draws its weather from its own stream, seeded by the round, and a pass that
        reads a row's prompt (`prompt`: its key) from that row's: the target passes of round i,
        and every row's prompt pass wherever it falls, meet the same noise and stalls in every
        method's run, whatever the others ran before them (common random numbers: two methods
        compared over 500 rounds differ by what they do, not by their dice)."""
        if prompt is not None:
            rng = random.Random((self.seed * KEYS + prompt) * 4 + 3)
        else:
            if kind not in self.random:
                stream = ("target", "drafter", "host").index(kind)
                seeded = (self.seed * 1_000_003 + self.round) * 4 + stream
                self.random[kind] = random.Random(seeded)
            rng = self.random[kind]
        w = self.weather
        factor = 1.0 + rng.uniform(-w.noise, w.noise)
        if w.drift:
            factor *= 1.0 + w.drift * math.sin(2 * math.pi * max(self.round, 0) / w.drift_rounds)
        if self.shifted:
            factor *= w.shift
        stalled = w.stall if w.stall_every and rng.random() * w.stall_every < steps else 0.0
        self.passes += 1
        self.now += (steps * factor + stalled) * self.curve.step_ms / 1e3

    def pass_steps(self, counts: list[int]) -> float:
        return self.curves[self.shifted][1].shape_cost(counts)

    def draft_steps(self, rows: int, tokens: int) -> float:
        truth = self.curves[self.shifted][1]
        step = truth.draft_cost(rows) or 0.0
        return step * truth.even_cost(1, tokens) / truth.even_cost(1, 1)


# ---- texts ----


@dataclass(frozen=True)
class Process:
    """Where a source is right along a text: with probability `rate` at each position, in runs
    of `burst` positions on average (1: independent), each row's rate drawn within +-`spread`
    of it."""

    rate: float
    burst: float = 1.0
    spread: float = 0.0

    def draw(self, rng: random.Random, length: int) -> list[bool]:
        rate = min(max(self.rate + rng.uniform(-self.spread, self.spread), 0.0), 1.0)
        if self.burst <= 1.0:
            return [rng.random() < rate for _ in range(length)]
        # a two-state chain with stationary share `rate` and runs of `burst` on average
        leave_right = 1.0 / self.burst
        leave_wrong = leave_right * rate / max(1.0 - rate, 1e-9)
        if leave_wrong > 1.0:  # a rate too high for such runs: shorten the right runs
            leave_right, leave_wrong = (1.0 - rate) / rate, 1.0
        out, right = [], rng.random() < rate
        for _ in range(length):
            out.append(right)
            if rng.random() < (leave_right if right else leave_wrong):
                right = not right
        return out


@dataclass(frozen=True)
class Text:
    """A kind of text: where a lookup match exists (`matched`) and how often its guesses are
    right there, where the corpus guesses (where no match is) and how well, how well the
    drafter model guesses."""

    name: str
    matched: Process
    lookup: Process
    corpus: Process
    model: Process
    corpus_seen: float = 0.6  # share of unmatched positions where the corpus has a guess


TEXTS = {
    "code": Text("code", Process(0.3, 6), Process(0.8, 5), Process(0.45), Process(0.75, 4, 0.1)),
    "chat": Text(
        "chat", Process(0.1, 3), Process(0.6, 2), Process(0.2), Process(0.55, 2, 0.15), 0.3
    ),
    "copying": Text("copying", Process(0.7, 12), Process(0.92, 8), Process(0.3), Process(0.8, 4)),
    "hostile": Text("hostile", Process(0.2), Process(0.2), Process(0.1), Process(0.25, 1, 0.1)),
}


class World:
    """Every row's script and where each source is right in it, drawn once per row key."""

    def __init__(self, text: Text, seed: int = 0) -> None:
        self.text, self.seed = text, seed
        self.rows: dict[int, dict[str, torch.Tensor]] = {}

    def row(self, key: int) -> dict[str, torch.Tensor]:
        if key not in self.rows:
            rng = random.Random(self.seed * KEYS + key)
            t = self.text
            self.rows[key] = {
                "script": torch.tensor([rng.randrange(1, VOCAB) for _ in range(TEXT)]),
                **{
                    name: torch.tensor(process.draw(rng, TEXT))
                    for name, process in (
                        ("matched", t.matched),
                        ("lookup", t.lookup),
                        ("corpus", t.corpus),
                        ("model", t.model),
                        ("corpus_seen", Process(t.corpus_seen)),
                    )
                },
            }
        return self.rows[key]

    def prompt(self, key: int) -> list[int]:
        """A row's prompt: its key in the first two tokens (the backends read it), then its
        script."""
        script = self.row(key)["script"]
        return [key // VOCAB % VOCAB, key % VOCAB, *script[2:PROMPT].tolist()]

    @staticmethod
    def key(prompt: list[int]) -> int:
        return prompt[0] * VOCAB + prompt[1]

    def guess(self, key: int, source: str, start: int, count: int) -> torch.Tensor:
        """The source's tokens for positions start..start+count-1: the script's where it is
        right, another token elsewhere."""
        row = self.row(key)
        script = row["script"][start : start + count]
        right = row[source][start : start + count]
        return torch.where(right, script, script % (VOCAB - 1) + 1)


# ---- models ----


class SimModel(PendingFromLengths, StepFromForward):
    """A `ModelBackend` that runs no model: the target's logits point at the script's next
    token; the drafter model's at it where the model is right, at another token elsewhere.
    Every pass advances the machine's clock by what it costs there."""

    def __init__(self, machine: Machine, world: World, role: str) -> None:
        self.machine, self.world, self.role = machine, world, role
        self.device = torch.device("cpu")
        self.vocab_size = VOCAB
        self.context_length = TEXT - 16
        self.pass_layout = machine.curve.layout
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.keys: list[int | None] = []
        self.scripts = torch.zeros(0, TEXT, dtype=torch.long)

    def reset(self, batch_size: int) -> None:
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.keys = [None] * batch_size
        self.scripts = torch.zeros(batch_size, TEXT, dtype=torch.long)

    def _learn_keys(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        for b, key in enumerate(self.keys):
            if key is None and int(self.lengths[b]) == 0 and bool(valid[b].any()):
                first = tokens[b][valid[b]][:2].tolist()
                self.keys[b] = World.key(first)
                self.scripts[b] = self._script(self.keys[b])

    def _script(self, key: int) -> torch.Tensor:
        row = self.world.row(key)
        if self.role == "target":
            return row["script"]
        return self.world.guess(key, "model", 0, TEXT)

    def forward(self, tokens, valid, logits_to_keep=1, want_hidden=False):
        self._learn_keys(tokens, valid)
        counts = valid.sum(1)  # [batch]
        held = counts.tolist()
        starts = zip(self.keys, self.lengths.tolist(), held, strict=True)
        prompts = [k for k, n, c in starts if not n and c]  # rows whose prompt this pass reads
        if self.role == "target":
            steps = self.machine.pass_steps([c for c in held if c] or [1])
            self.machine.spend(steps, prompt=min(prompts, default=None))
        else:
            rows = sum(c > 0 for c in held)
            steps = self.machine.draft_steps(max(rows, 1), max(held, default=1))
            self.machine.spend(steps, "drafter")
        position = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [batch, n]
        position = position[:, -logits_to_keep:].clamp(min=0)  # [batch, keep]
        nxt = self.scripts.gather(1, (position + 1).clamp(max=TEXT - 1))  # [batch, keep]
        logits = torch.nn.functional.one_hot(nxt, VOCAB).float() * 10.0  # [batch, keep, vocab]
        self.lengths = self.lengths + counts
        return logits, None

    def truncate(self, lengths: torch.Tensor) -> None:
        self.lengths = torch.minimum(self.lengths, lengths.to(self.lengths))

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.lengths = self.lengths[rows]
        self.scripts = self.scripts[rows]
        self.keys = [self.keys[b] for b in keep]

    def add_rows(self, prompts: list[list[int]], partitions=None) -> list[int]:
        keys = [World.key(p) for p in prompts]
        self.keys += keys
        self.lengths = torch.cat([self.lengths, torch.zeros(len(prompts), dtype=torch.long)])
        scripts = torch.stack([self._script(k) for k in keys]) if keys else self.scripts[:0]
        self.scripts = torch.cat([self.scripts, scripts])
        return [0] * len(prompts)

    def stop_token_ids(self) -> tuple[int, ...]:
        return ()


class SimDrafter(MixedDrafter):
    """The mixed drafter with its free drafts (lookup, corpus) taken from the world."""

    def __init__(self, world: World, machine: Machine, use_corpus: bool, *args) -> None:
        super().__init__(*args, clock=machine.clock)
        self.world, self.machine, self.use_corpus = world, machine, use_corpus

    def find(self, texts, lens, budget):
        self.machine.spend(self.machine.curve.plan_steps, "host")  # this round's search and plan
        found = []
        for b, length in enumerate(lens):
            key = World.key(texts[b, :2].tolist())
            row = self.world.row(key)
            if budget[b] < 1 or length + budget[b] >= TEXT:
                found.append((texts[b, :0], 0))
            elif bool(row["matched"][length]):
                found.append((self.world.guess(key, "lookup", length, budget[b]), 3))
            elif self.use_corpus and bool(row["corpus_seen"][length]):
                guess = self.world.guess(key, "corpus", length, budget[b])
                found.append((guess, corpus_key(self.lookup, 0)))
            else:
                found.append((texts[b, :0], 0))
        return found


# ---- runs ----


@dataclass
class Result:
    """Tokens and virtual seconds of a run's rounds after its warm-up, and its judge."""

    tokens: int = 0
    seconds: float = 0.0
    drafted_rounds: int = 0
    rounds: int = 0
    outcomes: Outcomes | None = None
    per_round: list[tuple[int, float, bool]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def run(
    curve: Curve,
    text: Text,
    method: str | int = "auto",
    *,
    rows: int = 1,
    rounds: int = 1200,
    warmup: int = 200,
    weather: Weather = Weather(),
    seed: int = 0,
    judge: bool = True,
    with_model: bool = True,
    corpus: bool = True,
    new_tokens: int = 256,
    most_drafted: int = 8,
    after_shift: Curve | None = None,
    shift_round: int | None = None,
    after_text: Text | None = None,
    prices: Prices | None = None,
) -> Result:
    """Run `rows` rows for `rounds` rounds and measure those after `warmup` (a row asks for
    0.5-1.5 x `new_tokens`, then the next row takes its place): `method` "auto"
    (the priced plan, judged by `Outcomes` where `judge`, else by its prices alone), "plain",
    or an int k (every row drafts k tokens from its lookup match or corpus guess, else from
    the drafter model). From round `shift_round` on the machine has shifted (`Weather.shift`,
    and `after_shift`'s curve where given), and rows that join are of `after_text` where
    given (a server whose users turn from code to chat). `prices`: the plan's prices
    (default: timed on the machine)."""
    machine = Machine(curve, weather, seed, after_shift)
    world = World(text, seed)
    target = SimModel(machine, world, "target")
    drafter_lm = SimModel(machine, world, "drafter") if with_model else None
    cfg = DecodeConfig(max_new_tokens=new_tokens, num_draft_tokens=most_drafted)
    outcomes = Outcomes() if judge and method == "auto" else None
    drafter = None
    if method != "plain":
        if method == "auto":
            if prices is None:
                prices = measure_prices(
                    target, drafter_lm, VOCAB, None, rows=rows, clock=machine.clock
                )
            model = drafter_lm if drafter_lm and model_can_pay(prices, most_drafted, rows) else None
            lookup = LOOKUP_FIRST if model is not None else LOOKUP_ALONE
            planner = PricedPlanner(
                lookup.max_ngram, model is not None, prices, most_drafted, lookup.min_ngram,
                corpus_priors=BAND_PRIORS if corpus else (), outcomes=outcomes,
            )  # fmt: skip
        else:
            model = drafter_lm
            lookup = LOOKUP_FIRST if model is not None else LOOKUP_ALONE
            planner = FixedPlanner(ConstantLength(int(method)))
        policy = ConstantLength(most_drafted if method == "auto" else int(method))
        made = ModelDrafter(model, cfg.sampling, VOCAB, policy) if model is not None else None
        drafter = SimDrafter(world, machine, corpus, lookup, made, planner, VOCAB)

    result = Result(outcomes=outcomes)

    def observe(fed: list[int], committed: int, seconds: float) -> None:
        if outcomes is not None:
            outcomes.observe(fed, committed, seconds)

    loop = DecodeLoop(
        target, drafter, cfg, sampling=RowSampling(), max_rows=rows, capacity=TEXT,
        joins=True, observe=observe, clock=machine.clock,
    )  # fmt: skip
    next_key = seed * 100_000
    for done in range(rounds):
        while loop.running + len(loop.waiting) < rows:
            # answers of different lengths: rows end and join at their own rounds
            budget = new_tokens // 2 + world.row(next_key)["script"][1].item() * new_tokens // VOCAB
            loop.add(RowRequest(world.prompt(next_key), budget))
            next_key += 1
        machine.shifted = shift_round is not None and done >= shift_round
        if machine.shifted and after_text is not None:
            world.text = after_text  # rows drawn from now on
        machine.at_round(done)
        start = machine.now
        updates = loop.step()
        if done >= warmup:
            tokens = sum(len(u.tokens) for u in updates)
            drafted = any(u.drafted for u in updates)
            result.tokens += tokens
            result.seconds += machine.now - start
            result.rounds += 1
            result.drafted_rounds += drafted
            result.per_round.append((tokens, machine.now - start, drafted))
    return result
