"""The measurement: warm-up, methods interleaved batch by batch, outputs checked as we go.

Fairness rules (see the project's performance notes): every method runs in this one process on
the same model objects; a warm-up run of each method comes first; within each batch of prompts
the methods run back to back, in an order rotated from batch to batch, so slow drifts of a shared
machine fall on all of them; speedups are per-batch ratios against `ar` (tokens/s), summarised by
median and geometric mean with their spread. Under greedy decoding every method must reproduce
`ar` token for token; a mismatch is reported and fails the run.
"""

from __future__ import annotations

import os
import platform
import resource
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm.auto import tqdm

from specdecode.backends.kernels import cpu_fp32, model_bytes
from specdecode.backends.timing import step_seconds
from specdecode.bench.methods import BATCH1_ONLY, Method, Models, Result, Settings, run_method
from specdecode.bench.metrics import (
    alpha_from_tokens_per_call,
    leviathan_speedup,
    modelled_speedup,
    summarize,
)
from specdecode.config import RoundPrices
from specdecode.stats import CostFigures, RowStats


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str
    prompts: str
    limit: int | None = 20
    skip: int = 0  # prompts dropped from the set's start before `limit` is taken
    methods: tuple[str, ...] = ("ar", "hf", "hf-assisted", "sd", "sd-int8")
    num_draft_tokens: tuple[int, ...] = (4,)
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False
    prepack: bool = True
    threads: int | None = None
    policies: tuple[str, ...] = ("constant",)
    stop_thresholds: tuple[float, ...] = (0.7,)  # the head policy's sweep
    confidence_thresholds: tuple[float, ...] = (0.4,)
    bounds: tuple[tuple[int, int], ...] = ((1, 8),)  # adaptive policies' (MIN, MAX), a sweep
    head: str | None = None
    coupled: bool = False  # sampling: every policy of a drafter commits the same text
    priced: bool = False  # head policies run twice: flat, and priced by the calibration
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.coupled and self.temperature == 0:
            raise ValueError(
                "--coupled pairs sampled text; greedy methods commit the same text already"
            )
        if not cpu_fp32(self.device, getattr(torch, self.dtype)):
            cpu_only = [m for m in self.methods if m.startswith("sd-int8") or "+dense" in m]
            if cpu_only:
                raise ValueError(
                    f"methods {cpu_only} run CPU kernels (an int8 drafter, default vs packed fp32 "
                    f"kernels); on {self.device} in {self.dtype} use sd, ar, hf, hf-assisted"
                )
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if any(k < 1 for k in self.num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if "ar" not in self.methods:
            raise ValueError("the methods must include 'ar', the baseline of every ratio")
        from specdecode.length_policies import POLICIES

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


@dataclass
class MethodRecord:
    label: str
    batch_size: int
    seconds: list[float] = field(default_factory=list)  # per batch of prompts
    tokens: list[int] = field(default_factory=list)
    stats: RowStats = field(default_factory=RowStats)
    policy_seconds: float = 0.0
    drafter_forwards: int = 0
    target_forwards: int = 0
    # the passes' costs after each batch's first round (its prefills): the in-run costs
    decode_costs: CostFigures = field(default_factory=CostFigures)
    mismatches: list[int] = field(default_factory=list)  # prompt indices differing from ar
    # coupled runs: prompt indices whose text differs from the first method of the same drafter
    unpaired: list[int] = field(default_factory=list)
    coupling_seconds: float = 0.0  # coupled runs: the extra drafter passes, not in `seconds`
    # per batch: the first round (both prefills) of the engine's methods; None for the others
    first_round_seconds: list[float | None] = field(default_factory=list)
    first_round_tokens: list[int | None] = field(default_factory=list)


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


def calibrate(
    models: Models, methods: list[Method], context: list[int], longest_round: int = 0
) -> dict:
    """Drafter/target step-cost ratio c, and the cost of a verify pass in target steps.

    `longest_round` adds every round length up to it (adaptive policies draft 1..MAX tokens).
    """
    ks = sorted({m.k for m in methods if m.k is not None} | set(range(1, longest_round + 1)))
    seconds = step_seconds(models.target, context, [1] + [k + 1 for k in ks])
    step = seconds[1]
    costs = {"target_step_s": step, "verify_cost_in_steps": {}, "c": {}}
    for k in ks:
        costs["verify_cost_in_steps"][k] = seconds[k + 1] / step
    for kind in sorted({m.kind for m in methods if m.k is not None or m.kind == "hf-assisted"}):
        drafter = models.drafter_model(kind)
        if drafter is not None:
            costs["c"][kind] = step_seconds(drafter, context, [1])[1] / step
    return costs


def round_prices(costs: dict, longest_round: int) -> dict[str, RoundPrices]:
    """The calibration as each drafter kind's round prices (rounds of 1..longest_round)."""
    if longest_round < 1:
        return {}
    verify = tuple(costs["verify_cost_in_steps"][k] for k in range(1, longest_round + 1))
    return {kind: RoundPrices(c, verify) for kind, c in costs["c"].items()}


def run_bench(cfg: BenchConfig, models: Models, prompt_ids: list[list[int]], progress=True):
    methods = cfg.method_list()
    settings = Settings(
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        cfg.seed,
        models.decoder("ar").default_stop_ids(),
        cfg.coupled,
    )
    longest = max((m.bound[1] for m in methods if m.bound is not None), default=0)
    costs = calibrate(models, methods, prompt_ids[0], longest)
    models.round_prices = round_prices(costs, longest)
    warm = replace(settings, max_new_tokens=8)
    for method in methods:  # warm-up: first calls pay for allocation and lazy set-up
        run_method(method, models, prompt_ids[:1], warm)
    records: dict[tuple[str, int], MethodRecord] = {}
    skipped: list[str] = []
    total = sum(len(range(0, len(prompt_ids), b)) * len(methods) for b in cfg.batch_sizes)
    bar = tqdm(total=total, desc="bench", disable=not progress)
    for batch_size in cfg.batch_sizes:
        runnable = [m for m in methods if batch_size == 1 or m.kind not in BATCH1_ONLY]
        skipped += [
            f"{m.label} at batch {batch_size} (batch size 1 only)"
            for m in methods
            if m not in runnable
        ]
        for i, start in enumerate(range(0, len(prompt_ids), batch_size)):
            batch = prompt_ids[start : start + batch_size]
            order = runnable[i % len(runnable) :] + runnable[: i % len(runnable)]
            results: dict[Method, Result] = {}
            for method in order:
                bar.set_postfix_str(f"batch {batch_size} #{i} {method.label}")
                results[method] = run_method(method, models, batch, settings)
                bar.update()
            reference = results[Method("ar")].new_tokens
            paired_with: dict[str, list[list[int]]] = {}  # drafter kind -> its first text
            for method, result in results.items():
                rec = records.setdefault(
                    (method.label, batch_size), MethodRecord(method.label, batch_size)
                )
                rec.seconds.append(result.seconds)
                rec.tokens.append(sum(map(len, result.new_tokens)))
                stats = result.stats
                rec.first_round_seconds.append(None if stats is None else stats.first_round_seconds)
                rec.first_round_tokens.append(None if stats is None else stats.first_round_tokens)
                if stats is not None:
                    rec.stats = rec.stats.merge(result.stats.total)
                    rec.policy_seconds += stats.policy_seconds
                    rec.drafter_forwards += stats.drafter_forwards
                    rec.target_forwards += stats.target_forwards
                    rec.coupling_seconds += stats.coupling_seconds
                    rec.decode_costs = rec.decode_costs + stats.costs_after_first_round()
                if cfg.coupled and method.kind != "ar":
                    first = paired_with.setdefault(method.kind, result.new_tokens)
                    rec.unpaired += differing(result.new_tokens, first, start)
                if cfg.temperature == 0:
                    for index in differing(result.new_tokens, reference, start):
                        rec.mismatches.append(index)
                        tqdm.write(f"MISMATCH: {method.label} differs from ar on prompt {index}")
    bar.close()
    memory = {}
    for kind in {m.kind for m in methods}:
        drafter = models.drafter_model(kind)
        size = model_bytes(models.target) + (model_bytes(drafter) if drafter is not None else 0)
        memory[kind] = size / 2**30
    return summarise_run(cfg, methods, records, costs, skipped, memory)


def differing(got: list[list[int]], want: list[list[int]], start: int) -> list[int]:
    """Indices (in the prompt set; the batch starts at `start`) of prompts whose texts differ."""
    return [start + j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]


def draft_figures(method: Method, rec: MethodRecord, costs: dict, batch_size: int) -> dict:
    """Round figures of a drafting method; Leviathan's bound only for a constant k."""
    stats, tokens = rec.stats, max(sum(rec.tokens), 1)
    row = dict(
        policy=method.policy,
        threshold=method.threshold,
        k=None if method.adaptive else method.k,
        tokens_per_target_call=stats.tokens_per_target_call,
        acceptance_rate=stats.acceptance_rate,
        drafted_per_round=stats.drafted / stats.target_calls,
        drafter_forwards_per_token=rec.drafter_forwards / tokens,
        target_forwards_per_token=rec.target_forwards / tokens,
        accepted_hist=stats.accepted_hist,
        c=costs["c"].get(method.kind),
        policy_seconds=rec.policy_seconds,
        policy_ms_per_drafted_token=1000 * rec.policy_seconds / max(stats.drafted, 1),
        policy_share_of_time=rec.policy_seconds / sum(rec.seconds),
    )
    add_modelled(row, costs, batch_size)
    if method.adaptive:
        return row
    tau = stats.tokens_per_target_call
    alpha = alpha_from_tokens_per_call(min(max(tau, 1.0), method.k + 1), method.k)
    row.update(alpha=alpha, verify_cost_in_steps=costs["verify_cost_in_steps"].get(method.k))
    return row


def add_modelled(row: dict, costs: dict, batch_size: int) -> None:
    """The modelled speedup of a drafting method's row (see `metrics.modelled_speedup`).

    Batch 1 only: the costs are calibrated on one row, and a batched row's calls per token
    count tokens of every row, so the model would price a batch of 8 at one row's cost (records
    before this check showed 'modelled' speedups of 7 to 13 at batch 4 and 8)."""
    row.pop("modelled_speedup", None)
    if batch_size != 1:
        return
    verify_costs = {int(k): v for k, v in costs["verify_cost_in_steps"].items()}
    if row.get("c") is None or len(verify_costs) < 2 or "target_forwards_per_token" not in row:
        return
    # a policy runs once per drafted position, that is once per drafter pass
    policy_steps = (row.get("policy_ms_per_drafted_token") or 0.0) / 1000 / costs["target_step_s"]
    row["modelled_speedup"] = modelled_speedup(
        row["target_forwards_per_token"],
        row["drafter_forwards_per_token"],
        row["drafted_per_round"],
        verify_costs,
        row["c"],
        policy_steps,
    )


def rederive(record: dict) -> dict:
    """Recompute a saved record's derived figures (modelled speedups, policy comparison) from
    its measurements, so a record written before a figure existed can be reported with it."""
    from specdecode.bench.report import policy_comparison

    for row in record["methods"]:
        add_modelled(row, record["costs"], row.get("batch_size", 1))
    record["policy_comparison"] = policy_comparison(record)
    return record


def add_bounds(row: dict, method: Method) -> None:
    """Measured speedup beside Leviathan's bound from measured alpha and c (constant k only)."""
    if "alpha" not in row:
        return
    for suffix, c in (("", row.get("c")), ("_in_run", row.get("c_in_run"))):
        if c is not None:
            bound = leviathan_speedup(row["alpha"], method.k, c)
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


def summarise_run(cfg, methods, records, costs, skipped, memory) -> dict:
    by_label = {m.label: m for m in methods}
    summary = []
    for (label, batch_size), rec in records.items():
        base = records[("ar", batch_size)]
        ratios = [
            (t / s) / (bt / bs)
            for t, s, bt, bs in zip(rec.tokens, rec.seconds, base.tokens, base.seconds, strict=True)
        ]
        row = {
            "method": label,
            "batch_size": batch_size,
            "tokens": sum(rec.tokens),
            "seconds": sum(rec.seconds),
            "tokens_per_s": sum(rec.tokens) / sum(rec.seconds),
            "speedup": summarize(ratios),
            "per_batch_speedup": ratios,
            "per_batch_seconds": rec.seconds,
            "mismatches": rec.mismatches,
        }
        if cfg.coupled and label != "ar":  # ar has no drafter to pair with
            row.update(unpaired=rec.unpaired, coupling_seconds=rec.coupling_seconds)
        decode = decode_ratios(rec, base)
        if decode is not None:
            row["per_batch_decode_speedup"] = decode
            defined = [r for r in decode if r is not None]
            row["decode_speedup"] = summarize(defined) if defined else None
        method = by_label[label]
        # costs as they happened in this run after the first rounds (the prefills), relative
        # to ar's own time per target call there
        ar, own = base.decode_costs, rec.decode_costs
        if ar.target_forwards:
            ar_step = ar.verify_seconds / ar.target_forwards
            if own.drafter_forwards:
                row["c_in_run"] = own.draft_seconds / own.drafter_forwards / ar_step
            if own.target_forwards:
                verify = own.verify_seconds / own.target_forwards
                row["verify_cost_in_steps_in_run"] = verify / ar_step
        if rec.stats.target_calls and method.k is not None and rec.stats.drafted:
            row.update(draft_figures(method, rec, costs, batch_size))
            add_bounds(row, method)
        row["model_gib"] = memory.get(method.kind)
        summary.append(row)
    record = {
        "config": asdict(cfg),
        "machine": machine_info(),
        "costs": costs,
        "skipped": skipped,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "methods": summary,
        "ok": not any(r["mismatches"] for r in summary),
    }
    from specdecode.bench.report import policy_comparison

    record["policy_comparison"] = policy_comparison(record)
    return record
