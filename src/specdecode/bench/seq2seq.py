"""`specdecode bench --pair DIR`: translation speed and quality of SpecDec against its peers.

Methods, all on the same verifier:

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

Measurement as in the causal bench: one process, a warm-up, the methods interleaved batch by
batch in a rotated order, speedups as per-batch time ratios against `ar`. With `repeats` > 1 the
rotation over a batch runs that many times and each method keeps its fastest time: on a shared
machine a stall of a second can hit any one call of a 50 ms translation, and a minimum over
interleaved repeats drops it where a mean or a total would carry it. Exact methods must
reproduce `ar` token for token (a mismatch fails the run); the others are scored by BLEU.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdecode.backends.kernels import kernel_summary, model_bytes, prepack_linears, use_prepacked
from specdecode.bench.metrics import summarize
from specdecode.bench.runner import machine_info
from specdecode.seq2seq.api import TranslationPair
from specdecode.seq2seq.block_drafter import BlockDrafter
from specdecode.verification import TopBetaTau

BATCH1_ONLY = ("hf-assisted",)
SPECDEC_KINDS = ("specdec", "specdec-int8", "specdec-alt", "specdec-alt-int8")


@dataclass(frozen=True)
class Seq2SeqMethod:
    kind: str  # ar, hf, hf-beam5, hf-assisted, or one of SPECDEC_KINDS
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

    def runs_at(self, batch_size: int) -> bool:
        """hf-assisted runs one row at a time; a gated method at or under its gate is the
        ungated one, run already."""
        if batch_size > 1 and self.kind in BATCH1_ONLY:
            return False
        return self.max_draft_batch is None or batch_size > self.max_draft_batch

    @property
    def speculative(self) -> bool:
        return self.kind in SPECDEC_KINDS

    @property
    def exact(self) -> bool:
        return self.kind in ("ar", "hf", "hf-assisted") or (
            self.speculative and self.relaxed is None
        )


@dataclass(frozen=True)
class Seq2SeqBenchConfig:
    pair: str
    split: str = "test"
    limit: int | None = 200
    methods: tuple[str, ...] = ("ar", "hf", "hf-beam5", "hf-assisted", "specdec")
    block_sizes: tuple[int, ...] = (25,)
    relaxed: tuple[tuple[int, float], ...] = ((5, 3.0),)
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 200
    threads: int | None = None
    repeats: int = 1  # > 1: each batch's rotation runs this many times, fastest time kept
    prepack: bool = True  # oneDNN-packed kernels for multi-row products (`kernels`), all models
    alt_drafter: str | None = None  # a second block drafter directory (`specdec-alt*` methods)
    max_draft_batch: int | None = None  # > 0: exact SpecDec methods also run gated at this

    def __post_init__(self) -> None:
        known = ("ar", "hf", "hf-beam5", "hf-assisted", *SPECDEC_KINDS, "specdec-relaxed")
        unknown = [m for m in self.methods if m.removesuffix("+dense") not in known]
        if unknown:
            raise ValueError(
                f"unknown seq2seq methods {unknown}; known: {', '.join(known)} (each may end in "
                "+dense: default kernels)"
            )
        alt = [m for m in self.methods if m.removesuffix("+dense").startswith("specdec-alt")]
        if alt and self.alt_drafter is None:
            raise ValueError(f"methods {alt} need a second drafter: give --alt-drafter DIR")
        if "ar" not in self.methods:
            raise ValueError("the methods must include 'ar', the baseline of every ratio")
        if not self.prepack and any(m.endswith("+dense") for m in self.methods):
            raise ValueError("+dense compares with packed kernels; drop it or --no-prepack")
        if any(k < 1 for k in self.block_sizes):
            raise ValueError(f"block sizes must be >= 1, got {self.block_sizes}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_draft_batch is not None and self.max_draft_batch < 1:
            raise ValueError(f"max_draft_batch must be >= 1, got {self.max_draft_batch}")

    def method_list(self) -> list[Seq2SeqMethod]:
        out = []
        for dense in (False, True):
            suffixed = [m for m in self.methods if m.endswith("+dense") is dense]
            names = [m.removesuffix("+dense") for m in suffixed]
            out += [Seq2SeqMethod(m, dense=dense) for m in names if not m.startswith("specdec")]
            for kind in SPECDEC_KINDS:  # each with its relaxed runs
                relaxed_only = kind == "specdec" and "specdec-relaxed" in names
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


def run_method(method: Seq2SeqMethod, pair: TranslationPair, assistant, sources, cfg):
    """-> (token ids per sentence without </s>, seconds, DecodeStats or None)."""
    models = [m for m in (pair.verifier, pair.drafter, assistant) if m is not None]
    for model in models:
        use_prepacked(model, not method.dense)
    try:
        return _run_method(method, pair, assistant, sources, cfg)
    finally:
        for model in models:
            use_prepacked(model, True)


def _run_method(method: Seq2SeqMethod, pair: TranslationPair, assistant, sources, cfg):
    if method.kind == "ar" or method.speculative:
        relaxed = method.relaxed or TopBetaTau(1)
        start = time.perf_counter()
        out = pair.translate(
            sources,
            block_size=method.k or 1,
            beta=relaxed.beta,
            tau=relaxed.tau,
            use_drafter=method.speculative,
            batch_size=len(sources),
            max_new_tokens=cfg.max_new_tokens,
            max_draft_batch=method.max_draft_batch,  # None: every round drafts
        )
        return out.token_ids, time.perf_counter() - start, out.stats
    tok = pair.tokenizer
    kwargs: dict = dict(max_new_tokens=pair.output_cap(cfg.max_new_tokens), do_sample=False)
    kwargs["num_beams"] = 5 if method.kind == "hf-beam5" else 1
    if method.kind == "hf-assisted":
        kwargs["assistant_model"] = assistant
        gc = assistant.generation_config
        gc.num_assistant_tokens_schedule, gc.num_assistant_tokens = "heuristic", 20
        gc.assistant_confidence_threshold = 0.4
    start = time.perf_counter()
    enc = tok(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = pair.verifier.generate(**enc, **kwargs)
    seconds = time.perf_counter() - start
    ids = []
    for row in gen[:, 1:].tolist():  # drop the decoder start token
        cut = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
        ids.append([t for t in row[:cut] if t != tok.pad_token_id])
    return ids, seconds, None


def bleu_scores(hyps: list[str], refs: list[str], refs2: list[str]) -> dict:
    import sacrebleu

    out = {
        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
    }
    if all(refs2):
        out["bleu_two_refs"] = sacrebleu.corpus_bleu(hyps, [refs, refs2]).score
    return out


def run_seq2seq_bench(cfg: Seq2SeqBenchConfig, progress: bool = True) -> dict:
    from transformers import AutoModelForSeq2SeqLM

    from specdecode.seq2seq.corpus import read_split

    verses = read_split(cfg.split)
    if cfg.limit:
        verses = verses[: cfg.limit]
    sources = [v.src for v in verses]
    pair = TranslationPair.from_dir(cfg.pair, prepack=cfg.prepack)
    methods = cfg.method_list()
    if any(m.speculative for m in methods) and pair.drafter is None:
        raise ValueError(f"{cfg.pair} has no drafter; drop the specdec methods")
    assistant = None
    if any(m.kind == "hf-assisted" for m in methods):
        assistant_dir = Path(cfg.pair) / "assistant"
        if not (assistant_dir / "config.json").exists():
            raise FileNotFoundError(
                f"{assistant_dir} missing: run `specdecode seq2seq train-assistant` and export"
            )
        assistant = AutoModelForSeq2SeqLM.from_pretrained(str(assistant_dir), dtype=torch.float32)
        assistant.eval()
        if cfg.prepack:
            # the switch the verifier got, so that both decode plain steps on one kernel
            prepack_linears(assistant, kernel_summary(pair.verifier)["packed_from_rows"])
    pairs = {}  # kind -> the pair it runs, where not `pair` itself
    kinds = {m.kind for m in methods}
    if "specdec-int8" in kinds:
        pairs["specdec-int8"] = pair.with_drafter(pair.drafter.int8())
    if kinds & {"specdec-alt", "specdec-alt-int8"}:
        alt = BlockDrafter.load(Path(cfg.alt_drafter))
        pairs["specdec-alt-int8"] = pair.with_drafter(alt.int8())
        pairs["specdec-alt"] = pair.with_drafter(alt)  # packed as the verifier is
    for method in methods:  # warm-up
        run_method(method, pairs.get(method.kind, pair), assistant, sources[:1], cfg)
    runs: list[dict] = []
    for batch_size in cfg.batch_sizes:
        runnable = [m for m in methods if m.runs_at(batch_size)]
        outputs = {m.label: [None] * len(sources) for m in runnable}
        seconds = {m.label: [] for m in runnable}
        stats = {m.label: None for m in runnable}
        phases = {m.label: [0.0, 0.0, 0, 0] for m in runnable}  # draft s, verify s, calls
        starts = list(range(0, len(sources), batch_size))
        bar = tqdm(total=len(starts) * len(runnable) * cfg.repeats, desc=f"bench b={batch_size}",
                   disable=not progress)  # fmt: skip
        for i, start in enumerate(starts):
            part = sources[start : start + batch_size]
            order = runnable[i % len(runnable) :] + runnable[: i % len(runnable)]
            fastest = {m.label: float("inf") for m in runnable}
            for repeat in range(cfg.repeats):
                for method in order:
                    ids, secs, st = run_method(
                        method, pairs.get(method.kind, pair), assistant, part, cfg
                    )
                    fastest[method.label] = min(fastest[method.label], secs)
                    bar.update()
                    if repeat:  # the output and counts of a repeat are the first one's again
                        if ids != outputs[method.label][start : start + len(part)]:
                            raise RuntimeError(f"{method.label} changed its output on a repeat")
                        continue
                    outputs[method.label][start : start + len(part)] = ids
                    if st is None:
                        continue
                    ph = phases[method.label]
                    ph[0] += st.draft_seconds
                    ph[1] += st.verify_seconds
                    ph[2] += st.drafter_forwards
                    ph[3] += st.target_forwards
                    stats[method.label] = (
                        st.total
                        if stats[method.label] is None
                        else stats[method.label].merge(st.total)
                    )
            for label, secs in fastest.items():
                seconds[label].append(secs)
        bar.close()
        run = summarise(cfg, runnable, batch_size, outputs, seconds, stats, verses, pair)
        for row in run["methods"]:
            draft_s, verify_s, draft_calls, verify_calls = phases[row["method"]]
            if verify_calls:
                row["ms_per_verifier_call"] = 1000 * verify_s / verify_calls
            if draft_calls:
                row["ms_per_drafter_call"] = 1000 * draft_s / draft_calls
        runs.append(run)
    drafter_bytes = (
        sum(p.numel() * p.element_size() for p in pair.drafter.parameters()) if pair.drafter else 0
    )
    verifier_bytes = sum(p.numel() * p.element_size() for p in pair.verifier.parameters())
    return {
        "config": asdict(cfg),
        "machine": machine_info(),
        "verifier_mib": verifier_bytes / 2**20,
        "drafter_mib": drafter_bytes / 2**20,
        "assistant_mib": (
            sum(p.numel() * p.element_size() for p in assistant.parameters()) / 2**20
            if assistant is not None
            else None
        ),
        # with the packed weight copies (`prepack`), which double the linear weights
        "verifier_mib_in_memory": model_bytes(pair.verifier) / 2**20,
        "drafter_mib_in_memory": model_bytes(pair.drafter) / 2**20 if pair.drafter else 0.0,
        "drafter_int8_mib": (
            model_bytes(pairs["specdec-int8"].drafter) / 2**20 if "specdec-int8" in pairs else None
        ),
        "kernels": kernel_summary(pair.verifier),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "runs": runs,
        "ok": not any(r["mismatches"] for run in runs for r in run["methods"] if r["exact"]),
    }


def summarise(cfg, methods, batch_size, outputs, seconds, stats, verses, pair) -> dict:
    refs, refs2 = [v.tgt for v in verses], [v.ref2 for v in verses]
    base_ids, base_secs = outputs["ar"], seconds["ar"]
    hf_secs = seconds.get("hf")
    rows = []
    for m in methods:
        ids, secs = outputs[m.label], seconds[m.label]
        texts = pair.tokenizer.batch_decode(ids, skip_special_tokens=True)
        same = [a == b for a, b in zip(ids, base_ids, strict=True)]
        row = {
            "method": m.label,
            "k": m.k,
            "dense": m.dense,
            "exact": m.exact,
            "approximate": not m.exact and m.speculative,
            "batch_size": batch_size,
            "sentences": len(ids),
            "tokens": sum(map(len, ids)),
            "seconds": sum(secs),
            "sentences_per_s": len(ids) / sum(secs),
            "speedup": summarize([b / s for b, s in zip(base_secs, secs, strict=True)]),
            "speedup_vs_hf": (
                summarize([b / s for b, s in zip(hf_secs, secs, strict=True)]) if hf_secs else None
            ),
            "identical_to_ar": sum(same) / len(same),
            "mismatches": [i for i, s in enumerate(same) if not s] if m.exact else [],
            **bleu_scores(texts, refs, refs2),
        }
        st = stats[m.label]
        if st is not None and st.target_calls:
            row.update(
                tokens_per_verifier_call=st.tokens_per_target_call,
                acceptance_rate=st.acceptance_rate if st.drafted else None,
                accepted_at_least=st.accepted_at_least() if st.drafted else None,
                verifier_calls=st.target_calls,
            )
        rows.append(row)
    return {"batch_size": batch_size, "methods": rows, "examples": _examples(verses, outputs, pair)}


def _examples(verses, outputs, pair, n: int = 3) -> list[dict]:
    out = []
    for i in range(min(n, len(verses))):
        row = {"ref": verses[i].ref, "source": verses[i].src, "reference": verses[i].tgt}
        for label, ids in outputs.items():
            row[label] = pair.tokenizer.decode(ids[i], skip_special_tokens=True)
        out.append(row)
    return out


def markdown_table(record: dict) -> str:
    lines = []
    for run in record["runs"]:
        lines += [
            f"\nbatch size {run['batch_size']}, {run['methods'][0]['sentences']} sentences "
            f"({record['config']['split']} split)\n",
            "| method | speedup vs ar (geomean, p10-p90) | vs hf | sent/s | tokens/verifier call "
            "| first draft token accepted | ms per drafter / verifier call | BLEU | BLEU 2 refs "
            "| chrF | identical to ar |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in run["methods"]:
            sp, hf = r["speedup"], r["speedup_vs_hf"]
            mark = " (approx.)" if r["approximate"] else ""
            tpc = r.get("tokens_per_verifier_call")
            first = (r.get("accepted_at_least") or [None])[0]
            cells = [
                f"{r['method']}{mark}",
                f"{sp['geomean']:.2f}x ({sp['p10']:.2f}-{sp['p90']:.2f})",
                f"{hf['geomean']:.2f}x" if hf else "-",
                f"{r['sentences_per_s']:.2f}",
                f"{tpc:.2f}" if tpc else "-",
                f"{100 * first:.1f}%" if first is not None else "-",
                " / ".join(
                    f"{r[key]:.1f}" if key in r else "-"
                    for key in ("ms_per_drafter_call", "ms_per_verifier_call")
                ),
                f"{r['bleu']:.2f}",
                f"{r['bleu_two_refs']:.2f}" if "bleu_two_refs" in r else "-",
                f"{r['chrf']:.1f}",
                f"{100 * r['identical_to_ar']:.1f}%",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"\nverifier {record['verifier_mib']:.1f} MiB, "
        f"block drafter {record['drafter_mib']:.1f} MiB"
        + (f", assistant {record['assistant_mib']:.1f} MiB" if record["assistant_mib"] else "")
        + " (fp32 parameters as loaded)"
    )
    if record.get("kernels", {}).get("prepacked"):
        lines.append(
            f"Kernels: oneDNN-packed copies for products of "
            f"{record['kernels']['packed_from_rows']}+ rows (`+dense`: default kernels); with "
            f"the copies, verifier {record['verifier_mib_in_memory']:.1f} MiB and drafter "
            f"{record['drafter_mib_in_memory']:.1f} MiB in memory."
        )
    if record.get("drafter_int8_mib"):
        lines.append(
            f"The int8 drafter copy (`specdec-int8`): {record['drafter_int8_mib']:.1f} MiB."
        )
    return "\n".join(lines)


def plot(record: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for run in record["runs"]:
        rows = [r for r in run["methods"] if r["method"].startswith("specdec")]
        if not rows:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        lines: dict[str, list] = {}  # drafter kind and kernels -> exact rows
        for r in rows:
            if r["exact"]:
                kind = r["method"].split("[")[0] + (", default kernels" if r.get("dense") else "")
                lines.setdefault(kind, []).append(r)
        for kind, exact in lines.items():
            exact.sort(key=lambda r: r["k"])
            ax1.plot([r["k"] for r in exact], [r["speedup"]["geomean"] for r in exact], "o-",
                     label=f"{kind}, beta = 1 (exact)")  # fmt: skip
        ax1.set_xlabel("block size k")
        ax1.set_ylabel("speedup vs ar (time ratio)")
        ax1.set_title(f"SpecDec, batch {run['batch_size']}")
        ax1.grid(alpha=0.3)
        ax1.legend()
        for r in run["methods"]:
            marker = "s" if r["approximate"] else "o"
            ax2.scatter(r["speedup"]["geomean"], r["bleu"], marker=marker)
            ax2.annotate(r["method"], (r["speedup"]["geomean"], r["bleu"]), fontsize=7)
        ax2.set_xlabel("speedup vs ar")
        ax2.set_ylabel("BLEU (test split)")
        ax2.set_title("quality against speed (squares: approximate)")
        ax2.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"seq2seq_b{run['batch_size']}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
