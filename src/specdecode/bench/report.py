"""What a benchmark leaves behind: a JSON record, a Markdown table, and plots, for any run.

Causal and translation runs write one record layout (`runner.bench_record`); their rows differ
only in the figures their methods add (round counts and costs, BLEU). The table shows the
columns some row has figures for, so one table serves both, and records made before a figure
existed still read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def policy_comparison(record: dict) -> list[dict]:
    """Each adaptive policy against the best constant k of the same drafter and batch size.

    The ratio is the geometric mean over prompt batches of (policy speed / best constant speed),
    both measured on the same batch in the same interleaved round, so drift cancels, with a 95%
    bootstrap interval over the batches (`metrics.bootstrap_interval`). Beside it,
    the same comparison on modelled speedups (counted calls x calibrated costs; see
    `metrics.modelled_speedup`), against the constant k that is best by that model.
    """
    rows = [r for r in record["methods"] if r.get("policy")]
    out = []
    for r in rows:
        if r["policy"] == "constant":
            continue
        family = r["method"].split("[")[0]
        constants = [
            c
            for c in rows
            if c["policy"] == "constant"
            and c["method"].split("[")[0] == family
            and c["batch_size"] == r["batch_size"]
        ]
        if not constants:
            continue
        measured = _against_best(r, constants, "speedup", "per_batch_speedup")
        modelled = [c for c in constants if c.get("modelled_speedup")]
        entry = {}
        if r.get("modelled_speedup") and modelled:
            best_modelled = max(modelled, key=lambda c: c["modelled_speedup"])
            entry = {
                "modelled_best_constant": best_modelled["method"],
                "modelled_vs_best_constant": r["modelled_speedup"]
                / best_modelled["modelled_speedup"],
            }
        decode = _against_best(r, constants, "decode_speedup", "per_batch_decode_speedup")
        entry.update({f"decode_{key}": value for key, value in decode.items()})
        out.append(
            {
                "method": r["method"],
                "batch_size": r["batch_size"],
                **measured,
                **entry,
                "policy_ms_per_drafted_token": r.get("policy_ms_per_drafted_token"),
                "policy_share_of_time": r.get("policy_share_of_time"),
            }
        )
    return out


def _against_best(row: dict, constants: list[dict], speed: str, per_batch: str) -> dict:
    """`row` against the constant k fastest by `speed`, over the batches where both have a
    per-batch ratio (`per_batch`; None where undefined, see `runner.decode_ratios`)."""
    from specdecode.bench.metrics import bootstrap_interval, geometric_mean

    measured = [c for c in constants if c.get(speed)]
    if not row.get(speed) or not measured:
        return {}
    best = max(measured, key=lambda c: c[speed]["geomean"])
    pairs = zip(row[per_batch], best[per_batch], strict=True)
    ratios = [a / b for a, b in pairs if a is not None and b is not None]
    if not ratios:
        return {}
    return {
        "best_constant": best["method"],
        "vs_best_constant": geometric_mean(ratios),
        "vs_best_constant_95ci": list(bootstrap_interval(ratios)),
        "wins": sum(x > 1 for x in ratios),
        "batches": len(ratios),
    }


def _num(row: dict, key: str, digits: int = 2) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(row: dict, noise_bound: float | None = None) -> str:
    """An exact method's agreement with ar, decided once (`mismatches`: the texts a bench did
    not forgive) and said once: in the table's column, and by the failing command's last line.

    "yes": every text equals ar's. "near tie": every text that differs first differs where the
    top-2 gap of ar's logits lies within the bound the run measured for its backend's noise
    (llama.cpp scores a token differently by the shape of the pass). "MISMATCH": some text
    differs beyond that, or where no noise is allowed (the PyTorch backend's exact methods)."""
    if row["mismatches"]:
        inputs = ", ".join(map(str, row["mismatches"]))
        return f"MISMATCH (input{'s' if len(row['mismatches']) > 1 else ''} {inputs})"
    ties = row.get("divergences") or []
    if not ties:
        return "yes"
    gaps = ", ".join(f"{d['input']}: {d['top2_gap']:.3f}" for d in ties)
    bound = "" if noise_bound is None else f" {noise_bound:.3f}"
    return f"near tie (top-2 gap at input {gaps}; within the measured noise bound{bound})"


def _agreement(row: dict, noise_bound: float | None) -> str:
    """An exact method: its verdict; a coupled one: paired with its drafter's others or not;
    any other: the share of its texts equal to ar's (`n/a` in records without it)."""
    if row["exact"]:
        return verdict(row, noise_bound)
    if "unpaired" in row:
        unpaired = row["unpaired"]
        return "paired" if not unpaired else f"NO ({len(unpaired)} prompts differ)"
    if row.get("identical_to_ar") is not None:
        return f"{100 * row['identical_to_ar']:.1f}% identical"
    return "n/a"


@dataclass(frozen=True)
class Column:
    """A column of the table, shown where some row has one of `keys` (always, without keys):
    each family of methods brings its own figures, and earlier records lack later ones."""

    title: str
    keys: tuple[str, ...]
    cell: Callable[[dict], str]


def _ratio(key: str) -> Callable[[dict], str]:
    return lambda row: "-" if not row.get(key) else f"{row[key]['geomean']:.2f}"


def _figure(key: str, digits: int = 2) -> Callable[[dict], str]:
    return lambda row: _num(row, key, digits)


def _pair_of(first: str, second: str, digits: int) -> Callable[[dict], str]:
    return lambda row: f"{_num(row, first, digits)} / {_num(row, second, digits)}"


def _first_accepted(row: dict) -> str:
    first = (row.get("accepted_at_least") or [None])[0]
    return "-" if first is None else f"{100 * first:.1f}%"


def _spread(row: dict) -> str:
    s = row["speedup"]
    return f"{s['median']:.2f} [{s['p10']:.2f}, {s['p90']:.2f}]"


def _tokens_per_call(row: dict) -> str:
    value = row.get("tokens_per_target_call", row.get("tokens_per_verifier_call"))
    return "-" if value is None else f"{value:.2f}"


COLUMNS = (
    Column("method", (), lambda r: r["method"] + (" (approx.)" if r.get("approximate") else "")),
    Column("batch", (), lambda r: str(r["batch_size"])),
    Column("tok/s", ("tokens_per_s",), _figure("tokens_per_s")),
    Column("sent/s", ("sentences_per_s",), _figure("sentences_per_s")),
    Column("speedup vs ar (geomean)", (), _ratio("speedup")),
    Column("median [p10, p90]", (), _spread),
    Column("vs hf (geomean)", ("speedup_vs_hf",), _ratio("speedup_vs_hf")),
    Column("vs hf-static (geomean)", ("speedup_vs_hf-static",), _ratio("speedup_vs_hf-static")),
    Column("vs eager-ar (geomean)", ("speedup_vs_eager-ar",), _ratio("speedup_vs_eager-ar")),
    Column(
        "acceptance set / measured",
        ("acceptance_set",),
        _pair_of("acceptance_set", "acceptance_measured", 2),
    ),
    Column("after the first round (geomean)", ("decode_speedup",), _ratio("decode_speedup")),
    Column("tokens/call", ("tokens_per_target_call", "tokens_per_verifier_call"), _tokens_per_call),
    Column("drafted/round", ("drafted_per_round",), _figure("drafted_per_round")),
    Column("first draft token accepted", ("accepted_at_least",), _first_accepted),
    Column("alpha", ("alpha",), _figure("alpha")),
    Column("c (calibrated / in run)", ("c", "c_in_run"), _pair_of("c", "c_in_run", 3)),
    Column("bound", ("leviathan_bound",), _figure("leviathan_bound")),
    Column("of bound", ("of_bound",), _figure("of_bound")),
    Column(
        "efficiency (calibrated / in run)",
        ("efficiency", "efficiency_in_run"),
        _pair_of("efficiency", "efficiency_in_run", 2),
    ),
    Column(
        "verify cost in steps (in run)",
        ("verify_cost_in_steps_in_run",),
        _figure("verify_cost_in_steps_in_run"),
    ),
    Column(
        "policy ms/drafted token",
        ("policy_ms_per_drafted_token",),
        _figure("policy_ms_per_drafted_token", 3),
    ),
    Column("modelled speedup", ("modelled_speedup",), _figure("modelled_speedup")),
    Column(
        "ms per drafter / verifier call",
        ("ms_per_drafter_call", "ms_per_verifier_call"),
        _pair_of("ms_per_drafter_call", "ms_per_verifier_call", 1),
    ),
    Column("BLEU", ("bleu",), _figure("bleu")),
    Column("BLEU 2 refs", ("bleu_two_refs",), _figure("bleu_two_refs")),
    Column("chrF", ("chrf",), _figure("chrf", 1)),
    Column("weights GiB", ("model_gib",), _figure("model_gib", 1)),
)
# exact methods: every text ar's on PyTorch float32; on llama.cpp, ar's except where a near tie
# flips with the pass's shape (`verdict`)
AGREEMENT = "output == ar (exact; llama.cpp: but near ties), paired (coupled) or share identical"


def _speed(row: dict) -> float:
    """What a row's speed counts: sentences for translations, tokens for text."""
    return row.get("sentences_per_s") or row["tokens_per_s"]


def _heading(record: dict) -> list[str]:
    cfg, machine = record["config"], record["machine"]
    where = (
        f"machine: {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}, "
        f"transformers {machine['transformers']}."
    )
    if "pair" in cfg:  # a translation pair (`bench --pair`)
        repeats = cfg.get("repeats", 1)
        fastest = f", fastest of {repeats} interleaved runs" if repeats > 1 else ""
        which = f"first {cfg['limit']}" if cfg["limit"] else "all"
        return [
            f"# specdecode bench: seq2seq pair {cfg['pair']}",
            "",
            f"Sentences: {cfg['split']} split "
            f"({which}), at most "
            f"{cfg['max_new_tokens']} new tokens, greedy{fastest}, {where}",
        ]
    if "acceptance_control" in record:  # the captured path's bench (`bench --shapes`)
        return _captured_heading(record, where)
    lines = [
        f"# specdecode bench: {cfg['target']} with {cfg['draft']} drafting",
        "",
        f"Prompts: {cfg['prompts']} ({_prompt_slice(cfg)}), {cfg['max_new_tokens']} new tokens, "
        f"temperature {cfg['temperature']}, {where}",
    ]
    if "costs" in record:
        costs = record["costs"]
        lines.append(
            f"Target step {costs['target_step_s'] * 1000:.0f} ms; verify pass of k+1 "
            "tokens in target steps: "
            + ", ".join(f"k={k}: {v:.2f}" for k, v in costs["verify_cost_in_steps"].items())
            + "; drafter cost ratio c: "
            + ", ".join(f"{k}: {v:.3f}" for k, v in costs["c"].items())
            + "."
        )
    return lines


def _captured_heading(record: dict, where: str) -> list[str]:
    cfg = record["config"]
    lines = [
        f"# specdecode bench: {cfg['target']}-shaped target with a {cfg['draft']}-shaped drafter",
        "",
        f"{cfg['prompt_tokens']}-token random prompts ({record['machine'].get('cuda') or 'CPU'}, "
        f"{cfg['dtype']}, static path {_static_path(record)}), "
        f"{cfg['max_new_tokens']} new tokens, greedy, {where}",
        "",
        f"Acceptance {record['acceptance_control']}.",
    ]
    prices = record.get("prices")
    if prices:
        verify = ", ".join(f"k={k}: {v:.2f}" for k, v in prices["verify_steps"].items())
        lines.append(
            f"Static path at batch 1: target step {prices['target_step_ms']:.2f} ms; verify pass "
            f"of k+1 tokens in steps: {verify}; drafter step {prices['drafter_step']:.3f} steps."
        )
    notes = []
    for plan in record.get("auto_plans") or []:
        notes.append(
            f"Drafting auto at batch {plan['batch_size']}, acceptance {plan['acceptance']:g}: "
            f"k = {'/'.join(map(str, plan['k']))} (expected {plan['gain']:.2f}x plain at a drafter "
            f"step of {plan['drafter_step']:.3f} and a verify pass of {plan['verify_steps']:.2f} "
            "steps at the longest k)."
        )
    startup = record.get("startup")
    if startup:
        notes.append(
            f"Start-up: pair built in {startup['build_seconds']:.1f} s, first token "
            f"{startup['first_token_seconds']:.2f} s after."
        )
        for role, times in startup["captures"].items():
            if times:
                each = ", ".join(f"{t['rows']}x{t['width']}{'h' if t['hidden'] else ''} "
                                 f"{t['seconds']:.2f}" for t in times)  # fmt: skip
                notes.append(f"Captures of the {role} (rows x width: seconds): {each}.")
        for role, failure in startup["capture_failures"].items():
            if failure:
                notes.append(f"The {role}'s passes ran uncaptured: {failure}.")
    warm = {r["method"]: r["warm_up_seconds"] for r in record["methods"]
            if r.get("warm_up_seconds") is not None}  # fmt: skip
    if warm:
        each = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in warm.items())
        notes.append(
            f"Warm-up on the first batch of every batch size (captures, compiles): {each}."
        )
    return lines + ([""] + [f"- {note}" for note in notes] if notes else [])


def _static_path(record: dict) -> str:
    if record.get("captured"):
        return "captured by hand"
    return "compiled" if record["compiled"] else "not compiled"


def _prompt_slice(cfg: dict) -> str:
    skip = cfg.get("skip", 0)  # records made before --skip have none
    return f"first {cfg['limit']}" if not skip else f"{cfg['limit']} after the first {skip}"


def _policy_table(record: dict) -> list[str]:
    comparison = policy_comparison(record)
    if not comparison:
        return []
    lines = [
        "",
        "Adaptive length policies against the best constant k (geomean of per-batch ratios):",
        "",
        "| policy | batch | best constant | speed vs best constant | 95% interval "
        "| batches won | policy ms/drafted token | policy share of time "
        "| modelled: best constant | modelled: vs best constant "
        "| after the first round: best constant | vs it [95% interval] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparison:
        ms = c["policy_ms_per_drafted_token"]
        share = c["policy_share_of_time"]
        modelled = c.get("modelled_vs_best_constant")
        low_high = c.get("vs_best_constant_95ci")  # absent from records made before it
        interval = "-" if low_high is None else f"[{low_high[0]:.3f}, {low_high[1]:.3f}]"
        decode = "-"
        if c.get("decode_vs_best_constant") is not None:
            d_low, d_high = c["decode_vs_best_constant_95ci"]
            decode = f"{c['decode_vs_best_constant']:.3f} [{d_low:.3f}, {d_high:.3f}]"
        lines.append(
            f"| {c['method']} | {c['batch_size']} | {c['best_constant']} | "
            f"{c['vs_best_constant']:.3f} | {interval} | {c['wins']}/{c['batches']} | "
            f"{'-' if ms is None else f'{ms:.3f}'} | "
            f"{'-' if share is None else f'{100 * share:.2f}%'} | "
            f"{c.get('modelled_best_constant', '-')} | "
            f"{'-' if modelled is None else f'{modelled:.3f}'} | "
            f"{c.get('decode_best_constant', '-')} | {decode} |"
        )
    return lines


def _model_notes(record: dict) -> list[str]:
    """Sizes a translation run records, and the kernels any run used."""
    lines = []
    if "verifier_mib" in record:
        assistant = record.get("assistant_mib")
        lines.append(
            f"Verifier {record['verifier_mib']:.1f} MiB, block drafter "
            f"{record['drafter_mib']:.1f} MiB"
            + (f", assistant {assistant:.1f} MiB" if assistant else "")
            + " (fp32 parameters as loaded)."
        )
    kernels = record.get("kernels") or {}
    if kernels.get("prepacked"):
        in_memory = ""
        if "verifier_mib_in_memory" in record:
            in_memory = (
                f"; with the copies, verifier {record['verifier_mib_in_memory']:.1f} MiB and "
                f"drafter {record['drafter_mib_in_memory']:.1f} MiB in memory"
            )
        lines.append(
            f"Kernels: oneDNN-packed copies for products of {kernels['packed_from_rows']}+ "
            f"rows (`+dense`: default kernels){in_memory}."
        )
    if record.get("drafter_int8_mib"):
        lines.append(
            f"The int8 drafter copy (`specdec-int8`): {record['drafter_int8_mib']:.1f} MiB."
        )
    return [""] + lines if lines else []


def markdown_table(record: dict) -> str:
    rows = sorted(record["methods"], key=lambda r: (r["batch_size"], -_speed(r)))
    columns = [
        c for c in COLUMNS if not c.keys or any(r.get(k) is not None for r in rows for k in c.keys)
    ]
    noise = record.get("noise_bound")  # the llama.cpp bench's, which forgives near ties
    columns.append(Column(AGREEMENT, (), lambda row: _agreement(row, noise)))
    lines = _heading(record) + [
        "",
        "| " + " | ".join(c.title for c in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows]
    lines += _policy_table(record)
    if record["skipped"]:
        lines += ["", "Skipped: " + "; ".join(record["skipped"]) + "."]
    lines += ["", f"Peak memory (process RSS): {record['peak_rss_gib']:.1f} GiB."]
    lines += _model_notes(record)
    hists = [r for r in record["methods"] if r.get("accepted_hist")]
    if hists:
        lines += ["", "Accepted-length histograms (target calls accepting n draft tokens):", ""]
        lines += [f"- {r['method']} (batch {r['batch_size']}): {r['accepted_hist']}" for r in hists]
    return "\n".join(lines) + "\n"


def _k_family(label: str) -> tuple[str, int] | None:
    """`sd[k=3]+dense` -> (`sd+dense`, 3), `specdec[k=4,b=5,t=3]` -> (`specdec[b=5,t=3]`, 4):
    the curve of a constant draft length a row is a point of; None for other rows."""
    found = re.search(r"\[k=(\d+),?", label)
    if found is None:
        return None
    family = label[: found.start()] + "[" + label[found.end() :]
    return family.replace("[]", ""), int(found.group(1))


def plot(record: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["methods"]
    paths = []
    families: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        point = _k_family(r["method"])
        if point is not None:
            family, k = point
            families.setdefault((family, r["batch_size"]), []).append((k, r["speedup"]["geomean"]))
    if families:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (family, batch), points in sorted(families.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-",
                    label=f"{family} (batch {batch})")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            xlabel="draft tokens k", ylabel="speedup vs ar (geomean)",
            title="Speedup against draft length",
        )  # fmt: skip
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "speedup_vs_k.png", plt))

    unit = "sentences" if any("sentences_per_s" in r for r in rows) else "tokens"
    fig, ax = plt.subplots(figsize=(7, 4))
    ordered = sorted(rows, key=lambda r: (r["batch_size"], _speed(r)))
    ax.barh([f"{r['method']} (b{r['batch_size']})" for r in ordered], [_speed(r) for r in ordered])
    ax.set(xlabel=f"{unit}/s", title="Throughput per method")
    paths.append(_save(fig, out_dir / f"{unit}_per_s.png", plt))

    scored = [r for r in rows if r.get("bleu") is not None]
    if scored:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in scored:
            speed = r["speedup"]["geomean"]
            ax.scatter(speed, r["bleu"], marker="s" if r.get("approximate") else "o")
            ax.annotate(f"{r['method']} (b{r['batch_size']})", (speed, r["bleu"]), fontsize=7)
        ax.set(xlabel="speedup vs ar", ylabel="BLEU",
               title="Quality against speed (squares: approximate)")  # fmt: skip
        ax.grid(alpha=0.3)
        paths.append(_save(fig, out_dir / "quality_vs_speed.png", plt))

    paths += plot_policies(rows, out_dir, plt)
    hists = [r for r in rows if r.get("accepted_hist")]
    if hists:
        best = max(hists, key=lambda r: r["speedup"]["geomean"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(range(len(best["accepted_hist"])), best["accepted_hist"])
        ax.set(
            xlabel="draft tokens accepted per target call",
            ylabel="target calls",
            title=f"Accepted-length histogram: {best['method']}",
        )
        paths.append(_save(fig, out_dir / "accepted_hist.png", plt))
    return paths


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _family(row: dict) -> str:
    """`sd-int8[head t=0.3]` -> `sd-int8 head`: the curve a point belongs to."""
    return f"{row['method'].split('[')[0]} {row['policy']} (b{row['batch_size']})"


def plot_policies(rows: list[dict], out_dir: Path, plt) -> list[Path]:
    """The SpecDec++ comparison: constant-k sweep beside the threshold sweeps.

    Left: speedup against k (constant) and against the threshold (head, confidence), with the
    heuristic as a line. Right: the Pareto view, tokens per target call against drafter forward
    passes per generated token, one curve per policy (up and to the left is better).
    """
    drafting = [r for r in rows if r.get("policy")]
    if not any(r["policy"] != "constant" for r in drafting):
        return []
    curves: dict[str, list[dict]] = {}
    for r in drafting:
        curves.setdefault(_family(r), []).append(r)
    fig, (ax_k, ax_t) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    fig2, ax_p = plt.subplots(figsize=(6.5, 4.5))
    for name, points in sorted(curves.items()):
        policy = points[0]["policy"]
        key = "k" if policy == "constant" else "threshold"
        points.sort(key=lambda r: r[key] if r[key] is not None else 0)
        speed = [r["speedup"]["geomean"] for r in points]
        if policy == "constant":
            ax_k.plot([r["k"] for r in points], speed, "o-", label=name)
        elif policy == "heuristic":
            for ax in (ax_k, ax_t):
                ax.axhline(speed[0], ls=":", color="grey", label=name if ax is ax_t else None)
        else:
            ax_t.plot([r["threshold"] for r in points], speed, "o-", label=name)
        xs = [r["drafter_passes_per_token"] for r in points]
        ys = [r["tokens_per_target_call"] for r in points]
        ax_p.plot(xs, ys, "o-" if len(points) > 1 else "s", label=name)
        for r, x, y in zip(points, xs, ys, strict=True):
            tag = r["k"] if policy == "constant" else r["threshold"]
            if tag is not None:
                ax_p.annotate(
                    f"{tag:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    best = max(
        (r for r in drafting if r["policy"] == "constant"),
        key=lambda r: r["speedup"]["geomean"],
        default=None,
    )
    if best is not None:
        ax_t.axhline(
            best["speedup"]["geomean"],
            ls="--",
            color="black",
            lw=0.8,
            label=f"best constant ({best['method']})",
        )
    ax_k.set(
        xlabel="draft tokens k (constant)", ylabel="speedup vs ar (geomean)", title="Constant k"
    )
    ax_t.set(xlabel="stop threshold", title="Adaptive draft length")
    ax_k.legend(fontsize=7)
    ax_t.legend(fontsize=7)
    ax_p.set(
        xlabel="drafter forward passes per generated token",
        ylabel="tokens per target call",
        title="Pareto view: target calls saved per drafter call spent",
    )
    ax_p.legend(fontsize=7)
    return [
        _save(fig, out_dir / "policy_sweep.png", plt),
        _save(fig2, out_dir / "policy_pareto.png", plt),
    ]


def write_report(record: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    """record.json, table.md and the plots of any run, causal or translation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "record.json").write_text(json.dumps(record, indent=1))
    (out_dir / "table.md").write_text(markdown_table(record))
    written = [out_dir / "record.json", out_dir / "table.md"]
    return written + (plot(record, out_dir) if plots else [])
