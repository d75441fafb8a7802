"""Commands of the seq2seq side: `seq2seq train-verifier|distill|train-drafter|train-assistant|
export` and `translate`.

Training outputs go to the cache (`<cache>/seq2seq/bible-es-en/...`); `export` gathers the best
verifier, drafter and assistant into a pair directory in fp16, the form the project ships
(`specdecode/pairs/bible-es-en`) and `translate --pair` reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from specdecode.backends.kernels import prepack_available
from specdecode.core.config import max_draft_batch_option
from specdecode.loading import DRAFT_PRECISIONS, int8_draft_wanted
from specdecode.models.packages import cache_root
from specdecode.seq2seq.api import AUTO_DRAFT_BATCH
from specdecode.seq2seq.training import LoopConfig

SHIPPED_PAIR = Path(__file__).resolve().parent.parent / "pairs" / "bible-es-en"


def work_dir(args: argparse.Namespace) -> Path:
    return cache_root(getattr(args, "cache_dir", None)) / "seq2seq" / "bible-es-en"


def loop_config(args: argparse.Namespace, **defaults) -> LoopConfig:
    base = LoopConfig(**defaults)
    return LoopConfig(
        lr=args.lr if args.lr is not None else base.lr,
        warmup=args.warmup if args.warmup is not None else base.warmup,
        max_tokens=args.max_tokens,
        minutes=args.minutes,
        max_steps=args.max_steps,
        eval_minutes=args.eval_minutes,
        checkpoint_minutes=args.checkpoint_minutes,
        weight_decay=base.weight_decay,
        seed=args.seed,
        threads=args.threads or 0,
        keep_snapshots=args.keep_snapshots,
    )


def add_loop_arguments(p: argparse.ArgumentParser, minutes: float) -> None:
    p.add_argument("--out", type=Path, default=None, help="output directory (default: the cache)")
    p.add_argument("--minutes", type=float, default=minutes, help="wall-clock budget of this call")
    p.add_argument("--max-steps", type=int, default=0, help="0: no step limit")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=2048, help="target tokens per batch")
    p.add_argument("--eval-minutes", type=float, default=8.0)
    p.add_argument("--checkpoint-minutes", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--keep-snapshots", type=int, default=0, help="keep the last N checkpoints' models"
    )


def cmd_train_verifier(args: argparse.Namespace) -> int:
    from specdecode.seq2seq.verifier_train import (
        TrainVerifierConfig,
        VerifierConfig,
        train_verifier,
    )

    out = args.out or work_dir(args) / "verifier"
    model = VerifierConfig(
        d_model=args.d_model,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        heads=args.heads,
        ffn=args.ffn,
        vocab_size=args.vocab_size,
    )
    cfg = TrainVerifierConfig(
        out=out, model=model, loop=loop_config(args), valid_limit=args.valid_limit
    )
    print(json.dumps(train_verifier(cfg, progress=not args.quiet), indent=1))
    return 0


def cmd_train_assistant(args: argparse.Namespace) -> int:
    """The `hf-assisted` baseline's drafter: the verifier's encoder and first decoder layer(s),
    trained on the distilled data with the verifier's own objective."""
    from specdecode.seq2seq.verifier_train import (
        TrainVerifierConfig,
        VerifierConfig,
        train_verifier,
    )

    verifier = args.verifier or work_dir(args) / "verifier" / "best"
    train_file = args.train_file or work_dir(args) / "distilled.jsonl"
    _require(verifier / "config.json", "train-verifier")
    _require(train_file, "distill")
    config = json.loads((verifier / "config.json").read_text())
    model = VerifierConfig(
        d_model=config["d_model"],
        encoder_layers=config["encoder_layers"],
        decoder_layers=args.decoder_layers,
        heads=config["decoder_attention_heads"],
        ffn=config["decoder_ffn_dim"],
        vocab_size=config["vocab_size"],
    )
    cfg = TrainVerifierConfig(
        out=args.out or work_dir(args) / "assistant",
        model=model,
        loop=loop_config(args, lr=5e-4, warmup=200),
        train_file=train_file,
        tokenizer=verifier,
        init_from=verifier,
        valid_limit=args.valid_limit,
    )
    print(json.dumps(train_verifier(cfg, progress=not args.quiet), indent=1))
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from specdecode.seq2seq.verifier_train import average_verifier

    if args.threads:
        torch.set_num_threads(args.threads)
    run = args.run or work_dir(args) / "verifier"
    print(json.dumps(average_verifier(run, args.last, args.valid_limit), indent=1))
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from specdecode.seq2seq.distill import distill

    verifier = args.verifier or work_dir(args) / "verifier" / "best"
    _require(verifier / "config.json", "train-verifier")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = distill(
        verifier,
        args.out or work_dir(args) / "distilled.jsonl",
        limit=args.limit,
        batch_size=args.batch_size,
        augment=args.augment,
        progress=not args.quiet,
    )
    print(out)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specdecode.seq2seq.drafter_train import TrainDrafterConfig, train_drafter

    verifier = args.verifier or work_dir(args) / "verifier" / "best"
    train_file = args.train_file or work_dir(args) / "distilled.jsonl"
    _require(verifier / "config.json", "train-verifier")
    _require(train_file, "distill")
    cfg = TrainDrafterConfig(
        verifier=verifier,
        train_file=train_file,
        extra_train_files=tuple(args.extra_train_file),
        out=args.out or work_dir(args) / "drafter",
        block_size=args.block_size,
        min_block=args.min_block,
        layers=args.layers,
        blocks_per_sentence=args.blocks_per_sentence,
        glance=args.glance,
        position_decay=args.position_decay,
        init_drafter=args.init_drafter,
        first_from_prefix=args.first_from_prefix,
        lm_weight=args.lm_weight,
        target_features=args.target_features,
        valid_sentences=args.valid_sentences,
        loop=loop_config(args, lr=5e-4, warmup=300, weight_decay=0.01),
    )
    print(json.dumps(train_drafter(cfg, progress=not args.quiet), indent=1))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Best verifier, drafter and assistant -> one pair directory, fp16."""
    from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

    from specdecode.seq2seq.block_drafter import BlockDrafter

    src = work_dir(args)
    out = Path(args.out)
    parts = {"verifier": src / "verifier" / "best", "assistant": src / "assistant" / "best"}
    for name, path in parts.items():
        if not (path / "config.json").exists():
            if name == "assistant":
                continue
            _require(path / "config.json", "train-verifier")
        model = AutoModelForSeq2SeqLM.from_pretrained(str(path)).to(torch.float16)
        model.save_pretrained(str(out / name))
        PreTrainedTokenizerFast.from_pretrained(str(path)).save_pretrained(str(out / name))
    drafter_dir = src / "drafter" / "best"
    _require(drafter_dir / "drafter_config.json", "train-drafter")
    BlockDrafter.load(drafter_dir).save(out / "drafter", dtype=torch.float16)
    for name in ("verifier", "drafter", "assistant"):
        summary = src / name / "summary.json"
        if summary.exists():
            shutil.copy(summary, out / name / "training_summary.json")
    print(out)
    return 0


def _require(path: Path, command: str) -> None:
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: run `specdecode seq2seq {command}` first")


def cmd_translate(args: argparse.Namespace) -> int:
    from specdecode.seq2seq.api import TranslationPair

    if args.threads:
        torch.set_num_threads(args.threads)
    sources = list(args.text)
    if args.file:
        sources += Path(args.file).read_text(encoding="utf-8").splitlines()
    sources = [s for s in sources if s.strip()]
    if not sources:
        raise ValueError("nothing to translate: give sentences as arguments or --file")
    pair_dir = Path(args.pair) if args.pair else SHIPPED_PAIR
    # packed kernels where this torch build has them; the default ones otherwise (same output)
    pair = TranslationPair.from_dir(
        pair_dir,
        prepack=not args.no_prepack and prepack_available(),
        drafter_int8=args.method == "specdec"
        and int8_draft_wanted(args.draft_precision, "cpu", torch.float32),
    )
    out = pair.translate(
        sources,
        block_size=args.block_size,
        beta=args.beta,
        tau=args.tau,
        use_drafter=args.method == "specdec",
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_draft_batch="auto"
        if args.max_draft_batch is None
        else max_draft_batch_option(args.max_draft_batch),
    )
    for text in out.texts:
        print(text)
    if args.stats:
        mark = "" if out.exact else " (approximate: beta > 1)"
        print(out.stats.summary() + mark, file=sys.stderr)
    return 0


def add_subcommands(subparsers) -> None:
    s2s = subparsers.add_parser("seq2seq", help="train and export a SpecDec translation pair")
    sub = s2s.add_subparsers(dest="seq2seq_command", required=True)

    p = sub.add_parser("train-verifier", help="train the autoregressive verifier (resumable)")
    add_loop_arguments(p, minutes=30)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--encoder-layers", type=int, default=3)
    p.add_argument("--decoder-layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--valid-limit", type=int, default=0)
    p.set_defaults(func=cmd_train_verifier)

    p = sub.add_parser(
        "average", help="average the verifier's last snapshots; keep it if it scores better"
    )
    p.add_argument("--run", type=Path, default=None, help="verifier run (default: the cache)")
    p.add_argument("--last", type=int, default=5, help="how many snapshots to average")
    p.add_argument("--valid-limit", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("distill", help="translate the training sources with the verifier")
    p.add_argument("--verifier", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--limit", type=int, default=0, help="first N training verses (0: all)")
    p.add_argument(
        "--augment",
        action="store_true",
        help="translate new sources made from the training verses (joined, cut at a clause, a "
        "word dropped) rather than the verses: the verifier's behaviour on inputs it has not "
        "learnt by heart, for the drafter",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("train-drafter", help="train the NAR block drafter on distilled data")
    add_loop_arguments(p, minutes=30)
    p.add_argument("--verifier", type=Path, default=None)
    p.add_argument("--train-file", type=Path, default=None)
    p.add_argument(
        "--extra-train-file",
        type=Path,
        action="append",
        default=[],
        help="another distilled jsonl to train on too (repeatable), e.g. `distill --augment`'s",
    )
    p.add_argument("--block-size", type=int, default=25, help="k (the largest, with --min-block)")
    p.add_argument("--min-block", type=int, default=0, help="draw k per step from [MIN, k]")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    p.add_argument("--blocks-per-sentence", type=int, default=4)
    p.add_argument("--glance", type=float, default=0.0, help="GLAT glancing ratio (0: off)")
    p.add_argument(
        "--position-decay", type=float, default=1.0, help="loss weight decay**j on position j"
    )
    p.add_argument(
        "--init-drafter", type=Path, default=None, help="start from this drafter's weights"
    )
    p.add_argument(
        "--first-from-prefix",
        action="store_true",
        help="draft a block's first token from the last committed token's state, as a causal LM",
    )
    p.add_argument(
        "--lm-weight", type=float, default=0.0, help="weight of a next-token loss on the prefix"
    )
    p.add_argument(
        "--target-features",
        action="store_true",
        help="feed each committed token the verifier's last decoder state before it (EAGLE-style)",
    )
    p.add_argument("--valid-sentences", type=int, default=100)
    p.set_defaults(func=cmd_train_drafter)

    p = sub.add_parser(
        "train-assistant", help="train the small autoregressive drafter of the hf-assisted baseline"
    )
    add_loop_arguments(p, minutes=10)
    p.add_argument("--verifier", type=Path, default=None)
    p.add_argument("--train-file", type=Path, default=None)
    p.add_argument("--decoder-layers", type=int, default=1)
    p.add_argument("--valid-limit", type=int, default=0)
    p.set_defaults(func=cmd_train_assistant)

    p = sub.add_parser("export", help="gather the best models into a pair directory (fp16)")
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_export)

    p = subparsers.add_parser("translate", help="translate Spanish to English with SpecDec")
    p.add_argument("text", nargs="*", help="sentences to translate")
    p.add_argument("--file", default=None, help="one sentence per line")
    p.add_argument("--pair", default=None, help="pair directory (default: the shipped pair)")
    p.add_argument("--method", choices=("specdec", "ar"), default="specdec")
    p.add_argument(
        "--block-size",
        type=int,
        default=4,
        help="k (for the shipped pair on a 2-core CPU: 3-4 fastest at batch 1, where drafting "
        "pays)",
    )
    p.add_argument("--beta", type=int, default=1, help="1: exactly greedy; SpecDec used 5")
    p.add_argument("--tau", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--max-draft-batch",
        type=int,
        default=None,
        help=f"draft only while at most N rows of a batch are running, plain steps above (0: "
        f"always draft; default {AUTO_DRAFT_BATCH} under beta = 1, where the output is the "
        f"same, 0 under beta > 1)",
    )
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")
    p.add_argument(
        "--no-prepack", action="store_true", help="default PyTorch kernels (no oneDNN packing)"
    )
    p.add_argument(
        "--draft-precision",
        choices=DRAFT_PRECISIONS,
        default="auto",
        help="int8 (auto's choice here): an int8 copy of the drafter, cheaper drafts and the "
        "same output; fp32: the drafter as shipped",
    )
    p.set_defaults(func=cmd_translate)
