"""What a benchmark leaves behind: a JSON record, a Markdown table, and plots."""

from __future__ import annotations

import json
from pathlib import Path


def markdown_table(record: dict) -> str:
    cfg = record["config"]
    lines = [
        f"# specdecode bench: {cfg['target']} with {cfg['draft']} drafting",
        "",
        f"Prompts: {cfg['prompts']} (first {cfg['limit']}), {cfg['max_new_tokens']} new tokens, "
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
        "| method | batch | tok/s | speedup vs ar (geomean) | median [p10, p90] | tokens/call "
        "| alpha | c (calibrated / in run) | bound | efficiency (calibrated / in run) "
        "| verify cost in steps (in run) | weights GiB | output == ar |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            else "n/a"
        )
        lines.append(
            f"| {row['method']} | {row['batch_size']} | {row['tokens_per_s']:.2f} | "
            f"{s['geomean']:.2f} | {s['median']:.2f} [{s['p10']:.2f}, {s['p90']:.2f}] | "
            f"{fmt('tokens_per_target_call')} | {fmt('alpha')} | "
            f"{fmt('c', 3)} / {fmt('c_in_run', 3)} | {fmt('leviathan_bound')} | "
            f"{fmt('efficiency')} / {fmt('efficiency_in_run')} | "
            f"{fmt('verify_cost_in_steps_in_run')} | {fmt('model_gib', 1)} | {same} |"
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


def write_report(record: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "record.json").write_text(json.dumps(record, indent=1))
    (out_dir / "table.md").write_text(markdown_table(record))
    written = [out_dir / "record.json", out_dir / "table.md"]
    return written + (plot(record, out_dir) if plots else [])
