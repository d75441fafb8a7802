"""`specdecode head collect | train | replay | calibrate`: an acceptance head for a drafter/target
pair.

    specdecode head collect --prompts humaneval --skip 40 --out DATA     # labelled drafter states
    specdecode head train DATA [DATA ...] --out HEAD                     # weighted BCE, calibration
    specdecode head collect --rounds 12 --limit 16 --out EVAL            # on evaluation prompts
    specdecode head replay EVAL --head HEAD                              # paired, by replay
    specdecode head calibrate HEAD DATA                                  # for policy head-u
    specdecode generate --length-policy head --head HEAD --prompt ...    # use it

`head collect` needs both models, on llama.cpp for known models (their GGUF files, as `generate`
and `bench` run them) and on torch for model directories (`--backend` chooses); `head train`
only needs the collected tensors, so it runs anywhere `accelerate` finds a device. The defaults
come from `CollectConfig` and `TrainConfig`, so the command line and the Python API cannot drift
apart. Heavy imports (accelerate, matplotlib) wait until the command runs, keeping `specdecode
--help` fast. Bad input raises ValueError / FileNotFoundError naming the culprit; the main CLI
turns those into one line.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from specdecode.acceptance.head import RULES
from specdecode.acceptance.replay import PREVIEW_COSTS
from specdecode.acceptance.train import RELIABILITY_FILE, TRAINING_FILE, TrainConfig, train_head
from specdecode.backend_names import LLAMA_CPP, TORCH
from specdecode.core.prices import Prices

_DEFAULTS = TrainConfig()


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `specdecode head train DATA_DIR [DATA_DIR ...] --out HEAD_DIR ...`."""
    parser.add_argument(
        "data_dir",
        nargs="+",
        metavar="DATA_DIR",
        help="written by `specdecode head collect`; several (for the same pair, say code and "
        "chat) train one head on all of them",
    )
    parser.add_argument("--out", required=True, metavar="HEAD_DIR", help="where to save the head")
    parser.add_argument(
        "--rule",
        choices=RULES,
        default=_DEFAULTS.rule,
        help="which acceptance to learn: greedy (argmax agreement) or sampling (expected)",
    )
    parser.add_argument("--layers", type=int, default=_DEFAULTS.num_layers, help="residual blocks")
    parser.add_argument(
        "--width",
        type=int,
        default=_DEFAULTS.width,
        help="the residual blocks' width; the hidden state is first projected to it (default: "
        "the drafter's hidden size, no projection)",
    )
    parser.add_argument("--dropout", type=float, default=_DEFAULTS.dropout)
    parser.add_argument(
        "--no-law-features",
        action="store_true",
        help="read the hidden state only, not the drafting law's top probability, entropy, margin",
    )
    parser.add_argument(
        "--expected-label",
        action="store_true",
        help="sampling heads: learn the acceptance expected over the drafting law, not that of "
        "the token drawn (which the default head reads as a fourth feature)",
    )
    parser.add_argument(
        "--reject-weight",
        type=float,
        default=_DEFAULTS.reject_weight,
        help="loss weight of rejected tokens relative to accepted ones",
    )
    parser.add_argument("--epochs", type=int, default=_DEFAULTS.epochs)
    parser.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size)
    parser.add_argument("--lr", type=float, default=_DEFAULTS.lr)
    parser.add_argument("--weight-decay", type=float, default=_DEFAULTS.weight_decay)
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=_DEFAULTS.val_fraction,
        help="fraction of prompts (whole prompts, not positions) held out for validation",
    )
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop this call once the run has taken N steps in all, keeping its checkpoint in "
        "HEAD_DIR/checkpoint; the same command resumes it, with any number of processes",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--half", action="store_true", help="save the weights in fp16")
    add_replay_prices(parser, "--preview-")


def add_replay_prices(parser: argparse.ArgumentParser, prefix: str) -> None:
    """`{prefix}bound`, `{prefix}costs` and `{prefix}verify-curve`: the rounds and prices a
    replay uses (`replay_costs` reads them back)."""
    parser.add_argument(
        f"{prefix}bound",
        nargs=2,
        type=int,
        default=_DEFAULTS.preview_bound,
        metavar=("MIN", "MAX"),
        help="tokens per round in the replay (as `--bound` of generate and bench)",
    )
    parser.add_argument(
        f"{prefix}costs",
        nargs=2,
        type=float,
        default=(PREVIEW_COSTS[0], PREVIEW_COSTS[1]),
        metavar=("DRAFT", "VERIFY_SLOPE"),
        help="the replay's prices, in target steps: a drafted token, and each extra position "
        "a verify pass scores (`specdecode bench` prints your machine's: c and the verify "
        "costs); the defaults are the default pair's on a 2-core Intel Xeon",
    )
    parser.add_argument(
        f"{prefix}verify-curve",
        nargs="+",
        type=float,
        default=(),
        metavar="STEPS",
        help="the verify pass's cost in target steps for 1, 2, ... drafted tokens (the bench's "
        "'verify pass of k+1 tokens'), in place of the line 1 + VERIFY_SLOPE k; past its end "
        "each token adds VERIFY_SLOPE",
    )


def replay_costs(args: argparse.Namespace, prefix: str) -> Prices:
    """The prices of the options `add_replay_prices` added under `prefix`."""
    name = prefix.lstrip("-").replace("-", "_")
    curve = getattr(args, f"{name}verify_curve")
    draft, slope = getattr(args, f"{name}costs")
    return Prices.stated(draft, slope, tuple(curve))


def cmd_train(args: argparse.Namespace) -> int:
    """Train, then print a short summary and where the head went."""
    config = TrainConfig(
        rule=args.rule,
        num_layers=args.layers,
        width=args.width,
        dropout=args.dropout,
        law_features=not args.no_law_features,
        drawn_token=not args.expected_label,
        reject_weight=args.reject_weight,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        val_fraction=args.val_fraction,
        seed=args.seed,
        half=args.half,
        preview_bound=tuple(args.preview_bound),
        preview_prices=replay_costs(args, "--preview-"),
    )
    result = train_head(
        args.data_dir, args.out, config, progress=not args.no_progress, max_steps=args.max_steps
    )
    from specdecode.training.distributed import process_state

    if not process_state().is_main_process:  # under `accelerate launch`: one report
        return 0
    if result.get("stopped"):
        print(
            f"stopped at step {result['step']} of {result['total_steps']} (epoch "
            f"{result['epoch']}); the checkpoint is in {result['checkpoint']}: run the same "
            "command again to go on"
        )
        return 0
    best = result["best"]
    split = result["split"]
    print(
        f"best epoch {result['best_epoch']}/{config.epochs}: "
        f"val loss {best['val_loss']:.4f} (constant predictor "
        f"{result['constant_baseline']['val_loss']:.4f}), bce {best['val_bce']:.4f}, "
        f"ECE {best['val_ece']:.3f}, AUC {_fmt(best.get('val_auc'))}"
    )
    print(
        f"{split['train_examples']} train / {split['val_examples']} val examples "
        f"({len(split['train_prompts'])} / {len(split['val_prompts'])} prompts), "
        f"{result['seconds']:.1f} s on {result['device']}"
    )
    preview = result.get("policy_preview") or {}
    if preview:
        low, high = config.preview_bound
        where = (
            "the validation responses, on their recorded verdicts"
            if result.get("preview_kind") == "rounds"
            else "decoding replayed on the validation responses"
        )
        print(
            f"held-out preview ({where}, rounds of "
            f"{low}..{high}; {config.preview_prices.rounds(1).describe(high)}):"
        )
        for name, row in preview.items():
            print(
                f"  {name:>12}: {row['tokens_per_round']:.2f} tokens/round, "
                f"{row['drafted_per_round']:.2f} drafted/round, est. {row['est_speed']:.2f}x"
            )
    out = Path(args.out)
    print(f"head saved to {out} ({TRAINING_FILE}, {RELIABILITY_FILE})")
    return 0


def add_collect_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.acceptance.collect import CollectConfig
    from specdecode.bench.config import DEFAULT_PROMPTS
    from specdecode.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET

    d = CollectConfig()
    parser.add_argument("--target", default=DEFAULT_TARGET, help="model directory or known name")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="drafter directory or known name")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="humaneval, mtbench, or a file")
    parser.add_argument(
        "--skip", type=int, default=0, help="leave out the first N prompts (the evaluation ones)"
    )
    parser.add_argument("--limit", type=int, default=None, help="then take at most N prompts")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    parser.add_argument("--out", required=True, metavar="DATA_DIR", help="collection directory")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help="of the target's responses and of the sampling labels (0: greedy)",
    )
    parser.add_argument(
        "--mixing-ratio",
        type=float,
        default=None,
        help="chance that a position commits the drafter's token instead of the target's "
        f"(default {d.mixing_ratio}; not with --rounds)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        metavar="K",
        help="record inside real speculative rounds of K drafted tokens (on-policy states: "
        "each token's prefix holds the round's earlier drafts) instead of mixed sequences",
    )
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--backend",
        choices=(TORCH, LLAMA_CPP),
        default=None,
        help="llama.cpp records the GGUF drafter's states as llama.cpp computes them (the "
        "default for known models, as for generate and bench); torch those of transformers "
        "models (the default for model directories)",
    )
    parser.add_argument(
        "--fp32-drafter",
        action="store_true",
        help="torch: collect with the fp32 drafter (default: its int8 copy, the one that runs "
        "fastest)",
    )
    parser.add_argument("--no-prepack", action="store_true", help="torch: default kernels")
    parser.add_argument(
        "--threads", type=int, default=None, help="default: torch all cores, llama.cpp the physical"
    )
    parser.add_argument("--no-progress", action="store_true")


def cmd_collect(args: argparse.Namespace) -> int:
    from specdecode.acceptance.collect import CollectConfig, collect
    from specdecode.cli.common import set_threads
    from specdecode.core.config import PROMPT_LOOKUP
    from specdecode.loading import default_backend
    from specdecode.prompts import require_prompts
    from specdecode.training.distributed import process_state, threads_per_process

    backend = args.backend or default_backend(args.target, "cpu")
    if args.draft == PROMPT_LOOKUP:
        raise ValueError("a head reads a drafter model's states: prompt lookup has none (--draft)")
    if backend != TORCH and (args.fp32_drafter or args.no_prepack):
        raise ValueError(
            "--fp32-drafter and --no-prepack are options of the torch backend; llama.cpp runs "
            "the GGUF's own weights (--backend torch for them)"
        )
    set_threads(args.threads or threads_per_process())  # the cores shared by launched processes
    cfg = CollectConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        mixing_ratio=(
            args.mixing_ratio
            if args.mixing_ratio is not None
            else (0.0 if args.rounds else CollectConfig.mixing_ratio)
        ),
        batch_size=args.batch_size,
        seed=args.seed,
        rounds=args.rounds,
    )
    prompts = require_prompts(args.prompts, limit=args.limit, skip=args.skip)
    decoder = _collect_decoder(args, backend)
    ids = decoder.encode([p.text for p in prompts], chat=args.chat)
    meta = collect(
        decoder.target,  # the torch modules, or the llama.cpp models themselves
        decoder.drafter,
        ids,
        args.out,
        cfg,
        decoder.default_stop_ids(),
        args.prompts,
        args.skip,
        progress=not args.no_progress,
    )
    if not process_state().is_main_process:  # under `accelerate launch`: one report
        return 0
    span = f"{args.prompts}[{args.skip}:{args.skip + len(prompts)}]"
    print(
        f"{meta['num_examples']} examples from {len(ids)} prompts ({span}, {backend}) in "
        f"{meta['seconds']:.0f} s; mean greedy acceptance {meta['mean_label_greedy']:.3f}, "
        f"mean sampling acceptance {meta['mean_label_sampling']:.3f} (of the drawn tokens "
        f"{meta['mean_label_drawn']:.3f}); written to {args.out}"
    )
    return 0


def _collect_decoder(args: argparse.Namespace, backend: str):
    """The pair to collect with, behind a decoder: it runs the compatibility checks decoding
    runs and encodes the prompts. torch: the int8 drafter (unless --fp32-drafter) and packed
    kernels (unless --no-prepack); llama.cpp: the GGUF files as shipped."""
    from specdecode.api import SpeculativeDecoder
    from specdecode.training.distributed import process_state, threads_per_process

    if backend != TORCH:
        shared = process_state().num_processes > 1  # launched processes share the cores
        threads = args.threads or (threads_per_process() if shared else None)
        return SpeculativeDecoder.from_pretrained(
            args.target, args.draft, backend=backend, threads=threads
        )
    from specdecode.backends.kernels import prepack_linears, quantize_int8
    from specdecode.models.store import load_causal_lm

    target, tokenizer = load_causal_lm(args.target)
    drafter, draft_tokenizer = load_causal_lm(args.draft)
    if not args.fp32_drafter:
        drafter = quantize_int8(drafter)
    if not args.no_prepack:  # an int8 drafter has no fp32 Linear left: packing skips it
        prepack_linears(target)
        prepack_linears(drafter)
    return SpeculativeDecoder(target, tokenizer, drafter, draft_tokenizer)


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "data_dir", metavar="DATA_DIR", help="written by `specdecode head collect --rounds K`"
    )
    parser.add_argument(
        "--head", action="append", required=True, metavar="HEAD_DIR", help="repeat for more"
    )
    add_replay_prices(parser, "--")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def cmd_replay(args: argparse.Namespace) -> int:
    """Print each policy's replayed speed against the best constant k."""
    import json

    from specdecode.acceptance.replay import replay_heads

    costs = replay_costs(args, "--")
    result = replay_heads(args.data_dir, args.head, tuple(args.bound), costs)
    best = result["best_constant"]
    print(
        f"{result['examples']} recorded drafts in {args.data_dir}; rounds of "
        f"{args.bound[0]}..{args.bound[1]}, {costs.rounds(1).describe(args.bound[1])}; "
        f"best constant {best}"
    )

    def line(name: str, row: dict) -> str:
        low, high = (x - 1 for x in row["vs_best_constant_95"])
        return (
            f"  {name:>14}: est. {row['est_speed']:.3f}x ({row['vs_best_constant'] - 1:+.1%} vs "
            f"{best}, 95% over prompts {low:+.1%} to {high:+.1%}), "
            f"{row['tokens_per_round']:.2f} tokens/round, "
            f"{row['drafted_per_round']:.2f} drafted/round"
        )

    for name, row in result["constants"].items():
        print(line(name, row))
    for head, rows in result["heads"].items():
        print(f"head {head}:")
        for name, row in rows.items():
            print(line(name, row))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("head_dir", metavar="HEAD_DIR", help="a sampling head")
    parser.add_argument(
        "data_dir",
        nargs="+",
        metavar="DATA_DIR",
        help="collections for the head's pair (`specdecode head collect`, sampling)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="save the calibrated head here (default: in place)"
    )
    parser.add_argument(
        "--reject-weight",
        type=float,
        default=_DEFAULTS.reject_weight,
        help="weight of rejected verdicts, as in training (so thresholds keep their meaning)",
    )


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the head's calibration against acceptance numbers and say what it gains."""
    from specdecode.acceptance.calibration import NUMBER_DRAWS, calibrate_head

    result = calibrate_head(args.head_dir, args.data_dir, args.out, args.reject_weight)
    bias, a, b = result["weights"]
    held = result["held_out"]
    print(
        f"logit P(accept | z, u) = {bias:.3f} + {a:.3f} z {b:+.3f} log u, fitted on "
        f"{result['fit_examples']} drafted tokens x {NUMBER_DRAWS} numbers"
    )
    print(
        f"held out ({result['held_out_examples']} tokens, fresh numbers): weighted BCE "
        f"{held['head_loss']:.4f} -> {held['head_u_loss']:.4f}, AUC {_fmt(held['head_auc'])} "
        f"-> {_fmt(held['head_u_auc'])}"
    )
    print(f"head saved to {result['head']}: use it with --length-policy head-u")
    return 0


def add_subcommands(subparsers) -> None:
    head = subparsers.add_parser("head", help="collect data for and train an acceptance head")
    jobs = head.add_subparsers(dest="head_command", required=True)
    collect = jobs.add_parser("collect", help="record drafter states and acceptance labels")
    add_collect_arguments(collect)
    collect.set_defaults(func=cmd_collect)
    train = jobs.add_parser("train", help="train an acceptance head on a collection")
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)
    replay = jobs.add_parser(
        "replay", help="replay heads and constants on a collection made inside rounds"
    )
    add_replay_arguments(replay)
    replay.set_defaults(func=cmd_replay)
    calibrate = jobs.add_parser(
        "calibrate", help="fit a sampling head's reading of acceptance numbers (head-u)"
    )
    add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"
