"""Scores of an acceptance head on held-out examples: the loss it trains on, calibration, ranking.

The loss is the seed's weighted BCE, ``-(y log s + w (1 - y) log(1 - s)) / sum(y + w (1 - y))``
with ``w = reject_weight``. A missed rejection (drafting on past a token the target rejects)
wastes a whole target pass, so rejections count ``w`` times more. Its minimiser is
``p / (p + w (1 - p))``, not ``p``: with ``w > 1`` a head deliberately under-predicts acceptance,
and the expected calibration error and reliability plot show that shift rather than a fault,
which is why the plain BCE is reported beside it.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch


def _check_pred_label(pred: torch.Tensor, label: torch.Tensor) -> None:
    if pred.shape != label.shape:
        raise ValueError(f"pred and label must have one shape, got {pred.shape} and {label.shape}")
    if pred.numel() and (pred.min() < 0 or pred.max() > 1):
        raise ValueError("pred must hold probabilities in [0, 1]")


def reliability_bins(
    pred: torch.Tensor, label: torch.Tensor, bins: int = 10
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal-width bins of predicted probability: (mean_pred, mean_label, counts), each [bins].

    pred, label: [N]. A prediction of exactly 1 falls in the last bin. Empty bins have count 0
    and NaN means, so a plot or a sum cannot mistake them for a bin predicting 0.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    _check_pred_label(pred, label)
    pred = pred.detach().reshape(-1).double().cpu()  # [N]
    label = label.detach().reshape(-1).double().cpu()  # [N]
    index = (pred * bins).long().clamp(max=bins - 1)  # [N] in [0, bins)
    counts = torch.bincount(index, minlength=bins).double()  # [bins]
    sum_pred = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, pred)  # [bins]
    sum_label = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, label)  # [bins]
    return sum_pred / counts, sum_label / counts, counts.long()  # 0/0 -> NaN in empty bins


def expected_calibration_error(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> float:
    """Sum over bins of (bin size / N) * |mean predicted - mean label|; pred, label: [N]."""
    mean_pred, mean_label, counts = reliability_bins(pred, label, bins)
    total = int(counts.sum())
    if total == 0:
        return float("nan")
    filled = counts > 0  # [bins]
    gap = (mean_pred[filled] - mean_label[filled]).abs()  # [filled bins]
    return float((counts[filled].double() / total * gap).sum())


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve by the rank (Mann-Whitney) formula, ties given average ranks.

    score: [N], label: [N] in {0, 1}. NaN when only one class is present (AUC undefined).
    """
    score = score.detach().reshape(-1).double().cpu()  # [N]
    positive = label.detach().reshape(-1).cpu() > 0.5  # [N]
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(score, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # [distinct] 1-based rank of each group's last member
    average_rank = ends - (counts.double() - 1) / 2  # [distinct]
    ranks = average_rank[inverse]  # [N]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def weighted_bce_terms(
    logits: torch.Tensor, label: torch.Tensor, reject_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example weighted BCE numerators and weights, both [N]; loss = sum(num) / sum(weight).

    From logits (softplus form) so saturated predictions give finite losses.
    """
    label = label.to(logits.dtype)
    accepted = label * torch.nn.functional.softplus(-logits)  # -y log s
    rejected = (1 - label) * torch.nn.functional.softplus(logits)  # -(1 - y) log(1 - s)
    return accepted + reject_weight * rejected, label + reject_weight * (1 - label)


def weighted_bce(logits: torch.Tensor, label: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """The training loss: weighted BCE normalised by the sum of weights (scalar)."""
    numerator, weight = weighted_bce_terms(logits, label, reject_weight)
    return numerator.sum() / weight.sum()


def evaluate_predictions(
    logits: torch.Tensor, label: torch.Tensor, rule: str, reject_weight: float
) -> dict[str, float | None]:
    """Validation metrics from logits [N] and labels [N]."""
    logits = logits.detach().double().cpu()
    label = label.detach().double().cpu()
    prob = torch.sigmoid(logits)  # [N]
    metrics: dict[str, float | None] = {
        "val_loss": float(weighted_bce(logits, label, reject_weight)),
        "val_bce": float(weighted_bce(logits, label, 1.0)),
        "val_ece": expected_calibration_error(prob, label),
        "val_mean_pred": float(prob.mean()),
    }
    if rule == "greedy":
        metrics["val_accuracy"] = float(((prob > 0.5) == (label > 0.5)).double().mean())
        value = auc(prob, label)
        metrics["val_auc"] = None if math.isnan(value) else value
    return metrics


def plot_reliability(
    pred: torch.Tensor, label: torch.Tensor, path: str | Path, title_prefix: str = ""
) -> str | None:
    """Reliability diagram plus bin-count histogram, saved as a PNG; returns its path.

    Uses a bare `Figure` (Agg canvas) rather than pyplot, so no display and no global pyplot
    state are involved. matplotlib is an optional extra: without it the plot is skipped with a
    warning instead of losing the trained head.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed; skipping the reliability plot", stacklevel=2)
        return None
    mean_pred, mean_label, counts = reliability_bins(pred, label)
    bins = counts.numel()
    edges = torch.linspace(0, 1, bins + 1)  # [bins + 1]
    centers = ((edges[:-1] + edges[1:]) / 2).tolist()
    filled = (counts > 0).tolist()
    ece = expected_calibration_error(pred, label)

    fig = Figure(figsize=(5, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    xs = [p for p, f in zip(mean_pred.tolist(), filled, strict=True) if f]
    ys = [y for y, f in zip(mean_label.tolist(), filled, strict=True) if f]
    top.plot(xs, ys, marker="o", label="head")
    top.set_ylabel("observed mean label")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.legend(loc="lower right")
    top.set_title(f"{title_prefix}: ECE {ece:.3f} (N={int(counts.sum())})".lstrip(": "))
    bottom.bar(centers, counts.tolist(), width=1 / bins, edgecolor="black")
    bottom.set_xlabel("predicted acceptance probability")
    bottom.set_ylabel("count")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return str(path)
