"""Train the SpecDec++ acceptance head on examples written by `specdecode head collect`.

Its neighbours: `head_examples` reads a collection, `head_metrics` scores a head,
`head_calibration` fits a sampling head's reading of acceptance numbers, `head_replay` replays
length policies on recorded data (the preview written with every trained head).

Choices that are not obvious from the code:

* Train and validation are split by prompt, never by position (`head_examples.split_by_prompt`
  says why).
* The loss is the seed's weighted BCE with rejections weighted `reject_weight` times (default 6;
  `head_metrics` says why, and why a head trained on it under-predicts acceptance on purpose).
* With law features (the default) training has two stages. First the logistic term on the
  drafting law's standardised features is fitted alone (full batch, L-BFGS: four parameters),
  then frozen; then the residual MLP on the hidden state learns what the state adds, from a
  zero output layer. The stage-one head is recorded as epoch 0 and competes with the MLP's
  epochs. Why: on the default pair's collection (5k examples from 54 prompts) an MLP trained
  jointly with the features overfits the prompts within two epochs (validation weighted loss
  0.53-0.61), while the logistic term alone reaches 0.32 and the MLP on top of it 0.316 at a
  low learning rate (1e-4, the default) before overfitting in its turn.
* A sampling head learns, by default, the acceptance of the token actually drawn,
  min(1, p(z)/q(z)) (`label_drawn`), reading log q(z) as a fourth law feature: the policy knows
  z when it decides. `--expected-label` learns the expectation over the law instead
  (`label_sampling`), as SpecDec++'s head does. Greedy heads are unaffected (z is the argmax).
* The epoch kept is the one with the lowest validation weighted loss (the quantity trained), so
  more epochs never make the saved head worse on held-out prompts.
* `accelerate` runs the same loop on a CPU, a GPU or several processes (`accelerate launch`).
  Each epoch's order is a permutation drawn from (seed, epoch) alone, cut into global batches
  of `batch_size`; process r of N trains on rows r, r + N, ... of each, with the loss
  normalised over the whole global batch, so one step is the step a single process takes
  (`specdecode.training.distributed`). The law term is fitted identically by every process.
Validation
  runs on every process over all held-out rows, so all agree on the best epoch; the main
  process alone writes.
* Resumable at any world size: a checkpoint (`HEAD/checkpoint/`) is written after every epoch
  and when `max_steps` stops a call; it holds the step count and the data position (epoch,
  batch in epoch), which do not depend on the number of processes, and dropout is seeded by
  (seed, step, process), so nothing else needs saving. It is removed once the head is saved.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdecode.acceptance.calibration import with_number_calibration
from specdecode.acceptance.examples import LABEL_KEYS, HeadData, load_collections, split_by_prompt
from specdecode.acceptance.head import RULES, AcceptanceHead, HeadConfig, ModelIdentity
from specdecode.acceptance.metrics import (
    evaluate_predictions,
    plot_reliability,
    reliability_bins,
    weighted_bce,
    weighted_bce_terms,
)
from specdecode.acceptance.replay import PREVIEW_PRICES, preview_policies, preview_rounds
from specdecode.core.prices import Prices
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

TRAINING_FILE = "training.json"
RELIABILITY_FILE = "reliability.png"
CHECKPOINT_DIR = "checkpoint"  # inside the head's folder while a run is unfinished
CHECKPOINT_FILE = "state.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run; recorded verbatim in training.json."""

    rule: str = "greedy"  # which label to learn: "greedy" (argmax agreement) or "sampling"
    num_layers: int = 3
    width: int | None = None  # residual blocks' width (None: the drafter's hidden size)
    dropout: float = 0.1
    law_features: bool = True  # the head also reads the drafting law's features
    drawn_token: bool = True  # rule sampling: learn the drawn token's acceptance, reading its
    # log probability too (no effect under greedy, where the drawn token is the argmax)
    reject_weight: float = 6.0  # loss weight of the 'rejected' part of each label
    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-4  # of the MLP on the hidden state (the law term is fitted by L-BFGS)
    weight_decay: float = 0.01
    val_fraction: float = 0.15  # fraction of prompts (not positions) held out
    seed: int = 0
    warmup_ratio: float = 0.03  # linear warm-up over this fraction of steps, then cosine decay
    half: bool = False  # save fp16 weights: half the size of a head that ships with a project
    # the held-out preview: rounds of MIN..MAX tokens, priced by these (`Prices.stated`)
    preview_bound: tuple[int, int] = (1, 12)
    preview_prices: Prices = PREVIEW_PRICES

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width must be >= 1 (or None: the hidden size), got {self.width}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (self.reject_weight > 0 and math.isfinite(self.reject_weight)):
            raise ValueError(f"reject_weight must be a finite number > 0, got {self.reject_weight}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        low, high = self.preview_bound
        if not 1 <= low <= high:
            raise ValueError(
                f"preview_bound must be (MIN, MAX) with 1 <= MIN <= MAX, got {low, high}"
            )

    @property
    def learns_drawn(self) -> bool:
        """Whether this run learns the drawn token's acceptance (sampling, law features on)."""
        return self.drawn_token and self.law_features and self.rule == "sampling"


def fit_law_term(
    head: AcceptanceHead, features: torch.Tensor, label: torch.Tensor, reject_weight: float
) -> None:
    """Stage one: the head's logistic term on the law features, alone, then frozen.

    features [N, F], label [N]. Full-batch L-BFGS on the weighted BCE: deterministic, and exact
    enough in a few dozen iterations for a handful of parameters.
    """
    with torch.no_grad():
        head.law_mean.copy_(features.mean(0))
        head.law_std.copy_(features.std(0).clamp_min(1e-6))
    params = list(head.law.parameters())
    optimizer = torch.optim.LBFGS(params, max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = weighted_bce(head.law_term(features), label, reject_weight)
        loss.backward()
        return loss

    optimizer.step(closure)
    for p in params:
        p.requires_grad_(False)


def _cosine_with_warmup(warmup: int, total: int):
    """LR factor: linear warm-up to 1 over `warmup` steps, then cosine decay to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _nan_to_none(values: torch.Tensor) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values.tolist()]


def _new_head(data: HeadData, config: TrainConfig) -> AcceptanceHead:
    """A fresh head for the collection's pair and the run's rule and shape."""
    sampling = config.rule == "sampling"
    return AcceptanceHead(
        HeadConfig(
            hidden_size=data.hidden.shape[1],
            num_layers=config.num_layers,
            width=config.width,
            dropout=config.dropout,
            law_features=config.law_features,
            drawn_token=config.learns_drawn,
            rule=config.rule,
            temperature=float(data.meta["temperature"]) if sampling else 0.0,
            drafter=ModelIdentity(**data.meta["drafter"]),
            target=ModelIdentity(**data.meta["target"]),
        )
    )


def train_head(
    data_dir: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    config: TrainConfig | None = None,
    progress: bool = True,
    *,
    max_steps: int = 0,
    on_step: StepCallback | None = None,
) -> dict[str, Any]:
    """Train an acceptance head; save the best epoch's head, training.json and reliability.png.

    `data_dir` is one collection or several for the same pair (`load_collections`). Returns the
    record written to training.json (the same on every process). A run whose checkpoint is in
    `out_dir` resumes it, at any number of processes. `max_steps` > 0 stops this call once the
    run has taken that many steps in all, leaving the checkpoint for a later call: then the
    record says `stopped` and no head is written. `on_step` sees each step of this process.
    """
    from accelerate.utils import set_seed

    config = config or TrainConfig()
    if max_steps < 0:
        raise ValueError(f"max_steps must be >= 0 (0: no limit), got {max_steps}")
    started = time.perf_counter()
    accelerator = new_accelerator()
    rank, world, main = (
        accelerator.process_index,
        accelerator.num_processes,
        accelerator.is_main_process,
    )
    drawn = config.learns_drawn
    data_dirs = [data_dir] if isinstance(data_dir, str | Path) else list(data_dir)
    data = load_collections(data_dirs, config.rule, law=config.law_features, drawn=drawn)
    train_rows, val_rows = split_by_prompt(data.prompt_index, config.val_fraction, config.seed)
    out_dir = Path(out_dir)
    checkpoint_file = out_dir / CHECKPOINT_DIR / CHECKPOINT_FILE
    identity = _run_identity(config, data_dirs, data, train_rows)
    saved = _load_checkpoint(checkpoint_file, identity)
    agreed_on_resume(accelerator, saved is not None, checkpoint_file)

    set_seed(config.seed)  # the same initial head on every process
    head = _new_head(data, config)
    # features [N, 3 or 4], or [N, 0] for a head without them (an empty input changes nothing)
    features = (
        data.features if data.features is not None else data.hidden.new_zeros(len(data.hidden), 0)
    )
    if saved is not None:
        head.load_state_dict(saved["model"])
        if head.reads_law:
            for p in head.law.parameters():
                p.requires_grad_(False)
    elif head.reads_law:
        assert data.features is not None
        fit_law_term(head, data.features[train_rows], data.label[train_rows], config.reject_weight)
    device = accelerator.device
    train_hidden, train_law = data.hidden[train_rows].to(device), features[train_rows].to(device)
    train_label = data.label[train_rows].to(device)
    val_hidden, val_law = data.hidden[val_rows].to(device), features[val_rows].to(device)
    val_label = data.label[val_rows]  # [V]
    trainable = [p for p in head.parameters() if p.requires_grad]  # the law term is fitted
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(train_rows) / config.batch_size)  # global batches
    total_steps = config.epochs * steps_per_epoch
    warmup = int(config.warmup_ratio * total_steps)
    # not prepared: accelerate would step it once per process; a step is one global batch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _cosine_with_warmup(warmup, total_steps)
    )
    model, optimizer = accelerator.prepare(head, optimizer)
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])

    loop: dict[str, Any] = (
        saved["loop"]
        if saved is not None
        else {"step": 0, "epoch": 1, "batch": 0, "loss_sum": 0.0, "batches": 0, "seconds": 0.0}
    )
    seconds_before = float(loop["seconds"])  # of the calls before this one
    history: list[dict[str, Any]] = saved["history"] if saved is not None else []
    best: dict[str, Any] | None = saved["best"] if saved is not None else None
    best_state: dict[str, torch.Tensor] | None = saved["best_state"] if saved else None
    # (probabilities, labels) [V] of the best epoch
    best_val: tuple[torch.Tensor, torch.Tensor] | None = saved["best_val"] if saved else None
    bar = tqdm(
        total=total_steps,
        initial=loop["step"],
        desc="head train",
        unit="step",
        disable=not progress or not accelerator.is_local_main_process,
    )

    def consider(epoch: int, train_loss: float | None) -> None:
        """Validate the model as it is now; keep it if it is the best so far."""
        nonlocal best, best_state, best_val
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.eval()
        with torch.no_grad():  # all held-out rows on every process: they agree on the best
            val_logits = torch.cat(
                [
                    unwrapped(h, f).float().cpu()
                    for h, f in zip(val_hidden.split(4096), val_law.split(4096), strict=True)
                ]
            )  # [V]
        metrics = evaluate_predictions(val_logits, val_label, config.rule, config.reject_weight)
        record = {
            "epoch": epoch,
            "train_loss": train_loss,
            **metrics,
            "lr": scheduler.get_last_lr()[0] if epoch else None,
        }
        history.append(record)
        if best is None or metrics["val_loss"] < best["val_loss"]:
            best = record
            best_state = {k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items()}
            best_val = (torch.sigmoid(val_logits), val_label.float())
        if progress and accelerator.is_local_main_process:
            tqdm.write(_epoch_line(record))

    def checkpoint() -> None:
        """The run so far, written by the main process (every process has the same)."""
        if main:
            _save_checkpoint(
                checkpoint_file,
                {
                    "identity": identity,
                    "model": {
                        k: v.detach().cpu()
                        for k, v in accelerator.unwrap_model(model).state_dict().items()
                    },
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "loop": {**loop, "seconds": seconds_before + time.perf_counter() - started},
                    "history": history,
                    "best": best,
                    "best_state": best_state,
                    "best_val": best_val,
                    "num_processes": world,
                },
            )
        accelerator.wait_for_everyone()

    if saved is None and head.reads_law:
        consider(0, None)  # the law term alone, before the MLP adds anything
    stopped = False
    loss_sum = torch.tensor(float(loop["loss_sum"]), device=device)
    while loop["epoch"] <= config.epochs:
        epoch = loop["epoch"]
        shuffle = torch.Generator().manual_seed(step_seed(config.seed, epoch))
        order = torch.randperm(len(train_rows), generator=shuffle)  # this epoch's order
        model.train()
        for b in range(loop["batch"], steps_per_epoch):
            if max_steps and loop["step"] >= max_steps:
                stopped = True
                break
            batch = order[b * config.batch_size : (b + 1) * config.batch_size].tolist()
            rows, weight = share(batch, rank, world)
            index = torch.tensor(rows, device=device)
            torch.manual_seed(step_seed(config.seed, loop["step"], rank))  # dropout
            logits = model(train_hidden[index], train_law[index])  # [b]
            num, den = weighted_bce_terms(logits, train_label[index], config.reject_weight)
            (loss,), values, _ = global_means(
                accelerator, [(num.sum() * weight, den.sum() * weight)]
            )
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            loss_sum += values[0]
            loop.update(step=loop["step"] + 1, batch=b + 1, batches=loop["batches"] + 1)
            bar.update(1)
            if not bar.disable and loop["batches"] % 10 == 1:  # a GPU syncs: not every step
                bar.set_postfix(epoch=epoch, loss=f"{float(values[0]):.4f}")
            if on_step is not None:
                seen = tuple(int(train_rows[i]) for i in rows) if weight else ()
                on_step(StepRecord(loop["step"], epoch, seen, float(values[0])))
        loop["loss_sum"] = float(loss_sum)
        if stopped:
            break
        consider(epoch, loop["loss_sum"] / max(1, loop["batches"]))
        loss_sum.zero_()
        loop.update(epoch=epoch + 1, batch=0, loss_sum=0.0, batches=0)
        if loop["epoch"] <= config.epochs:
            checkpoint()
    bar.close()
    if stopped:
        checkpoint()
        return {
            "stopped": True,
            "step": loop["step"],
            "total_steps": total_steps,
            "epoch": loop["epoch"],
            "batch_in_epoch": loop["batch"],
            "num_processes": world,
            "checkpoint": str(checkpoint_file.parent),
            "epochs": history,
        }
    assert best is not None and best_state is not None and best_val is not None

    result: dict[str, Any] | None = None
    if main:
        final = AcceptanceHead(head.config)  # a clean CPU copy, free of accelerate's wrappers
        final.load_state_dict(best_state)
        number = None
        if drawn:  # the label is the drawn token's min(1, p/q): calibrate against the number
            final, number = with_number_calibration(
                final, data, train_rows, val_rows, config.reject_weight, config.seed
            )
        result = {
            "config": asdict(config),
            **_data_record(data, data_dirs, train_rows, val_rows, config),
            "head": asdict(final.config),
            "epochs": history,
            "best_epoch": best["epoch"],
            "best": best,
            "reliability": _reliability_record(*best_val),
            "number_calibration": number,
            "policy_preview": _preview(data, val_rows, *best_val, config),
            "preview_kind": "rounds" if data.round is not None else "responses",
            "device": str(accelerator.device),
            "num_processes": world,
            "steps": loop["step"],
            "head_dir": str(out_dir),
        }
        final.save(out_dir, torch.float16 if config.half else None)
        title = f"{config.rule} head (reject weight {config.reject_weight:g}), val"
        result["reliability_plot"] = plot_reliability(
            *best_val, out_dir / RELIABILITY_FILE, title_prefix=title
        )
        result["seconds"] = seconds_before + time.perf_counter() - started
        (out_dir / TRAINING_FILE).write_text(json.dumps(result, indent=1) + "\n")
        shutil.rmtree(checkpoint_file.parent, ignore_errors=True)  # the head is saved
    result = main_object(accelerator, result)
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return result


def _run_identity(
    config: TrainConfig,
    data_dirs: Sequence[str | Path],
    data: HeadData,
    train_rows: torch.Tensor,
) -> dict[str, Any]:
    """What a checkpoint must share with the call that resumes it: the settings and the data."""
    return {
        "config": asdict(config),
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "examples": int(data.hidden.shape[0]),
        "train_examples": int(train_rows.numel()),
    }


def _load_checkpoint(path: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint at `path`, if any; refused when written for other settings or data."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=False, map_location="cpu")
    if saved["identity"] != identity:
        theirs, ours = saved["identity"], identity
        differ = sorted(
            [k for k in ours["config"] if theirs["config"].get(k) != ours["config"][k]]
            + [k for k in ("data", "examples", "train_examples") if theirs.get(k) != ours[k]]
        )
        raise ValueError(
            f"{path.parent} holds a run with other settings or data ({', '.join(differ)}): "
            "train with the same ones to resume it, or delete it to start afresh"
        )
    return saved


def _save_checkpoint(path: Path, blob: dict[str, Any]) -> None:
    """Written whole or not at all: to a temporary file, then renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def _data_record(
    data: HeadData,
    data_dirs: Sequence[str | Path],
    train_rows: torch.Tensor,
    val_rows: torch.Tensor,
    config: TrainConfig,
) -> dict[str, Any]:
    """What training.json says of the data: its source, the split, the labels' base rates and
    what a constant head scores on them."""
    prompts = data.prompt_index
    return {
        "data": {
            "dirs": [str(Path(d).resolve()) for d in data_dirs],
            "examples": int(data.hidden.shape[0]),
            "hidden_size": int(data.hidden.shape[1]),
            "prompts": int(torch.unique(prompts).numel()),
            "meta": data.meta,
        },
        "split": {
            "train_examples": int(train_rows.numel()),
            "val_examples": int(val_rows.numel()),
            "train_prompts": torch.unique(prompts[train_rows]).tolist(),
            "val_prompts": torch.unique(prompts[val_rows]).tolist(),
        },
        "label_base_rate": {
            "label": "label_drawn" if config.learns_drawn else LABEL_KEYS[config.rule],
            "train": float(data.label[train_rows].mean()),
            "val": float(data.label[val_rows].mean()),
            "greedy_all": float(data.label_greedy.mean()),
        },
        # What a head that ignores the hidden state would score: the train base rate, constant.
        "constant_baseline": _constant_baseline(data, train_rows, val_rows, config),
    }


def _reliability_record(pred: torch.Tensor, label: torch.Tensor) -> dict[str, Any]:
    """The reliability diagram's bins, as training.json keeps them (empty bins as null)."""
    mean_pred, mean_label, counts = reliability_bins(pred, label)
    return {
        "bins": int(counts.numel()),
        "mean_pred": _nan_to_none(mean_pred),
        "mean_label": _nan_to_none(mean_label),
        "counts": counts.tolist(),
    }


def _preview(
    data: HeadData,
    val_rows: torch.Tensor,
    pred: torch.Tensor,
    label: torch.Tensor,
    config: TrainConfig,
) -> dict[str, dict[str, Any]] | None:
    """The held-out preview: round by round for a collection inside rounds, else replayed
    along each response."""
    bound, costs = config.preview_bound, config.preview_prices
    if data.round is not None and data.slot is not None:
        return preview_rounds(
            pred.cpu(),
            label.cpu(),
            data.prompt_index[val_rows],
            data.position[val_rows],
            data.round[val_rows],
            data.slot[val_rows],
            bound,
            costs,
        )
    if data.position is None:
        return None
    return preview_policies(
        pred.cpu(), label.cpu(), data.prompt_index[val_rows], data.position[val_rows], bound, costs
    )


def _constant_baseline(
    data: HeadData, train_rows: torch.Tensor, val_rows: torch.Tensor, config: TrainConfig
) -> dict[str, float | None]:
    rate = float(data.label[train_rows].mean().clamp(1e-6, 1 - 1e-6))
    val_label = data.label[val_rows]  # [V]
    logits = torch.full_like(val_label, math.log(rate / (1 - rate)), dtype=torch.float64)
    metrics = evaluate_predictions(logits, val_label, config.rule, config.reject_weight)
    return {k: metrics[k] for k in ("val_loss", "val_bce", "val_ece")}


def _epoch_line(record: dict[str, Any]) -> str:
    train = record["train_loss"]
    parts = [f"epoch {record['epoch']}", "law term only" if train is None else f"train {train:.4f}"]
    parts += [f"val {record['val_loss']:.4f}", f"bce {record['val_bce']:.4f}"]
    parts.append(f"ece {record['val_ece']:.3f}")
    if record.get("val_auc") is not None:
        parts.append(f"auc {record['val_auc']:.3f}")
    return "  ".join(parts)
