"""`specdecode bench`: the command line of the benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode.backend_names import LLAMA_CPP, TORCH
from specdecode.bench.config import (
    DEFAULT_ACCEPTANCE,
    DEFAULT_BLOCK_SIZES,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_METHODS_OF,
    DEFAULT_PROMPT_LIMIT,
    DEFAULT_PROMPTS,
    DEFAULT_RELAXED,
    DEFAULT_SENTENCE_LIMIT,
)
from specdecode.cli.common import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    check_decoding_arguments,
    set_threads,
    torch_dtype,
)
from specdecode.core.config import (
    DEFAULT_BOUND,
    DEFAULT_MAX_NEW_TOKENS,
    HEAD_POLICIES,
    POLICY_DEFAULT_THRESHOLDS,
    DecodeConfig,
    SamplingConfig,
)


def model_identity(name_or_path: str) -> dict:
    from specdecode.models.store import resolve_model

    path = resolve_model(name_or_path)
    info = {"name": name_or_path, "path": str(path)}
    meta = path / "specdecode_model.json"
    if meta.is_file():
        info.update(
            {k: v for k, v in json.loads(meta.read_text()).items() if k in ("sha256", "name")}
        )
    return info


def cmd_bench_seq2seq(args: argparse.Namespace) -> int:
    """`bench --pair`: an encoder-decoder verifier with its block drafter (SpecDec)."""
    from specdecode.backends.kernels import cpu_fp32
    from specdecode.bench.seq2seq import Seq2SeqBenchConfig, run_seq2seq_bench
    from specdecode.cli.seq2seq import SHIPPED_PAIR

    if not cpu_fp32(args.device, torch_dtype(args.dtype or "float32")):
        raise ValueError(
            "bench --pair runs the seq2seq pair in float32 on the CPU; --device and --dtype "
            "apply to causal pairs (--target/--draft)"
        )
    relaxed = None
    if args.relaxed is not None:
        relaxed = []
        for item in args.relaxed:
            beta, _, tau = item.partition(",")
            try:
                relaxed.append((int(beta), float(tau)))
            except ValueError:
                raise ValueError(
                    f"--relaxed takes BETA,TAU pairs such as 5,3.0; got {item!r}"
                ) from None
    cfg = Seq2SeqBenchConfig(
        pair=str(SHIPPED_PAIR if args.pair == "shipped" else args.pair),
        **_given(args, "split", "limit", "block_sizes", "max_draft_batch", "alt_drafter"),
        **_given_values(relaxed=relaxed, prepack=False if args.no_prepack else None),
        **_shared_settings(args),
    )
    set_threads(cfg.threads)
    return _report(run_seq2seq_bench(cfg, progress=not args.quiet), args)


def _report(record: dict | None, args: argparse.Namespace) -> int:
    """Write and print a run's record and table; a mismatch fails the command. None: a
    process of a launched run other than the main one, which writes for all."""
    from specdecode.bench.report import markdown_table, verdict, write_report

    if record is None:
        return 0
    out = Path(args.out)
    write_report(record, out, plots=not args.no_plots)
    print(markdown_table(record))
    print(f"record written to {out}/record.json")
    if not record["ok"]:
        failed = [row for row in record["methods"] if row["mismatches"]]
        said = "; ".join(
            f"{row['method']} at batch {row['batch_size']}: "
            + verdict(row, record.get("noise_bound"))
            for row in failed
        )
        print(f"FAILED: an exact method's output differs from ar ({said})", file=sys.stderr)
        return 1
    return 0


def cmd_rederive(out: Path, plots: bool) -> int:
    """Rewrite a saved run's derived figures, table and plots; nothing is measured again."""
    from specdecode.bench.report import write_report
    from specdecode.bench.runner import rederive

    path = out / "record.json"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark record at {path}")
    record = rederive(json.loads(path.read_text()))
    write_report(record, out, plots=plots)
    print(f"{path}: derived figures, table.md{' and plots' if plots else ''} rewritten")
    return 0


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments as a run reads them: what was left out (None, so that each config keeps
    its default in one place) takes that default, for the checks to read."""
    defaults = dict(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        skip=0,
        batch_sizes=[1],
        repeats=1,
        num_draft_tokens=list(DEFAULT_DRAFT_TOKENS),
        length_policy=["constant"],
        confidence_threshold=[POLICY_DEFAULT_THRESHOLDS["confidence"]],
        stop_threshold=[POLICY_DEFAULT_THRESHOLDS["head"]],
    )
    filled = {k: v for k, v in defaults.items() if getattr(args, k, None) is None}
    return argparse.Namespace(**{**vars(args), **filled})


def check_bench_arguments(args: argparse.Namespace) -> None:
    """What a bench run can check without a model or torch: the shared decoding settings,
    the sweeps (every length policy with every k, bound and threshold it will run with) and
    the run's shape. The bench configs check their own method names once their registries
    load; these fail first, in a fraction of a second."""
    args = with_defaults(args)
    check_decoding_arguments(args, args.backend)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit takes the first N >= 1 prompts, got {args.limit}")
    if args.skip < 0:
        raise ValueError(f"--skip drops the set's first N >= 0 prompts, got {args.skip}")
    if any(b < 1 for b in args.batch_sizes):
        raise ValueError(f"--batch-sizes must all be >= 1, got {args.batch_sizes}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.coupled and sampling.greedy:
        raise ValueError(
            "--coupled pairs sampled text; greedy methods commit the same text already (give "
            "--temperature > 0 or leave --coupled out)"
        )
    for t in args.confidence_threshold:
        if not 0.0 < t < 1.0:
            raise ValueError(f"--confidence-threshold values must be in (0, 1), got {t}")
    for policy in args.length_policy:
        thresholds = {"confidence": args.confidence_threshold}.get(policy)
        if policy in HEAD_POLICIES:
            thresholds = args.stop_threshold
        for k in args.num_draft_tokens:
            for bound in (_bounds(args.bound) or [None]) if policy != "constant" else [None]:
                for threshold in thresholds or [None]:
                    DecodeConfig(
                        max_new_tokens=args.max_new_tokens,
                        num_draft_tokens=k,
                        sampling=sampling,
                        seed=args.seed,
                        length_policy=policy,
                        stop_threshold=threshold,
                        bound=bound,
                        coupled=args.coupled,
                    )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.pair is not None or args.rederive is None:  # a rederived run measures nothing
        check_bench_arguments(args)
    if args.pair is not None:
        return cmd_bench_seq2seq(args)
    if args.rederive is not None:
        return cmd_rederive(Path(args.rederive), plots=not args.no_plots)
    if args.shapes is not None:
        return cmd_bench_captured(args)
    if args.max_draft_batch is not None:
        raise ValueError(
            "--max-draft-batch is a --pair (seq2seq) bench option; for a causal pair, "
            "`specdecode generate --max-draft-batch N` gates drafting by batch"
        )
    from specdecode.prompts import require_prompts

    # prompts before models: a bad slice fails in a second, not after loading gigabytes
    limit = args.limit if args.limit is not None else DEFAULT_PROMPT_LIMIT
    prompts = require_prompts(args.prompts or DEFAULT_PROMPTS, limit=limit, skip=args.skip or 0)
    from specdecode.loading import default_backend

    if (args.backend or _default_bench_backend(args, default_backend)) == LLAMA_CPP:
        return cmd_bench_llama(args, prompts)
    from specdecode.backends.kernels import kernel_summary, prepack_linears
    from specdecode.bench.methods import Models
    from specdecode.bench.runner import TorchBenchConfig, run_bench
    from specdecode.models.store import load_causal_lm
    from specdecode.prompts import require_prompts

    cfg = TorchBenchConfig(
        **_prompt_settings(args),
        **_given(args, "head", "device", "dtype"),
        **_given_values(
            prepack=False if args.no_prepack else None,
            policies=args.length_policy,
            stop_thresholds=args.stop_threshold,
            confidence_thresholds=args.confidence_threshold,
            bounds=_bounds(args.bound),
        ),
        coupled=args.coupled,
        priced=args.priced,
    )
    set_threads(cfg.threads)
    target, tokenizer = load_causal_lm(cfg.target, dtype=torch_dtype(cfg.dtype), device=cfg.device)
    drafter, _ = load_causal_lm(cfg.draft, dtype=torch_dtype(cfg.dtype), device=cfg.device)
    if cfg.prepack:  # the fp32 drafter too (sd, hf-assisted); sd-int8 quantizes its dense weights
        prepack_linears(target)
        prepack_linears(drafter)
    models = Models(target, tokenizer, drafter, head=cfg.head)
    ids = models.decoder("ar").encode([p.text for p in prompts], chat=cfg.chat)
    record = run_bench(cfg, models, ids, progress=not args.quiet)
    if record is None:  # a launched process other than the main one
        return 0
    record["models"] = {"target": model_identity(cfg.target), "draft": model_identity(cfg.draft)}
    if set(HEAD_POLICIES) & set(cfg.policies):
        record["models"]["head"] = _measured_head(cfg, target, drafter)
    record["kernels"] = kernel_summary(target)
    record["prompt_ids"] = [p.id for p in prompts]
    return _report(record, args)


def cmd_bench_llama(args: argparse.Namespace, prompts: list) -> int:
    """The bench on llama.cpp (`bench.llamacpp`): GGUF files as shipped, the peers beside."""
    from specdecode.bench.llamacpp import LlamaBenchConfig, run_llama_bench

    if args.device != "cpu" or _torch_only_settings(args):
        raise ValueError(
            "the llama.cpp bench runs GGUF weights on the CPU with its own methods (specdecode "
            "drafts as `specdecode generate` does); --device, --dtype and --length-policy are "
            "torch-bench options (--backend torch)"
        )
    cfg = LlamaBenchConfig(**_prompt_settings(args), rss=args.rss)
    from specdecode.backends.llamacpp import gguf_context
    from specdecode.core.checks import check_prompts
    from specdecode.loading import gguf_path
    from specdecode.models.tokenizer import gguf_tokenizer
    from specdecode.prompts import encode_prompts

    path = gguf_path(cfg.target)
    ids = encode_prompts(gguf_tokenizer(path), [p.text for p in prompts], chat=cfg.chat)
    check_prompts(ids, cfg.max_new_tokens, gguf_context(path))  # before any weights load
    record = run_llama_bench(cfg, ids, progress=not args.quiet)
    if record is None:  # a launched process other than the main one
        return 0
    record["prompt_ids"] = [p.id for p in prompts]
    return _report(record, args)


def cmd_bench_captured(args: argparse.Namespace) -> int:
    """The captured path's bench (`bench.captured`): published shapes, random weights,
    acceptance set by a scripted drafter."""
    from specdecode.bench.captured import CapturedBenchConfig, run_captured_bench

    cfg = CapturedBenchConfig(
        target=args.shapes[0],
        draft=args.shapes[1],
        **_given(args, "device", "dtype", "compile", "acceptance", "num_draft_tokens"),
        **_given(args, "prompt_tokens", "seed"),
        **_given_values(prompts=args.limit),
        **_shared_settings(args),
    )
    set_threads(cfg.threads)
    return _report(run_captured_bench(cfg, progress=not args.quiet), args)


def _default_bench_backend(args: argparse.Namespace, default_backend) -> str:
    """llama.cpp for known models on the CPU, unless the run asks for what only the torch
    bench has (a dtype, length policies, bounds, heads, its methods, its kernels)."""
    from specdecode.bench.llamacpp import LLAMA

    torch_only = _torch_only_settings(args) or any(m not in LLAMA for m in args.methods or [])
    return TORCH if torch_only else default_backend(args.target, args.device)


def _torch_only_settings(args: argparse.Namespace) -> bool:
    """Whether the run sets what only the torch bench takes."""
    return bool(
        args.dtype not in (None, "float32")
        or args.length_policy not in (None, ["constant"])
        or args.bound
        or args.head
        or args.priced
        or args.coupled
        or args.no_prepack
    )


def _given_values(**values: object) -> dict:
    """The config fields among `values` that the command line set (None: left to the config's
    default, written once there); lists become the configs' tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None}


def _given(args: argparse.Namespace, *names: str) -> dict:
    """`_given_values` of the options named as the config fields they set."""
    return _given_values(**{name: getattr(args, name) for name in names})


def _shared_settings(args: argparse.Namespace) -> dict:
    """What every bench's config takes (`bench.config.BenchConfig`), where given."""
    return _given(args, "methods", "batch_sizes", "max_new_tokens", "repeats", "threads")


def _prompt_settings(args: argparse.Namespace) -> dict:
    """What every causal bench over a prompt set takes (`PromptBenchConfig`), where given."""
    given = _given(args, "prompts", "limit", "skip", "num_draft_tokens", "temperature", "top_k")
    given |= _given(args, "top_p", "seed")
    mtbench = (args.prompts or DEFAULT_PROMPTS) == "mtbench"  # a chat set
    return dict(
        target=args.target, draft=args.draft, chat=args.chat or mtbench, **given,
        **_shared_settings(args),
    )  # fmt: skip


def _bounds(values: list[int] | None) -> tuple[tuple[int, int], ...] | None:
    """`--bound 1 12 3 12` -> ((1, 12), (3, 12)): the adaptive policies run once per pair."""
    if not values:
        return None
    if len(values) % 2:
        raise ValueError(
            f"--bound takes MIN MAX pairs (one or more), got {len(values)} numbers: {values}"
        )
    return tuple((values[i], values[i + 1]) for i in range(0, len(values), 2))


def _measured_head(cfg, target, drafter) -> dict | None:
    """The head the `head` policy ran with: --head, or the one shipped for this pair and rule."""
    from specdecode.acceptance.head import find_shipped_head, head_provenance
    from specdecode.core.config import SamplingConfig
    from specdecode.core.verification import make_rule

    # the rule the bench's decoders verify with (make_rule's default for these settings)
    rule = make_rule(None, SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)).name
    where = cfg.head or find_shipped_head(drafter, target, rule)
    return head_provenance(where) if where is not None else None


def _listed(names: tuple[str, ...]) -> str:
    return " ".join(names)


def add_subcommands(subparsers) -> None:
    """The bench's options. Where a bench's config has a default (`bench.config`), the option's
    default is None: the config fills in what was not given, so each default is written once."""
    from specdecode.cli.common import add_decoding_arguments

    methods = DEFAULT_METHODS_OF
    p = subparsers.add_parser("bench", help="compare decoding methods on the same prompts")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument(
        "--prompts", default=None, help=f"humaneval, mtbench, or a file (default {DEFAULT_PROMPTS})"
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"first N prompts after --skip (default {DEFAULT_PROMPT_LIMIT}; with --pair: "
        f"sentences, default {DEFAULT_SENTENCE_LIMIT}, 0 for all; with --shapes: random prompts, "
        "default the largest batch size)",
    )
    p.add_argument("--skip", type=int, default=None, help="drop the set's first N prompts")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="On llama.cpp (known models on the CPU): ar specdecode (as `specdecode generate` "
        "drafts) specdecode-lookup (the same, no drafter model) sd sd-lookup "
        "llama-cpp-python llama-cpp-python-huge (its weights in 2 MiB pages, as ours) "
        "llama-cpp-python-lookup torch-ar torch-sd-int8-lookup-first (default: "
        f"{_listed(methods['llama.cpp'])}). With --backend torch: ar hf hf-assisted "
        "hf-assisted-k specdecode sd sd-int8 sd-lookup sd-int8-lookup-first hf-lookup (default: "
        f"{_listed(methods['torch'])}); suffix +dense for default kernels. With --pair: ar hf "
        "hf-beam5 hf-assisted specdec specdec-int8 specdec-alt specdec-alt-int8 specdec-relaxed "
        f"(default: {_listed(methods['seq2seq'])}; each specdec kind includes its relaxed runs; "
        "-int8 drafts with an int8 copy of the drafter, -alt with --alt-drafter). With --shapes: "
        f"{_listed(methods['captured'])} (the default)",
    )
    p.add_argument(
        "--pair",
        nargs="?",
        const="shipped",
        default=None,
        help="benchmark a seq2seq pair directory (SpecDec translation; no value: the shipped "
        "Bible es-en pair) instead of --target/--draft",
    )
    p.add_argument("--split", default=None, help="with --pair: corpus split (test, valid)")
    p.add_argument(
        "--alt-drafter",
        default=None,
        metavar="DIR",
        help="with --pair: a second block drafter for the same verifier, run as the methods "
        "specdec-alt and specdec-alt-int8 beside the pair's own",
    )
    p.add_argument(
        "--block-sizes",
        type=int,
        nargs="+",
        default=None,
        help=f"with --pair: k sweep (default {_listed(tuple(map(str, DEFAULT_BLOCK_SIZES)))})",
    )
    p.add_argument(
        "--max-draft-batch",
        type=int,
        default=None,
        metavar="N",
        help="with --pair: exact SpecDec methods also run drafting only while at most N rows of "
        "a batch are running (labelled draft<=N), at batch sizes above N",
    )
    relaxed = " ".join(f"{beta},{tau}" for beta, tau in DEFAULT_RELAXED)
    p.add_argument(
        "--relaxed",
        nargs="*",
        default=None,
        help=f"with --pair: BETA,TAU pairs of the relaxed rule (default SpecDec's {relaxed}; "
        "none given: no relaxed runs)",
    )
    p.add_argument(
        "--shapes",
        nargs=2,
        metavar=("TARGET", "DRAFT"),
        default=None,
        help="the captured path's bench: a pair of published shapes with random weights "
        "(qwen2.5-coder-1.5b qwen2.5-coder-0.5b, qwen2.5-7b, qwen3-4b qwen3-0.6b), acceptance "
        "set by --acceptance; --limit random prompts of --prompt-tokens tokens",
    )
    p.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=None,
        help="with --shapes: per-token acceptance the scripted drafter is held to (default "
        f"{_listed(tuple(map(str, DEFAULT_ACCEPTANCE)))})",
    )
    p.add_argument("--prompt-tokens", type=int, default=None, help="with --shapes: prompt length")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 1")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="run each batch's methods this many times (interleaved) and keep each one's "
        "fastest run, so that a stall of the machine does not count (default 1)",
    )
    p.add_argument("--no-prepack", action="store_true", help="default PyTorch kernels for all")
    p.add_argument("--out", default="runs/bench", help="folder for record.json, table.md, plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--rss",
        action="store_true",
        help="llama.cpp bench: also each method's peak memory, in a process of its own",
    )
    p.add_argument(
        "--rederive",
        metavar="DIR",
        default=None,
        help="recompute the derived figures (modelled speedups, policy comparison), table and "
        "plots of the run (causal or --pair) saved in DIR, measuring nothing",
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        nargs="+",
        default=None,
        help="thresholds of the confidence policy (a sweep; default "
        f"{POLICY_DEFAULT_THRESHOLDS['confidence']})",
    )
    add_decoding_arguments(p)
    p.set_defaults(func=cmd_bench)
    # sweeps: several k, policies and head thresholds instead of the shared single values; the
    # benches' configs hold the defaults of these and of the sampling settings
    sweeps = ("num_draft_tokens", "length_policy", "stop_threshold", "bound")
    from_config = ("max_new_tokens", "temperature", "top_k", "top_p", "dtype")
    for action in p._actions:
        if action.dest in sweeps:
            action.nargs = "+"
        if action.dest in sweeps or action.dest in from_config:
            action.default = None
        if action.dest == "bound":
            action.metavar = "MIN MAX"
            action.help = "tokens per round of the adaptive policies, MIN MAX pairs (a sweep: "
            action.help += "--bound 1 12 3 12 runs each adaptive policy twice; default "
            action.help += f"{DEFAULT_BOUND[0]} {DEFAULT_BOUND[1]})"
        if action.dest == "stop_threshold":
            action.help = "thresholds of the head policy (a sweep; default "
            action.help += f"{POLICY_DEFAULT_THRESHOLDS['head']})"
        if action.dest == "dtype":
            action.help = "default float32 (--shapes: bfloat16)"
