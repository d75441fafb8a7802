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
* `accelerate` runs the same loop on a CPU, a GPU or several processes; the DataLoader shuffle
  uses its own seeded generator (which accelerate keeps in sync across processes), and
  `set_seed` fixes initialisation and dropout, so one seed gives one head.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from specdecode.acceptance.calibration import with_number_calibration
from specdecode.acceptance.examples import LABEL_KEYS, HeadData, load_collections, split_by_prompt
from specdecode.acceptance.head import RULES, AcceptanceHead, HeadConfig, ModelIdentity
from specdecode.acceptance.metrics import (
    evaluate_predictions,
    plot_reliability,
    reliability_bins,
    weighted_bce,
)
from specdecode.acceptance.replay import PreviewCosts, preview_policies, preview_rounds

TRAINING_FILE = "training.json"
RELIABILITY_FILE = "reliability.png"


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
    # the held-out preview: rounds of MIN..MAX tokens, priced by `PreviewCosts`
    preview_bound: tuple[int, int] = (1, 12)
    preview_costs: PreviewCosts = field(default_factory=PreviewCosts)  # checks its own values

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
) -> dict[str, Any]:
    """Train an acceptance head; save the best epoch's head, training.json and reliability.png.

    `data_dir` is one collection or several for the same pair (`load_collections`). Returns the
    record written to training.json.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    config = config or TrainConfig()
    started = time.perf_counter()
    drawn = config.learns_drawn
    data_dirs = [data_dir] if isinstance(data_dir, str | Path) else list(data_dir)
    data = load_collections(data_dirs, config.rule, law=config.law_features, drawn=drawn)
    train_rows, val_rows = split_by_prompt(data.prompt_index, config.val_fraction, config.seed)

    accelerator = Accelerator()
    set_seed(config.seed)
    head = _new_head(data, config)
    # features [N, 3 or 4], or [N, 0] for a head without them (an empty input changes nothing)
    features = (
        data.features if data.features is not None else data.hidden.new_zeros(len(data.hidden), 0)
    )
    if head.reads_law:
        assert data.features is not None
        fit_law_term(head, data.features[train_rows], data.label[train_rows], config.reject_weight)
    train_set = TensorDataset(data.hidden[train_rows], features[train_rows], data.label[train_rows])
    val_set = TensorDataset(data.hidden[val_rows], features[val_rows], data.label[val_rows])
    shuffle = torch.Generator().manual_seed(config.seed)
    train_loader = DataLoader(
        train_set, batch_size=config.batch_size, shuffle=True, generator=shuffle
    )
    val_loader = DataLoader(val_set, batch_size=max(config.batch_size, 1024))
    trainable = [p for p in head.parameters() if p.requires_grad]  # the law term is fitted
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    # Counted on the unsplit loader: accelerate steps a prepared scheduler once per process.
    total_steps = config.epochs * len(train_loader)
    warmup = int(config.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _cosine_with_warmup(warmup, total_steps)
    )
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        head, optimizer, train_loader, val_loader, scheduler
    )

    history: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    best_state: dict[str, torch.Tensor] | None = None
    best_val: tuple[torch.Tensor, torch.Tensor] | None = None  # (probabilities, labels) [V]
    bar = tqdm(
        total=config.epochs * len(train_loader),
        desc="head train",
        unit="step",
        disable=not progress or not accelerator.is_local_main_process,
    )

    def consider(epoch: int, train_loss: float | None) -> None:
        """Validate the model as it is now; keep it if it is the best so far."""
        nonlocal best, best_state, best_val
        model.eval()
        logits_parts, label_parts = [], []
        with torch.no_grad():
            for hidden, law, label in val_loader:
                logits, label = accelerator.gather_for_metrics((model(hidden, law), label))
                logits_parts.append(logits.float().cpu())
                label_parts.append(label.float().cpu())
        val_logits = torch.cat(logits_parts)  # [V]
        val_label = torch.cat(label_parts)  # [V]
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
            unwrapped = accelerator.unwrap_model(model)
            best_state = {k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items()}
            best_val = (torch.sigmoid(val_logits), val_label)
        if progress and accelerator.is_local_main_process:
            tqdm.write(_epoch_line(record))

    if head.reads_law:
        consider(0, None)  # the law term alone, before the MLP adds anything
    for epoch in range(1, config.epochs + 1):
        model.train()
        loss_sum = torch.zeros((), device=accelerator.device)
        batches = 0
        for hidden, law, label in train_loader:  # [B, H], [B, F or 0], [B]
            loss = weighted_bce(model(hidden, law), label, config.reject_weight)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
            batches += 1
            bar.update(1)
            if not bar.disable and batches % 10 == 1:  # .item() syncs a GPU: not every step
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.4f}")
        train_loss = accelerator.reduce(loss_sum / max(1, batches), reduction="mean")

        consider(epoch, float(train_loss))
    bar.close()
    assert best is not None and best_state is not None and best_val is not None

    final = AcceptanceHead(head.config)  # a clean CPU copy, free of accelerate's wrappers
    final.load_state_dict(best_state)
    number = None
    if drawn:  # the label is the drawn token's min(1, p/q): calibrate against the number too
        final, number = with_number_calibration(
            final, data, train_rows, val_rows, config.reject_weight, config.seed
        )
    out_dir = Path(out_dir)
    result: dict[str, Any] = {
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
        "num_processes": accelerator.num_processes,
        "head_dir": str(out_dir),
    }
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final.save(out_dir, torch.float16 if config.half else None)
        title = f"{config.rule} head (reject weight {config.reject_weight:g}), val"
        result["reliability_plot"] = plot_reliability(
            *best_val, out_dir / RELIABILITY_FILE, title_prefix=title
        )
    result["seconds"] = time.perf_counter() - started
    if accelerator.is_main_process:
        (out_dir / TRAINING_FILE).write_text(json.dumps(result, indent=1) + "\n")
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return result


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
    bound, costs = config.preview_bound, config.preview_costs
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
