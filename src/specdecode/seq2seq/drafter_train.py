"""`specdecode seq2seq train-drafter`: the block objective on distilled data.

Each training sentence contributes `blocks_per_sentence` random block positions s: the drafter
sees the prefix tgt[:s] (after the decoder start token) plus k mask queries and predicts
tgt[s : s + k] at once (positions past the end of the sentence are ignored), with label smoothing
0.1, as SpecDec's block objective. The verifier's encoder is frozen and shared (see
`block_drafter`), so a step is one encoder forward without gradients and one drafter
forward/backward.

Glancing (GLAT, which SpecDec's code builds on): with `glance > 0`, a first pass predicts the
block, then a fraction (glance x the share of wrong tokens) of the query slots is replaced by the
reference tokens, and the loss is taken on the remaining slots. It teaches the drafter the
dependencies inside a block; `--glance 0` trains the plain objective, so the two can be compared.

With `first_from_prefix` the block's first token is read from the last prefix slot, and
`lm_weight > 0` adds a next-token loss at every prefix slot (`next_token_loss`): the first drafted
token decides whether a round gains anything, and this trains it at every position of every
sentence rather than at the few sampled block starts.

The model kept is the one with the most tokens per verifier call on validation sentences,
measured by decoding them with SpecDec (beta = 1), the figure speed depends on.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdecode.seq2seq.block_drafter import BlockDrafter, BlockDrafterConfig, init_from_verifier
from specdecode.seq2seq.corpus import read_split
from specdecode.seq2seq.training import (
    Checkpointer,
    Clock,
    LoopConfig,
    LoopState,
    end_step,
    epoch_batches,
    inverse_sqrt,
    pad,
    start_run,
)
from specdecode.seq2seq.verifier_train import read_pairs
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
class TrainDrafterConfig:
    verifier: Path  # a save_pretrained verifier directory (with its tokenizer)
    train_file: Path  # distilled jsonl of {"src", "tgt"}
    out: Path
    extra_train_files: tuple[Path, ...] = ()  # more distilled jsonl (`distill --augment`'s)
    block_size: int = 25
    min_block: int = 0  # > 0: each step draws its k from [min_block, block_size]
    layers: int = 2
    blocks_per_sentence: int = 4
    glance: float = 0.0  # GLAT glancing ratio; 0 disables
    position_decay: float = 1.0  # loss weight decay**j on block position j; 1: all equal
    # start from this drafter (e.g. one for an older verifier); its first `layers` layers
    init_drafter: Path | None = None
    first_from_prefix: bool = False  # the block's first token from the last prefix slot
    lm_weight: float = 0.0  # > 0: plus a next-token loss at every prefix slot, this weighted
    target_features: bool = False  # the drafter also reads the verifier's last decoder states
    label_smoothing: float = 0.1
    dropout: float | None = None  # a fresh drafter's dropout (None: BlockDrafterConfig's)
    valid_sentences: int = 100
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(lr=5e-4, warmup=300, max_tokens=2048, weight_decay=0.01)
    )

    def __post_init__(self) -> None:
        if not 0 <= self.min_block <= self.block_size or self.block_size < 1:
            raise ValueError(
                f"need 0 <= min_block <= block_size and block_size >= 1, got min_block "
                f"{self.min_block}, block_size {self.block_size}"
            )
        if not 0 <= self.glance <= 1:
            raise ValueError(f"glance must be in [0, 1], got {self.glance}")
        if not 0 < self.position_decay <= 1:
            raise ValueError(f"position_decay must be in (0, 1], got {self.position_decay}")
        if not self.lm_weight >= 0:
            raise ValueError(f"lm_weight must be >= 0, got {self.lm_weight}")
        if self.glance > 0 and self.first_from_prefix:
            raise ValueError(
                "glancing reveals query slots, and a drafter reading its first token from the "
                "prefix has no query there: use --glance 0 with --first-from-prefix"
            )
        if self.layers < 1 or self.blocks_per_sentence < 1:
            raise ValueError("layers and blocks_per_sentence must be >= 1")


def sample_blocks(
    targets: list[list[int]], k: int, per_sentence: int, rng: random.Random
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Random block starts s per sentence (the block follows start token + tgt[:s]) and their
    labels tgt[s : s + k], positions past the sentence's end ignored (-100)."""
    starts, labels = [], []
    for tgt in targets:
        row_starts = [rng.randrange(len(tgt)) for _ in range(per_sentence)]
        starts.append(row_starts)
        labels.append([tgt[s : s + k] + [-100] * (k - len(tgt[s : s + k])) for s in row_starts])
    return starts, labels


def glance_inputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ratio: float,
    generator: torch.Generator | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLAT: reveal some reference tokens, more where the first pass was wrong.

    logits [n, k, vocab], labels [n, k] -> reveal [n, k] bool (slots given the reference),
    loss_labels [n, k] (revealed slots ignored). The random order among a row's slots comes
    from `scores` [n, k] in [0, 1) when given (drawn for the whole global batch, so that a
    process's rows get the same draws as in a single process), else from `generator`.
    """
    valid = labels != -100
    wrong = ((logits.argmax(-1) != labels) & valid).sum(1)  # [n]
    n_reveal = (wrong.float() * ratio).long()  # [n]
    if scores is None:
        scores = torch.rand(labels.shape, generator=generator)
    scores = scores.to(labels.device).masked_fill(~valid, 2.0)
    rank = scores.argsort(1).argsort(1)  # [n, k] random order among valid slots
    reveal = rank < n_reveal[:, None]
    return reveal, labels.masked_fill(reveal, -100)


def block_loss_terms(
    logits: torch.Tensor, labels: torch.Tensor, decay: float, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over a block's positions, position j weighted decay**j, as (weighted sum,
    sum of weights): their ratio is the loss, and several processes add both up first.

    Why weights: a draft is accepted up to its first miss, so position j only counts when the
    j before it were right, and its worth falls about geometrically with j. An equal-weight loss
    over blocks of up to 25 spends most of its gradient on far positions that are rarely
    reached, while the first one, which every round's gain hangs on, gets 1/k of it.

    logits [..., k, vocab], labels [..., k] (-100: ignored) -> (scalar, scalar)
    """
    k = labels.shape[-1]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=label_smoothing,
        reduction="none",
    ).view(labels.shape)
    weights = decay ** torch.arange(k, dtype=losses.dtype, device=losses.device)  # [k]
    weights = weights * (labels != -100)  # [..., k]
    return (losses * weights).sum(), weights.sum()


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, decay: float, label_smoothing: float
) -> torch.Tensor:
    """`block_loss_terms` as one mean: the loss of one process's batch (scalar)."""
    total, weight = block_loss_terms(logits, labels, decay, label_smoothing)
    return total / weight.clamp(min=1e-9)


def next_token_loss_terms(
    prefix_logits: torch.Tensor, targets: torch.Tensor, lens: torch.Tensor, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of every prefix slot's prediction of the token after it (a causal LM's
    loss), as (sum, number of slots scored).

    prefix_logits [b, T, vocab], targets [b, T] (start token first), lens [b] -> (scalar, scalar)
    """
    t = targets.shape[1]
    labels = targets[:, 1:].masked_fill(
        torch.arange(1, t, device=targets.device) >= lens[:, None], -100
    )  # [b, T - 1]: slot i predicts targets[:, i + 1]
    total = torch.nn.functional.cross_entropy(
        prefix_logits[:, :-1].reshape(-1, prefix_logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    return total, (labels != -100).sum()


def next_token_loss(
    prefix_logits: torch.Tensor, targets: torch.Tensor, lens: torch.Tensor, label_smoothing: float
) -> torch.Tensor:
    """`next_token_loss_terms` as one mean (scalar)."""
    total, count = next_token_loss_terms(prefix_logits, targets, lens, label_smoothing)
    return total / count.clamp(min=1)


def verifier_states(
    verifier: torch.nn.Module,
    encoder_states: torch.Tensor,  # [b, S, d]
    encoder_mask: torch.Tensor,  # [b, S]
    targets: torch.Tensor,  # [b, T]: decoder start token, then the sentence, right-padded
) -> torch.Tensor:
    """The verifier's last decoder states, teacher-forced, one slot on: [b, T, d].

    Slot i holds the state at i - 1, whose logits chose token i (slot 0, the start token, holds
    zeros), the layout the drafter meets at inference (`NARDrafter`). Right padding is harmless:
    the decoder is causal, so padded slots change no state before them. Slots past the
    verifier's position table (which no output of it reaches) hold zeros too.
    """
    t = targets.shape[1]
    reach = min(t - 1, getattr(verifier.config, "max_position_embeddings", t))
    if reach == 0:  # the start token alone: no state precedes it
        return encoder_states.new_zeros(targets.shape[0], t, verifier.config.d_model)
    with torch.no_grad():
        out = verifier(
            encoder_outputs=(encoder_states,),
            attention_mask=encoder_mask,
            decoder_input_ids=targets[:, :reach],
            output_hidden_states=True,
            use_cache=False,
        )
    states = out.decoder_hidden_states[-1]  # [b, reach, d]
    before = torch.zeros_like(states[:, :1])
    after = states.new_zeros(states.shape[0], t - 1 - reach, states.shape[2])
    return torch.cat([before, states, after], 1)  # [b, T, d]


def train_drafter(
    cfg: TrainDrafterConfig, progress: bool = True, on_step: StepCallback | None = None
) -> dict:
    """Train (or resume) the block drafter; returns the summary written to summary.json.

    Under `accelerate launch` each process trains on its share of every global batch; the
    step's random draws that choose what is trained (k, block starts, glancing) are made for
    the whole batch from (seed, step), so they are those of a single process
    (`specdecode.training.distributed`). The main process alone evaluates and writes.
    """
    from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

    from specdecode.seq2seq.api import TranslationPair

    loop = cfg.loop
    accelerator = new_accelerator()
    rank, world, main = (
        accelerator.process_index,
        accelerator.num_processes,
        accelerator.is_main_process,
    )
    out = start_run(loop, cfg.out, cfg, main)
    # float32 whatever the saved dtype: a shipped pair is fp16, and the drafter trains in fp32
    verifier = AutoModelForSeq2SeqLM.from_pretrained(str(cfg.verifier), dtype=torch.float32)
    verifier = verifier.eval()
    for p in verifier.parameters():
        p.requires_grad_(False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cfg.verifier))
    src_texts, tgt_texts = read_pairs(cfg.train_file)
    for extra in cfg.extra_train_files:
        more_src, more_tgt = read_pairs(extra)
        src_texts, tgt_texts = src_texts + more_src, tgt_texts + more_tgt
    src_ids = [ids[:200] for ids in tokenizer(src_texts)["input_ids"]]
    tgt_ids = [ids[:200] for ids in tokenizer(tgt_texts)["input_ids"]]
    valid_src = [v.src for v in read_split("valid")[: cfg.valid_sentences]] if main else []
    start_id = verifier.config.decoder_start_token_id
    mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise ValueError("the verifier's tokenizer has no mask token; the drafter needs one")

    torch.manual_seed(loop.seed)  # the same initial drafter on every process
    accelerator.wait_for_everyone()  # the main process has made the folder
    ckpt = Checkpointer(out, loop.keep_snapshots)
    extra = {} if cfg.dropout is None else {"dropout": cfg.dropout}
    model_cfg = BlockDrafterConfig(
        vocab_size=verifier.config.vocab_size,
        d_model=verifier.config.d_model,
        layers=cfg.layers,
        heads=verifier.config.decoder_attention_heads,
        ffn=verifier.config.decoder_ffn_dim,
        block_size=cfg.block_size,
        pad_id=verifier.config.pad_token_id,
        mask_id=mask_id,
        scale_embedding=bool(getattr(verifier.config, "scale_embedding", True)),
        first_from_prefix=cfg.first_from_prefix,
        target_features=verifier.config.d_model if cfg.target_features else 0,
        **extra,
    )
    resuming = agreed_on_resume(accelerator, ckpt.exists(), ckpt.last)
    if resuming:
        drafter = BlockDrafter.load(ckpt.last).train()
    elif cfg.init_drafter is not None:
        drafter = BlockDrafter.load(cfg.init_drafter)
        drafter = drafter.reading_first_from_prefix(cfg.first_from_prefix)
        drafter = drafter.reading_target_states(model_cfg.target_features)
        drafter = drafter.keeping_layers(cfg.layers).train()
        if (
            drafter.cfg.vocab_size != model_cfg.vocab_size
            or drafter.cfg.d_model != model_cfg.d_model
        ):
            raise ValueError(
                f"{cfg.init_drafter} is a drafter of vocabulary {drafter.cfg.vocab_size} and "
                f"width {drafter.cfg.d_model}; this verifier needs {model_cfg.vocab_size} and "
                f"{model_cfg.d_model}"
            )
    else:
        drafter = BlockDrafter(model_cfg)
        init_from_verifier(drafter, verifier)
    optimizer = torch.optim.AdamW(
        drafter.parameters(),
        lr=loop.lr,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=loop.weight_decay,
    )
    # not prepared: accelerate would step it once per process; a step is one global batch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(loop.warmup))
    state = ckpt.restore(optimizer, scheduler) if resuming else LoopState(history=[])
    state.num_processes = world
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    verifier.to(accelerator.device)
    pair = TranslationPair(verifier, tokenizer, None)
    clock = Clock(loop.minutes)
    seconds_before = state.seconds
    bar = tqdm(
        desc="train-drafter", disable=not progress or not main, initial=state.step, unit="step"
    )
    k = cfg.block_size
    device = accelerator.device

    def evaluate() -> float:
        model = accelerator.unwrap_model(drafter)
        model.eval()
        pair.drafter = model
        # every round drafts: the figure is tokens per verifier call of the drafter's rounds
        result = pair.translate(valid_src, block_size=k, batch_size=32, max_draft_batch=None)
        model.train()
        figure = result.stats.total.tokens_per_target_call
        state.history.append(
            {
                "step": state.step,
                "minutes": round(state.seconds / 60, 2),
                "valid_tokens_per_verifier_call": round(figure, 3),
            }
        )
        if figure > state.best_score:
            state.best_score = figure
            model.save(ckpt.best)
        minutes = state.seconds / 60
        bar.write(f"step {state.step} ({minutes:.1f} min): {figure:.3f} tokens/verifier call")
        return figure

    drafter.train()
    if not resuming and main:
        evaluate()  # the initialised drafter, before any training

    def checkpoint() -> None:
        ckpt.save(accelerator.unwrap_model(drafter), optimizer, scheduler, state, _save)

    for epoch, batch in epoch_batches([len(t) for t in tgt_ids], loop, state):
        # the draws that choose what is trained: for the global batch, from (seed, step)
        rng = random.Random(step_seed(loop.seed, state.step))
        k_step = rng.randint(cfg.min_block, k) if cfg.min_block else k
        all_starts, all_labels = sample_blocks(
            [tgt_ids[i] for i in batch], k_step, cfg.blocks_per_sentence, rng
        )
        rows, weight = share(batch, rank, world)
        place = {row: j for j, row in enumerate(batch)}
        at = [place[i] for i in rows]  # the rows' places in the global batch
        torch.manual_seed(step_seed(loop.seed, state.step, rank))  # dropout
        src = pad([src_ids[i] for i in rows], tokenizer.pad_token_id).to(device)
        src_mask = (src != tokenizer.pad_token_id).long()
        with torch.no_grad():
            enc = verifier.get_encoder()(input_ids=src, attention_mask=src_mask).last_hidden_state
        batch_targets = [tgt_ids[i] for i in rows]
        targets = pad([[start_id, *t] for t in batch_targets], tokenizer.pad_token_id)
        targets = targets.to(device)  # [b, T]
        lens = torch.tensor([len(t) + 1 for t in batch_targets], device=device)
        starts_t = torch.tensor([all_starts[j] for j in at], device=device)  # [b, B]
        labels_t = torch.tensor([all_labels[j] for j in at], device=device)  # [b, B, k]
        blocks = (targets, lens, enc, src_mask, k_step)
        features = (
            verifier_states(verifier, enc, src_mask, targets) if cfg.target_features else None
        )
        if cfg.glance > 0:
            glance = torch.Generator().manual_seed(step_seed(loop.seed, state.step))
            per_row = cfg.blocks_per_sentence
            scores = torch.rand(len(batch), per_row, k_step, generator=glance)[at]  # [b, B, k]
            with torch.no_grad():
                first = drafter(*blocks, starts=starts_t, features=features)  # [b, B, k, V]
            reveal, loss_labels = glance_inputs(
                first.flatten(0, 1), labels_t.flatten(0, 1), cfg.glance, scores=scores.flatten(0, 1)
            )
            given = labels_t.flatten(0, 1).masked_fill(~reveal, mask_id)  # reference if revealed
            logits = drafter(*blocks, given.view_as(labels_t), starts=starts_t, features=features)
            loss_labels = loss_labels.view_as(labels_t)
        elif cfg.lm_weight > 0:
            loss_labels = labels_t
            logits, prefix_logits = drafter(
                *blocks, starts=starts_t, prefix_logits=True, features=features
            )
        else:
            loss_labels = labels_t
            logits = drafter(*blocks, starts=starts_t, features=features)  # [b, B, k, vocab]
        total, count = block_loss_terms(
            logits, loss_labels, cfg.position_decay, cfg.label_smoothing
        )
        terms = [(total * weight, count * weight)]
        if cfg.lm_weight > 0:
            lm_total, lm_count = next_token_loss_terms(
                prefix_logits, targets, lens, cfg.label_smoothing
            )
            terms.append((lm_total * weight, lm_count * weight))
        losses, values, _ = global_means(accelerator, terms)
        loss = losses[0] + cfg.lm_weight * losses[1] if cfg.lm_weight > 0 else losses[0]
        value = values[0] + cfg.lm_weight * values[1] if cfg.lm_weight > 0 else values[0]
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(drafter.parameters(), 5.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}", ep=state.epoch)
        if on_step is not None:
            on_step(StepRecord(state.step + 1, epoch, tuple(rows) if weight else (), float(value)))

        if end_step(state, loop, clock, seconds_before, evaluate, checkpoint, accelerator):
            break
    bar.close()
    summary = {
        "steps": state.step,
        "minutes": round(state.seconds / 60, 2),
        "best_valid_tokens_per_verifier_call": round(state.best_score, 3),
        "history": state.history,
        "num_processes": world,
    }
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary = main_object(accelerator, summary)  # the main process's history, everywhere
    accelerator.wait_for_everyone()
    return summary


def _save(model, directory: Path) -> None:
    model.save(directory)
