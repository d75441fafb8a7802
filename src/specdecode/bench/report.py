"""What a benchmark leaves behind: a JSON record, a Markdown table, and plots."""

from __future__ import annotations

import json
from pathlib import Path


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


def _paired(row: dict) -> str:
    """Sampled runs: n/a, or in a coupled run whether the text is the drafter's other methods'."""
    if "unpaired" not in row:
        return "n/a"
    unpaired = row["unpaired"]
    return "paired" if not unpaired else f"NO ({len(unpaired)} prompts differ)"


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


def _prompt_slice(cfg: dict) -> str:
    skip = cfg.get("skip", 0)  # records made before --skip have none
    return f"first {cfg['limit']}" if not skip else f"{cfg['limit']} after the first {skip}"


def markdown_table(record: dict) -> str:
    cfg = record["config"]
    lines = [
        f"# specdecode bench: {cfg['target']} with {cfg['draft']} drafting",
        "",
        f"Prompts: {cfg['prompts']} ({_prompt_slice(cfg)}), {cfg['max_new_tokens']} new tokens, "
        f"temperature {cfg['temperature']}, machine: {record['machine']['cpu']} "
        f"({record['machine']['cores']} cores), torch {record['machine']['torch']}, "
        f"transformers {record['machine']['transformers']}.",
        f"Target step {record['costs']['target_step_s'] * 1000:.0f} ms; verify pass of k+1 "
        "tokens in target steps: "
        + ", ".join(f"k={k}: {v:.2f}" for k, v in record["costs"]["verify_cost_in_steps"].items())
        + "; drafter cost ratio c: "
        + ", ".join(f"{k}: {v:.3f}" for k, v in record["costs"]["c"].items())
        + ".",
        "",
        "| method | batch | tok/s | speedup vs ar (geomean) | median [p10, p90] "
        "| after the first round (geomean) | tokens/call "
        "| drafted/round | alpha | c (calibrated / in run) | bound "
        "| efficiency (calibrated / in run) | verify cost in steps (in run) "
        "| policy ms/drafted token | modelled speedup | weights GiB "
        "| output == ar (greedy) or paired (coupled) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    greedy = cfg["temperature"] == 0
    for row in sorted(record["methods"], key=lambda r: (r["batch_size"], -r["tokens_per_s"])):
        s = row["speedup"]

        def fmt(key: str, digits: int = 2, row=row) -> str:
            value = row.get(key)
            return "-" if value is None else f"{value:.{digits}f}"

        same = (
            ("yes" if not row["mismatches"] else f"NO ({len(row['mismatches'])})")
            if greedy
            else _paired(row)
        )
        decode = row.get("decode_speedup")  # absent from records made before it
        lines.append(
            f"| {row['method']} | {row['batch_size']} | {row['tokens_per_s']:.2f} | "
            f"{s['geomean']:.2f} | {s['median']:.2f} [{s['p10']:.2f}, {s['p90']:.2f}] | "
            f"{'-' if not decode else format(decode['geomean'], '.2f')} | "
            f"{fmt('tokens_per_target_call')} | {fmt('drafted_per_round')} | {fmt('alpha')} | "
            f"{fmt('c', 3)} / {fmt('c_in_run', 3)} | {fmt('leviathan_bound')} | "
            f"{fmt('efficiency')} / {fmt('efficiency_in_run')} | "
            f"{fmt('verify_cost_in_steps_in_run')} | {fmt('policy_ms_per_drafted_token', 3)} | "
            f"{fmt('modelled_speedup')} | {fmt('model_gib', 1)} | {same} |"
        )
    comparison = policy_comparison(record)
    if comparison:
        lines += [
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
    if record["skipped"]:
        lines += ["", "Skipped: " + "; ".join(record["skipped"]) + "."]
    lines += ["", f"Peak memory (process RSS): {record['peak_rss_gib']:.1f} GiB."]
    hists = [r for r in record["methods"] if r.get("accepted_hist")]
    if hists:
        lines += ["", "Accepted-length histograms (target calls accepting n draft tokens):", ""]
        lines += [f"- {r['method']} (batch {r['batch_size']}): {r['accepted_hist']}" for r in hists]
    return "\n".join(lines) + "\n"


def plot(record: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    rows = record["methods"]
    fig, ax = plt.subplots(figsize=(6, 4))
    families: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if "[k=" in r["method"]:
            family = r["method"].split("[k=")[0] + r["method"].split("]", 1)[1]
            k = int(r["method"].split("[k=")[1].split("]")[0])
            families.setdefault((family, r["batch_size"]), []).append((k, r["speedup"]["geomean"]))
    for (family, batch), points in sorted(families.items()):
        points.sort()
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], "o-", label=f"{family} (batch {batch})"
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(
        xlabel="draft tokens k",
        ylabel="speedup vs ar (geomean)",
        title="Speedup against draft length",
    )
    ax.legend(fontsize=8)
    paths.append(out_dir / "speedup_vs_k.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ordered = sorted(rows, key=lambda r: (r["batch_size"], r["tokens_per_s"]))
    ax.barh(
        [f"{r['method']} (b{r['batch_size']})" for r in ordered],
        [r["tokens_per_s"] for r in ordered],
    )
    ax.set(xlabel="tokens/s", title="Throughput per method")
    fig.tight_layout()
    paths.append(out_dir / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

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
        fig.tight_layout()
        paths.append(out_dir / "accepted_hist.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


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
        xs = [r["drafter_forwards_per_token"] for r in points]
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
    paths = [out_dir / "policy_sweep.png", out_dir / "policy_pareto.png"]
    for figure, path in zip((fig, fig2), paths, strict=True):
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
    return paths


def write_report(record: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "record.json").write_text(json.dumps(record, indent=1))
    (out_dir / "table.md").write_text(markdown_table(record))
    written = [out_dir / "record.json", out_dir / "table.md"]
    return written + (plot(record, out_dir) if plots else [])
