"""`specdecode seq2seq train-verifier`: a Marian-style Transformer trained on the corpus.

The recipe is SpecDec's AR verifier (fairseq `transformer` with shared embeddings, label
smoothing 0.1, Adam, inverse-square-root schedule), sized to train in hours on a small CPU:
d_model 256, 3+3 layers, 4 heads, FFN 1024, a shared 8k BPE (7.7M parameters; its BLEU is in
docs/seq2seq.md). The same loop trains the small
autoregressive assistant used by the `hf-assisted` baseline (`--decoder-layers 1`, on
distilled data).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdecode.seq2seq.corpus import read_split
from specdecode.seq2seq.tokenizer import load_tokenizer, train_tokenizer
from specdecode.seq2seq.training import (
    Checkpointer,
    Clock,
    LoopConfig,
    LoopState,
    average_snapshots,
    corpus_bleu,
    end_step,
    epoch_batches,
    inverse_sqrt,
    pad,
    snapshot_dirs,
    start_run,
)
from specdecode.training.distributed import (
    StepCallback,
    StepRecord,
    agreed_on_resume,
    global_means,
    main_object,
    new_accelerator,
    share,
    step_seed,
)


@dataclass(frozen=True)
class VerifierConfig:
    d_model: int = 256
    encoder_layers: int = 3
    decoder_layers: int = 3
    heads: int = 4
    ffn: int = 1024
    vocab_size: int = 8000
    dropout: float = 0.1
    label_smoothing: float = 0.1
    max_positions: int = 256
    max_source_tokens: int = 200  # longer verses are cut when training


@dataclass(frozen=True)
class TrainVerifierConfig:
    out: Path
    model: VerifierConfig = field(default_factory=VerifierConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    train_file: Path | None = None  # a jsonl of {"src", "tgt"}; default: the corpus train split
    tokenizer: Path | None = None  # reuse a tokenizer (the assistant must share the verifier's)
    init_from: Path | None = None  # start from a model (its first layers), e.g. the verifier
    valid_limit: int = 0  # 0: the whole validation split


def marian_config(cfg: VerifierConfig, tokenizer):
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.heads,
        decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.ffn,
        decoder_ffn_dim=cfg.ffn,
        dropout=cfg.dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=cfg.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        scale_embedding=True,
    )


def read_pairs(path: Path | None) -> tuple[list[str], list[str]]:
    if path is None:
        rows = read_split("train")
        return [v.src for v in rows], [v.tgt for v in rows]
    src, tgt = [], []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            src.append(row["src"])
            tgt.append(row["tgt"])
    return src, tgt


def init_from(model, source_dir: Path) -> None:
    """Copy every parameter whose name and shape match (a shallower decoder takes the first
    layers)."""
    from transformers import MarianMTModel

    source = MarianMTModel.from_pretrained(str(source_dir)).state_dict()
    own = model.state_dict()
    copied = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(copied, strict=False)


def translation_batches(sources: list[str], batch_size: int) -> list[list[int]]:
    """Indices of `sources` in batches of similar length (sorted by characters, ties in order).

    `translate` runs these batches; `distill` hands them out to processes whole, so that each
    sentence is translated in the same batch, with the same padding, as by one process.
    """
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def freeze_positions(model) -> None:
    """Keep the sinusoidal position tables fixed, as in a fresh model.

    Why: `from_pretrained` rebuilds them (they are not saved) with `requires_grad` on, so a
    resumed run trained and weight-decayed them, and then lost them at its next save, so its
    loss parted from that of a run never stopped right after the resume.
    """
    for name, param in model.named_parameters():
        if "embed_positions" in name:
            param.requires_grad_(False)


@torch.no_grad()
def translate_batches(
    model, tokenizer, sources: list[str], batches: list[list[int]], max_new: int = 160
) -> dict[int, str]:
    """Greedy translations of the batches' sources with `generate`: {index: text}."""
    model.eval()
    max_new = min(max_new, model.config.max_position_embeddings - 1)  # positions run out after
    out: dict[int, str] = {}
    for idx in batches:
        enc = tokenizer(
            [sources[i] for i in idx],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=model.config.max_position_embeddings,
        ).to(model.device)
        gen = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=max_new)
        for i, text in zip(idx, tokenizer.batch_decode(gen, skip_special_tokens=True), strict=True):
            out[i] = text
    model.train()
    return out


def translate(
    model, tokenizer, sources: list[str], batch_size: int = 64, max_new: int = 160
) -> list[str]:
    """Greedy translations with `generate`, in length-sorted batches (validation, distillation)."""
    batches = translation_batches(sources, batch_size)
    texts = translate_batches(model, tokenizer, sources, batches, max_new)
    return [texts[i] for i in range(len(sources))]


def validation_verses(limit: int = 0) -> list:
    """The validation split, or its first `limit` verses (0: all)."""
    valid = read_split("valid")
    return valid[:limit] if limit else valid


def valid_bleu(model, tokenizer, verses) -> float:
    """Greedy BLEU of the model on the verses: what the best verifier is chosen by."""
    return corpus_bleu(
        translate(model, tokenizer, [v.src for v in verses]), [[v.tgt for v in verses]]
    )


def save_model(model, directory: Path) -> None:
    model.save_pretrained(str(directory))


def train_verifier(
    cfg: TrainVerifierConfig, progress: bool = True, on_step: StepCallback | None = None
) -> dict:
    """Train (or resume) the verifier; returns the summary written to summary.json.

    Under `accelerate launch` each process trains on its share of every global batch
    (`specdecode.training.distributed`), and the main process alone writes the tokenizer,
    checkpoints, best model and summary. `on_step` sees each step's rows of this process and
    global loss.
    """
    from transformers import MarianMTModel

    loop = cfg.loop
    accelerator = new_accelerator()
    rank, world, main = (
        accelerator.process_index,
        accelerator.num_processes,
        accelerator.is_main_process,
    )
    out = start_run(loop, cfg.out, cfg, main)
    src_texts, tgt_texts = read_pairs(cfg.train_file)
    tok_dir = out / "tokenizer"
    if main:  # the others read the tokenizer the main process trained or copied
        if cfg.tokenizer is not None:
            load_tokenizer(cfg.tokenizer).save_pretrained(str(tok_dir))
        elif not (tok_dir / "tokenizer.json").exists():
            train_tokenizer(src_texts + tgt_texts, cfg.model.vocab_size).save_pretrained(
                str(tok_dir)
            )
    accelerator.wait_for_everyone()
    tokenizer = load_tokenizer(tok_dir)
    limit = cfg.model.max_source_tokens
    src_ids = [ids[:limit] for ids in tokenizer(src_texts)["input_ids"]]
    tgt_ids = [ids[:limit] for ids in tokenizer(tgt_texts)["input_ids"]]
    valid = validation_verses(cfg.valid_limit) if main else []

    torch.manual_seed(loop.seed)  # the same initial model on every process
    random.seed(loop.seed)
    ckpt = Checkpointer(out, loop.keep_snapshots)
    resuming = agreed_on_resume(accelerator, ckpt.exists(), ckpt.last)
    if resuming:
        model = MarianMTModel.from_pretrained(str(ckpt.last))
    else:
        model = MarianMTModel(marian_config(cfg.model, tokenizer))
        if cfg.init_from is not None:
            init_from(model, Path(cfg.init_from))
    freeze_positions(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=loop.lr, betas=(0.9, 0.98), weight_decay=loop.weight_decay
    )
    # not prepared: accelerate would step it once per process, and a step here is one global
    # batch whatever the number of processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(loop.warmup))
    state = ckpt.restore(optimizer, scheduler) if resuming else LoopState(history=[])
    state.num_processes = world
    model, optimizer = accelerator.prepare(model, optimizer)
    loss_fn = torch.nn.CrossEntropyLoss(
        ignore_index=-100, label_smoothing=cfg.model.label_smoothing, reduction="sum"
    )
    clock = Clock(loop.minutes)
    seconds_before = state.seconds
    bar = tqdm(
        desc="train-verifier", disable=not progress or not main, initial=state.step, unit="step"
    )
    model.train()
    tokens_seen = 0

    def evaluate() -> float:
        bleu = valid_bleu(accelerator.unwrap_model(model), tokenizer, valid)
        state.history.append(
            {
                "step": state.step,
                "minutes": round(state.seconds / 60, 2),
                "valid_bleu": round(bleu, 2),
            }
        )
        if bleu > state.best_score:
            state.best_score = bleu
            save_model(accelerator.unwrap_model(model), ckpt.best)
            tokenizer.save_pretrained(str(ckpt.best))
        bar.write(f"step {state.step} ({state.seconds / 60:.1f} min): valid BLEU {bleu:.2f}")
        return bleu

    def checkpoint() -> None:
        ckpt.save(accelerator.unwrap_model(model), optimizer, scheduler, state, save_model)

    pad_id = tokenizer.pad_token_id
    start_id = accelerator.unwrap_model(model).config.decoder_start_token_id
    for epoch, batch in epoch_batches([len(t) for t in tgt_ids], loop, state):
        rows, weight = share(batch, rank, world)
        torch.manual_seed(step_seed(loop.seed, state.step, rank))  # dropout
        src = pad([src_ids[i] for i in rows], pad_id).to(accelerator.device)
        labels = pad([tgt_ids[i] for i in rows], -100).to(accelerator.device)  # [b, T]
        dec_in = labels.masked_fill(labels == -100, pad_id)
        start = torch.full_like(dec_in[:, :1], start_id)
        dec_in = torch.cat([start, dec_in[:, :-1]], 1)  # shifted right
        logits = model(
            input_ids=src,
            attention_mask=(src != pad_id).long(),
            decoder_input_ids=dec_in,
        ).logits  # [b, T, vocab]
        tokens = (labels != -100).sum() * weight
        total = loss_fn(logits.flatten(0, 1), labels.flatten()) * weight
        (loss,), (value,), (count,) = global_means(accelerator, [(total, tokens)])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), loop.clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += int(count)  # of the global batch
        bar.update(1)
        rate = tokens_seen / clock.elapsed()
        bar.set_postfix(loss=f"{value:.3f}", ep=state.epoch, tok_s=f"{rate:.0f}")
        if on_step is not None:
            seen = tuple(rows) if weight else ()
            on_step(StepRecord(state.step + 1, epoch, seen, float(value)))

        if end_step(state, loop, clock, seconds_before, evaluate, checkpoint, accelerator):
            break
    bar.close()
    summary = {
        "steps": state.step,
        "minutes": round(state.seconds / 60, 2),
        "best_valid_bleu": round(state.best_score, 2),
        "history": state.history,
        "num_processes": world,
        "target_tokens_per_second_this_call": round(tokens_seen / max(clock.elapsed(), 1e-9), 1),
    }
    if main:
        tokenizer.save_pretrained(str(ckpt.last))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary = main_object(accelerator, summary)  # the main process's history, everywhere
    accelerator.wait_for_everyone()
    return summary


def average_verifier(run: Path, last: int, valid_limit: int = 0) -> dict:
    """Average the run's last `last` snapshots into `<run>/averaged`, score it on the validation
    split, and make it the run's best model when it beats the best BLEU seen in training."""
    from transformers import MarianMTModel, PreTrainedTokenizerFast

    run = Path(run)
    snapshots = snapshot_dirs(run)
    if last < 2:
        raise ValueError(f"averaging needs at least 2 snapshots, asked for {last}")
    if len(snapshots) < last:
        raise ValueError(
            f"{run} has {len(snapshots)} snapshots, fewer than the {last} asked for: train with "
            "--keep-snapshots N"
        )
    # the run's resumable state holds the bar its best model was chosen by
    state_path = run / "last" / "state.json"
    if not state_path.is_file():
        raise FileNotFoundError(
            f"{state_path} is missing: {run} is not a verifier run written by train-verifier"
        )
    averaged = average_snapshots(snapshots[-last:], run / "averaged")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(run / "last"))
    tokenizer.save_pretrained(str(averaged))
    model = MarianMTModel.from_pretrained(str(averaged))
    bleu = valid_bleu(model, tokenizer, validation_verses(valid_limit))
    state = json.loads(state_path.read_text())
    best = float(state["best_score"])
    promoted = bleu > best
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if promoted:
        save_model(model, run / "best")
        tokenizer.save_pretrained(str(run / "best"))
        summary["best_valid_bleu"] = round(bleu, 2)
        # a resumed run must beat the average to replace it
        state_path.write_text(json.dumps({**state, "best_score": bleu}, indent=1))
    attempt = {
        "snapshots": [p.name for p in snapshots[-last:]],
        "valid_bleu": round(bleu, 2),
        "best_before": best,
        "promoted_to_best": promoted,
    }
    summary["averaged"] = [*summary.get("averaged", []), attempt]  # every attempt, in order
    summary_path.write_text(json.dumps(summary, indent=1))
    return attempt
