"""The measurement, one for every family of methods: warm-up, methods interleaved batch by batch,
outputs checked as we go; then the rows of the record. Below it, the causal bench's own set-up.

Fairness rules (see the project's performance notes): every method runs in this one process on
the same model objects; a warm-up run of each method comes first; within each batch of inputs
the methods run back to back, in an order rotated from batch to batch, so slow drifts of a shared
machine fall on all of them; speedups are per-batch ratios of speed against the reference `ar`,
summarised by median and geometric mean with their spread. An exact method (greedy and lossless)
must reproduce `ar` token for token; a text that differs is judged once the run is over (a
mismatch, or a near tie where a bench's backend scores a token differently by the shape of the
pass), the verdict is said once, in the table (`report.verdict`), and a mismatch fails the
run. With `repeats` > 1 the rotation over a batch runs that many times and each method keeps
its fastest run: on a shared machine a stall of a second can hit any one call of a short
translation, and a minimum over interleaved repeats drops it where a mean or a total would
carry it.

Causal and seq2seq runs differ only in their methods (`methods.BenchMethod`), in the unit of
speed (tokens for causal text, whose length a sampled method changes; sentences for
translations, whose time is what a user waits) and in the figures each adds to its rows
(`speed_rows`' `extras`): this engine's round counts and costs for causal runs, BLEU for
translations (`seq2seq`).
"""

from __future__ import annotations

import math
import os
import platform
import resource
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm

from specdecode.backends.kernels import cpu_fp32, model_bytes
from specdecode.backends.torch_eager import CachedModel
from specdecode.bench.config import DEFAULT_METHODS_OF, REFERENCE, PromptBenchConfig
from specdecode.bench.methods import (
    CAUSAL,
    BenchMethod,
    CausalMethod,
    Method,
    Models,
    Result,
    Settings,
    build_causal,
    drafter_kinds,
)
from specdecode.bench.metrics import (
    alpha_from_tokens_per_call,
    leviathan_speedup,
    modelled_speedup,
    summarize,
)
from specdecode.core.config import (
    DEFAULT_BOUND,
    POLICIES,
    POLICY_DEFAULT_THRESHOLDS,
)
from specdecode.core.prices import Prices
from specdecode.core.stats import CostFigures, DecodeStats, RowStats
from specdecode.pricebook import pass_seconds


@dataclass
class MethodRecord:
    """One method at one batch size, batch after batch."""

    label: str
    batch_size: int
    seconds: list[float] = field(default_factory=list)  # per batch of inputs
    tokens: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)  # per batch: its number of inputs
    outputs: list[list[int]] = field(default_factory=list)  # per input, in the inputs' order
    stats: DecodeStats | None = None  # this engine's counts, summed over the batches
    # an exact method: input indices whose text differs from ar's (a bench judges them: a
    # mismatch, or a near tie its backend's noise explains; `report.verdict` says which)
    differing: list[int] = field(default_factory=list)
    # coupled runs: input indices whose text differs from the first method of the same pairing
    unpaired: list[int] = field(default_factory=list)
    # per batch: the first round (both prefills) of the engine's methods; None for the others
    first_round_seconds: list[float | None] = field(default_factory=list)
    first_round_tokens: list[int | None] = field(default_factory=list)

    def add(self, result: Result) -> None:
        self.seconds.append(result.seconds)
        self.tokens.append(sum(map(len, result.token_ids)))
        self.inputs.append(len(result.token_ids))
        self.outputs += result.token_ids
        stats = result.stats
        self.first_round_seconds.append(None if stats is None else stats.first_round_seconds)
        self.first_round_tokens.append(None if stats is None else stats.first_round_tokens)
        if stats is not None:
            if self.stats is None:
                self.stats = DecodeStats([RowStats()])
            self.stats.absorb(stats, [0] * len(stats.rows))  # every row into one

    def work(self, unit: str) -> list[int]:
        """Per batch, what its speed counts: tokens, or inputs (sentences)."""
        return self.tokens if unit == "tokens" else self.inputs


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    import transformers

    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def measure(
    methods: Sequence[BenchMethod],
    inputs: Sequence[Any],
    batch_sizes: Sequence[int],
    repeats: int = 1,
    progress: bool = True,
) -> tuple[dict[tuple[str, int], MethodRecord], list[str]]:
    """-> records by (label, batch size), and the methods skipped at a batch size (why)."""
    for method in methods:  # warm-up: first calls pay for allocation and lazy set-up
        method.prepare(inputs[:1])
    plan = [(b, [m for m in methods if m.skips(b) is None]) for b in batch_sizes]
    skipped = [f"{m.label} at batch {b} ({m.skips(b)})" for b in batch_sizes for m in methods
               if m.skips(b) is not None]  # fmt: skip
    total = sum(len(range(0, len(inputs), b)) * len(runnable) * repeats for b, runnable in plan)
    bar = tqdm(total=total, desc="bench", disable=not progress)
    records: dict[tuple[str, int], MethodRecord] = {}
    for batch_size, runnable in plan:
        reference = next(m for m in runnable if m.label == REFERENCE)
        for i, start in enumerate(range(0, len(inputs), batch_size)):
            batch = inputs[start : start + batch_size]
            order = runnable[i % len(runnable) :] + runnable[: i % len(runnable)]
            kept: dict[BenchMethod, Result] = {}  # each method's fastest run of this batch
            for _ in range(repeats):
                for method in order:
                    bar.set_postfix_str(f"batch {batch_size} #{i} {method.label}")
                    result = method.run(batch)
                    bar.update()
                    first = kept.get(method)
                    if first is not None and result.token_ids != first.token_ids:
                        raise RuntimeError(f"{method.label} changed its output on a repeat")
                    if first is None or result.seconds < first.seconds:
                        kept[method] = result
            want = kept[reference].token_ids
            paired_with: dict[str, list[list[int]]] = {}  # pairing -> its first text
            for method, result in kept.items():
                key = (method.label, batch_size)
                rec = records.setdefault(key, MethodRecord(*key))
                rec.add(result)
                if method.pairing is not None:
                    first_text = paired_with.setdefault(method.pairing, result.token_ids)
                    rec.unpaired += differing(result.token_ids, first_text, start)
                if method.exact:  # judged once the run is over, said once, in the table
                    rec.differing += differing(result.token_ids, want, start)
    bar.close()
    return records, skipped


# ---- the bench across processes ----
# The bench across processes: `accelerate launch` shares the inputs out, the main process merges.
#
# Why by chunks of whole batches: a batch's time is the figure the runner records, so a process
# must run the same batches a single process would. The inputs are cut into chunks of
# lcm(batch sizes) inputs (so no batch of any size straddles two chunks), chunk c goes to process
# c mod N, each process measures its chunks with the one runner (`runner.measure`), and the main
# process merges the records back into input order: the same batches, outputs and differences as
# one process would record, each batch timed on the process that ran it. With several GPUs that
# divides a run's wall time by N; on one CPU it only has to give the same record.

Records = dict[tuple[str, int], MethodRecord]


def chunks_of(count: int, batch_sizes: Sequence[int], process: int, processes: int) -> list[int]:
    """The input indices process `process` of `processes` measures, in input order."""
    size = math.lcm(*batch_sizes)
    starts = range(process * size, count, processes * size)
    return [i for start in starts for i in range(start, min(start + size, count))]


def merge(parts: Sequence[tuple[list[int], Records]], batch_sizes: Sequence[int]) -> Records:
    """One record per (method, batch size) from each process's (input indices, records): its
    batches, outputs and differences put back in input order."""
    merged: Records = {}
    keys = dict.fromkeys(key for _, records in parts for key in records)
    for key in keys:
        label, batch_size = key
        batches: list[tuple[int, int, MethodRecord, int]] = []  # (global start, part, rec, j)
        outputs: dict[int, list[int]] = {}
        out = MethodRecord(label, batch_size)
        for p, (mine, records) in enumerate(parts):
            rec = records.get(key)
            if rec is None:
                continue
            local = 0
            for j, n in enumerate(rec.inputs):
                batches.append((mine[local], p, rec, j))
                local += n
            outputs.update({mine[i]: o for i, o in enumerate(rec.outputs)})
            out.differing += [mine[i] for i in rec.differing]
            out.unpaired += [mine[i] for i in rec.unpaired]
            if rec.stats is not None:
                if out.stats is None:
                    out.stats = DecodeStats([RowStats()])
                out.stats.absorb(rec.stats, [0] * len(rec.stats.rows))
        for _, _, rec, j in sorted(batches, key=lambda b: b[0]):
            out.seconds.append(rec.seconds[j])
            out.tokens.append(rec.tokens[j])
            out.inputs.append(rec.inputs[j])
            out.first_round_seconds.append(rec.first_round_seconds[j])
            out.first_round_tokens.append(rec.first_round_tokens[j])
        out.outputs = [outputs[i] for i in sorted(outputs)]
        out.differing.sort()
        out.unpaired.sort()
        merged[key] = out
    return merged


def launched_processes() -> int:
    """How many processes `accelerate launch` (torchrun) started; 1 outside a launch."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def measure_shared(
    methods: Sequence[BenchMethod],
    inputs: Sequence[Any],
    batch_sizes: Sequence[int],
    repeats: int = 1,
    progress: bool = True,
) -> tuple[Records, list[str], bool]:
    """`runner.measure`, shared across the launched processes -> (records, skipped, is_main):
    the merged records on the main process, each process's own on the others."""
    if launched_processes() == 1:
        return (*measure(methods, inputs, batch_sizes, repeats, progress), True)
    from specdecode.training.distributed import gather_objects, process_state

    state = process_state()
    mine = chunks_of(len(inputs), batch_sizes, state.process_index, state.num_processes)
    if not mine:
        raise ValueError(
            f"{len(inputs)} inputs leave process {state.process_index} of "
            f"{state.num_processes} nothing to measure (chunks of {math.lcm(*batch_sizes)}); "
            "launch fewer processes or give more prompts"
        )
    records, skipped = measure(
        methods, [inputs[i] for i in mine], batch_sizes, repeats, progress and state.is_main_process
    )
    parts = gather_objects(state, (mine, records))
    return merge(parts, batch_sizes), skipped, state.is_main_process


def differing(got: list[list[int]], want: list[list[int]], start: int) -> list[int]:
    """Indices (in the input set; the batch starts at `start`) of inputs whose texts differ."""
    return [start + j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]


def speed_ratios(rec: MethodRecord, base: MethodRecord, unit: str) -> list[float]:
    """Per batch: the method's speed (`unit`s a second) over `base`'s on the same batch."""
    pairs = zip(rec.work(unit), rec.seconds, base.work(unit), base.seconds, strict=True)
    return [(w / s) / (bw / bs) for w, s, bw, bs in pairs]


Extras = Callable[[dict, Any, MethodRecord, MethodRecord], None]


def speed_rows(
    methods: Sequence[BenchMethod],
    records: dict[tuple[str, int], MethodRecord],
    unit: str = "tokens",
    extras: Extras | None = None,
    also_against: tuple[str, ...] = ("hf",),
) -> list[dict]:
    """A record's rows: speed against `ar` (and `also_against`, where it ran at that batch
    size), agreement with `ar`'s text, then what `extras(row, method, rec, base)` adds."""
    by_label = {m.label: m for m in methods}
    rows = []
    for (label, batch_size), rec in records.items():
        method, base = by_label[label], records[(REFERENCE, batch_size)]
        ratios = speed_ratios(rec, base, unit)
        row = {
            "method": label,
            "batch_size": batch_size,
            "exact": method.exact,
            "tokens": sum(rec.tokens),
            "seconds": sum(rec.seconds),
            "tokens_per_s": sum(rec.tokens) / sum(rec.seconds),
        }
        if unit != "tokens":
            row[unit] = sum(rec.work(unit))
            row[f"{unit}_per_s"] = row[unit] / sum(rec.seconds)
        row.update(speedup=summarize(ratios), per_batch_speedup=ratios)
        row["per_batch_seconds"] = rec.seconds
        for other in also_against:
            against = records.get((other, batch_size))
            ratio = speed_ratios(rec, against, unit) if against is not None else None
            row[f"speedup_vs_{other}"] = summarize(ratio) if ratio else None
        same = [a == b for a, b in zip(rec.outputs, base.outputs, strict=True)]
        row["identical_to_ar"] = sum(same) / len(same)
        # every difference is a mismatch unless the bench's extras judge it a near tie
        row["differing"], row["mismatches"] = rec.differing, list(rec.differing)
        if method.pairing is not None:
            coupling = rec.stats.coupling_seconds if rec.stats is not None else 0.0
            row.update(unpaired=rec.unpaired, coupling_seconds=coupling)
        if extras is not None:
            extras(row, method, rec, base)
        rows.append(row)
    return rows


def bench_record(config: Any, rows: list[dict], skipped: list[str], **extras: Any) -> dict:
    """The record every run writes; `extras` (costs, model sizes, examples) go beside it."""
    return {
        "config": asdict(config),
        "machine": machine_info(),
        **extras,
        "skipped": skipped,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "methods": rows,
        "ok": not any(r["mismatches"] for r in rows),
    }


# ---- the causal bench: its configuration, calibration and figures ----


@dataclass(frozen=True, kw_only=True)
class TorchBenchConfig(PromptBenchConfig):
    """The causal bench on PyTorch: the shared settings, and its kernels, length policies and
    device."""

    DEFAULT_METHODS: ClassVar[tuple[str, ...]] = DEFAULT_METHODS_OF["torch"]

    prepack: bool = True  # oneDNN-packed kernels, where they apply (the CPU in fp32)
    policies: tuple[str, ...] = ("constant",)
    stop_thresholds: tuple[float, ...] = (POLICY_DEFAULT_THRESHOLDS["head"],)  # a sweep
    confidence_thresholds: tuple[float, ...] = (POLICY_DEFAULT_THRESHOLDS["confidence"],)
    bounds: tuple[tuple[int, int], ...] = (DEFAULT_BOUND,)  # adaptive policies' (MIN, MAX)
    head: str | None = None
    coupled: bool = False  # sampling: every policy of a drafter commits the same text
    priced: bool = False  # head policies run twice: flat, and priced by the calibration
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        fits = cpu_fp32(self.device, getattr(torch, self.dtype))
        if not fits:  # the CPU kernels do not apply: no packing, default methods without them
            object.__setattr__(self, "prepack", False)
            if not self.methods:
                defaults = tuple(m for m in self.DEFAULT_METHODS if not _cpu_kernels(m))
                object.__setattr__(self, "methods", defaults)
        super().__post_init__()
        if self.coupled and self.temperature == 0:
            raise ValueError(
                "--coupled pairs sampled text; greedy methods commit the same text already"
            )
        if not fits:
            cpu_only = [m for m in self.methods if _cpu_kernels(m)]
            if cpu_only:
                raise ValueError(
                    f"methods {cpu_only} run CPU kernels (an int8 drafter, default vs packed fp32 "
                    f"kernels); on {self.device} in {self.dtype} use sd, ar, hf, hf-assisted"
                )
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"unknown length policies {unknown}; known: {', '.join(POLICIES)}")
        for t in (*self.stop_thresholds, *self.confidence_thresholds):
            if not 0.0 < t < 1.0:
                raise ValueError(f"thresholds must be in (0, 1), got {t}")
        if not self.bounds:
            raise ValueError("bounds must hold at least one (MIN, MAX) pair")
        for low, high in self.bounds:
            if not 1 <= low <= high:
                raise ValueError(f"bound must be MIN MAX with 1 <= MIN <= MAX, got {low} {high}")
        self.method_list()  # validates names

    def method_list(self) -> list[Method]:
        thresholds = {
            "head": list(self.stop_thresholds),
            "head-u": list(self.stop_thresholds),
            "confidence": list(self.confidence_thresholds),
        }
        return Method.expand(
            list(self.methods),
            list(self.num_draft_tokens),
            list(self.policies),
            thresholds,
            [tuple(b) for b in self.bounds],
            self.priced,
        )


def _cpu_kernels(name: str) -> bool:
    """`+dense` compares CPU kernels, and int8 drafters have only CPU ones."""
    kind = name.removesuffix("+dense")
    return name != kind or (kind in CAUSAL and CAUSAL[kind].cpu_kernels)


def calibrate(
    models: Models, methods: Sequence[CausalMethod], context: list[int], longest_round: int = 0
) -> dict:
    """Drafter/target step-cost ratio c, and the cost of a verify pass in target steps.

    `longest_round` adds every round length up to it (adaptive policies draft 1..MAX tokens).
    """
    ks = {m.spec.k for m in methods if m.spec.k is not None} | set(range(1, longest_round + 1))
    drafters = sorted(drafter_kinds(methods).items())
    # every pass through a cache of its own (`pricebook.pass_seconds`), target and drafters
    # interleaved; the methods' decoders keep theirs
    jobs = [(CachedModel(models.target, "target"), [1] + [k + 1 for k in sorted(ks)])]
    jobs += [(CachedModel(drafter, "drafter"), [1]) for _, drafter in drafters]
    seconds = pass_seconds(jobs, context, reps=7)
    step = seconds[0][1]
    costs = {"target_step_s": step, "verify_cost_in_steps": {}, "c": {}}
    for k in sorted(ks):
        costs["verify_cost_in_steps"][k] = seconds[0][k + 1] / step
    for (kind, _), drafted in zip(drafters, seconds[1:], strict=True):
        costs["c"][kind] = drafted[1] / step
    return costs


def round_prices(costs: dict, longest_round: int) -> dict[str, Prices]:
    """The calibration as each drafter kind's one-row prices (rounds of 1..longest_round)."""
    if longest_round < 1:
        return {}
    verify = tuple(costs["verify_cost_in_steps"][k] for k in range(1, longest_round + 1))
    step = costs["target_step_s"]
    return {kind: Prices((1,), ((1.0, *verify),), (c,), step) for kind, c in costs["c"].items()}


def run_bench(
    cfg: TorchBenchConfig, models: Models, prompt_ids: list[list[int]], progress: bool = True
) -> dict | None:
    settings = Settings(
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        cfg.seed,
        models.decoder(REFERENCE).default_stop_ids(),
        cfg.coupled,
    )
    methods = build_causal(cfg.method_list(), models, settings)
    longest = max((m.spec.bound[1] for m in methods if m.spec.bound is not None), default=0)
    costs = calibrate(models, methods, prompt_ids[0], longest)
    models.prices = round_prices(costs, longest)
    records, skipped, main = measure_shared(
        methods, prompt_ids, cfg.batch_sizes, cfg.repeats, progress
    )
    if not main:
        return None  # the main process writes the run's one record
    drafters = drafter_kinds(methods)

    def extras(row: dict, method: CausalMethod, rec: MethodRecord, base: MethodRecord) -> None:
        row.update(engine_figures(method, rec, base, costs))
        add_bounds(row)
        drafter = drafters.get(method.spec.kind)
        weights = model_bytes(models.target) + (model_bytes(drafter) if drafter is not None else 0)
        row["model_gib"] = weights / 2**30

    rows = speed_rows(methods, records, "tokens", extras)
    record = bench_record(cfg, rows, skipped, costs=costs)
    from specdecode.bench.report import policy_comparison

    record["policy_comparison"] = policy_comparison(record)
    return record


def engine_figures(
    method: CausalMethod, rec: MethodRecord, base: MethodRecord, costs: dict
) -> dict:
    """What this engine's counts say of a causal row: speed after the first round, the
    passes' in-run costs, and a drafting method's round figures."""
    row: dict[str, Any] = {}
    decode = decode_ratios(rec, base)
    if decode is not None:
        row["per_batch_decode_speedup"] = decode
        defined = [r for r in decode if r is not None]
        row["decode_speedup"] = summarize(defined) if defined else None
    # costs as they happened in this run after the first rounds (the prefills), relative to
    # ar's own time per target call there
    ar = base.stats.costs_after_first_round() if base.stats is not None else CostFigures()
    own = rec.stats.costs_after_first_round() if rec.stats is not None else CostFigures()
    if ar.target_passes:
        ar_step = ar.verify_seconds / ar.target_passes
        if own.drafter_passes:
            row["c_in_run"] = own.draft_seconds / own.drafter_passes / ar_step
        if own.target_passes:
            verify = own.verify_seconds / own.target_passes
            row["verify_cost_in_steps_in_run"] = verify / ar_step
    total = rec.stats.total if rec.stats is not None else RowStats()
    if total.target_calls and method.spec.k is not None and total.drafted:
        row.update(draft_figures(method.spec, rec, costs, rec.batch_size))
    return row


def draft_figures(method: Method, rec: MethodRecord, costs: dict, batch_size: int) -> dict:
    """Round figures of a drafting method; Leviathan's bound only for a constant k."""
    stats, total, tokens = rec.stats, rec.stats.total, max(sum(rec.tokens), 1)
    row = dict(
        policy=method.policy,
        threshold=method.threshold,
        k=None if method.adaptive else method.k,
        tokens_per_target_call=total.tokens_per_target_call,
        acceptance_rate=total.acceptance_rate,
        drafted_per_round=total.drafted / total.target_calls,
        drafter_passes_per_token=stats.drafter_passes / tokens,
        target_passes_per_token=stats.target_passes / tokens,
        accepted_hist=total.accepted_hist,
        c=costs["c"].get(method.kind),
        policy_seconds=stats.policy_seconds,
        policy_ms_per_drafted_token=1000 * stats.policy_seconds / max(total.drafted, 1),
        policy_share_of_time=stats.policy_seconds / sum(rec.seconds),
    )
    add_modelled(row, costs, batch_size)
    if method.adaptive:
        return row
    tau = total.tokens_per_target_call
    alpha = alpha_from_tokens_per_call(min(max(tau, 1.0), method.k + 1), method.k)
    row.update(alpha=alpha, verify_cost_in_steps=costs["verify_cost_in_steps"].get(method.k))
    return row


def add_modelled(row: dict, costs: dict | None, batch_size: int) -> None:
    """The modelled speedup of a drafting method's row (see `metrics.modelled_speedup`).

    Batch 1 only: the costs are calibrated on one row, and a batched row's calls per token
    count tokens of every row, so the model would price a batch of 8 at one row's cost (records
    before this check showed 'modelled' speedups of 7 to 13 at batch 4 and 8). No costs (a run
    that calibrated nothing, such as a translation run): nothing to model."""
    row.pop("modelled_speedup", None)
    if batch_size != 1 or costs is None:
        return
    verify_costs = {int(k): v for k, v in costs["verify_cost_in_steps"].items()}
    if row.get("c") is None or len(verify_costs) < 2 or "target_passes_per_token" not in row:
        return
    # a policy runs once per drafted position, that is once per drafter pass
    policy_steps = (row.get("policy_ms_per_drafted_token") or 0.0) / 1000 / costs["target_step_s"]
    row["modelled_speedup"] = modelled_speedup(
        row["target_passes_per_token"],
        row["drafter_passes_per_token"],
        row["drafted_per_round"],
        verify_costs,
        row["c"],
        policy_steps,
    )


def rederive(record: dict) -> dict:
    """Recompute a saved record's derived figures (modelled speedups, Leviathan's bounds, the
    policy comparison) from its measurements, so a record written before a figure existed can
    be reported with it."""
    from specdecode.bench.report import policy_comparison

    for row in record["methods"]:
        add_modelled(row, record.get("costs"), row.get("batch_size", 1))
        add_bounds(row)
    record["policy_comparison"] = policy_comparison(record)
    return record


def add_bounds(row: dict) -> None:
    """Measured speedup beside Leviathan's bound from measured alpha and c (constant k only)."""
    if "alpha" not in row or row.get("k") is None:  # records before `k` keep their bounds
        return
    for suffix, c in (("", row.get("c")), ("_in_run", row.get("c_in_run"))):
        if c is not None:
            bound = leviathan_speedup(row["alpha"], row["k"], c)
            row[f"leviathan_bound{suffix}"] = bound
            row[f"efficiency{suffix}"] = row["speedup"]["geomean"] / bound


def decode_ratios(rec: MethodRecord, base: MethodRecord) -> list[float | None] | None:
    """Per batch: speed after the first round against `ar`'s after its first round.

    Why: the first round holds the prefill of the prompt, the same work for every method (the
    drafter's prefill is drafting's own cost and stays in it), and over a short generation it is
    a large share of the time: a third of a speculative run of 64 tokens of the default pair on
    a CPU. A length policy acts only after it, so its gain shows undiluted here; the end-to-end
    ratio stays the headline. None for a batch that ended within its first round, and for
    methods run outside the engine (`transformers`' own loops).
    """
    if not rec.first_round_seconds or rec.first_round_seconds[0] is None:
        return None
    if not base.first_round_seconds or base.first_round_seconds[0] is None:
        return None
    out: list[float | None] = []
    columns = (rec.tokens, rec.seconds, rec.first_round_tokens, rec.first_round_seconds)
    base_columns = (base.tokens, base.seconds, base.first_round_tokens, base.first_round_seconds)
    for (t, s, ft, fs), (bt, bs, bft, bfs) in zip(
        zip(*columns, strict=True), zip(*base_columns, strict=True), strict=True
    ):
        if t - ft <= 0 or s - fs <= 0 or bt - bft <= 0 or bs - bfs <= 0:
            out.append(None)
        else:
            out.append(((t - ft) / (s - fs)) / ((bt - bft) / (bs - bfs)))
    return out
