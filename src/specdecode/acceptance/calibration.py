"""A sampling head read together with the token's acceptance number (policy `head-u`).

The verdict on a drafted token z is u < min(1, p(z)/q(z)), with u drawn when z is drafted. The
head predicts min(1, p/q) from the drafter's side; knowing u too, the chance of acceptance falls
with u by an amount a three-weight logistic calibration says, logit = bias + a z + b log u,
fitted on verdicts drawn from the recorded ratios with the head's own weighted BCE (so that its
thresholds mean what the head's do).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specdecode.acceptance.examples import HeadData, load_collections, split_by_prompt
from specdecode.acceptance.head import AcceptanceHead, number_logit
from specdecode.acceptance.metrics import auc, weighted_bce

NUMBER_DRAWS = 8  # acceptance numbers drawn per example to fit `fit_number_calibration`


def number_examples(
    logit: torch.Tensor, ratio: torch.Tensor, seed: int, draws: int = NUMBER_DRAWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each example `draws` times with a fresh acceptance number u: logits, numbers and
    verdicts 1[u < r], each [N * draws], r = min(1, p/q) the recorded acceptance of the drawn
    token. A verdict is exactly that comparison, so these are draws of the verdicts decoding
    makes."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(len(logit), draws, generator=generator, dtype=torch.float64)  # [N, draws]
    verdict = (u < ratio.double()[:, None]).double()
    return logit.double().repeat_interleave(draws), u.reshape(-1), verdict.reshape(-1)


def fit_number_calibration(
    logit: torch.Tensor, ratio: torch.Tensor, reject_weight: float, seed: int = 0
) -> tuple[float, float, float]:
    """(bias, a, b) of logit P(accept | z, u) = bias + a z + b log u (`number_logit`), by the
    head's own weighted BCE (so that its thresholds mean what the head's do) on verdicts drawn
    from the recorded acceptance ratios. logit: [N] the head's, ratio: [N] min(1, p/q) of each
    drawn token."""
    z, u, y = number_examples(logit, ratio, seed)
    weights = torch.tensor([0.0, 1.0, 0.0], dtype=z.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = weighted_bce(number_logit(weights, z, u), y, reject_weight)
        loss.backward()
        return loss

    optimizer.step(closure)
    bias, a, b = weights.detach().tolist()
    return (bias, a, b)


def number_calibration_report(
    logit: torch.Tensor,
    ratio: torch.Tensor,
    calibration: tuple[float, float, float],
    reject_weight: float,
    seed: int = 1,
) -> dict[str, float]:
    """Weighted BCE and AUC on fresh verdicts, of the head alone and of the head reading u."""
    z, u, y = number_examples(logit, ratio, seed)
    out = {}
    for name, score in (("head", z), ("head_u", number_logit(calibration, z, u))):
        out[f"{name}_loss"] = float(weighted_bce(score, y, reject_weight))
        out[f"{name}_auc"] = auc(score, y)
    return out


def with_number_calibration(
    head: AcceptanceHead,
    data: HeadData,
    fit_rows: torch.Tensor,
    report_rows: torch.Tensor,
    reject_weight: float,
    seed: int,
) -> tuple[AcceptanceHead, dict[str, Any]]:
    """`head` with the calibration against acceptance numbers fitted on `fit_rows`, and its
    report on `report_rows` (fresh numbers)."""
    features = data.features
    with torch.no_grad():
        logit = head.float()(data.hidden, features).double()  # [N]
    calibration = fit_number_calibration(logit[fit_rows], data.label[fit_rows], reject_weight, seed)
    calibrated = AcceptanceHead(replace(head.config, number_calibration=calibration))
    calibrated.load_state_dict(head.state_dict())
    report = number_calibration_report(
        logit[report_rows], data.label[report_rows], calibration, reject_weight, seed + 1
    )
    return calibrated.eval(), {"weights": list(calibration), "held_out": report}


def calibrate_head(
    head_dir: str | Path,
    data_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    reject_weight: float = 6.0,
    val_fraction: float = 0.15,
    seed: int = 0,
) -> dict[str, Any]:
    """Fit a sampling head's calibration against acceptance numbers (policy `head-u`) on
    collections for its pair, and save the head with it (in place unless `out_dir`).

    Any collection that records the drawn token's acceptance serves, also one the head was not
    trained on: the calibration has three weights. Prompts are split as in training, and the
    report is on the held-out ones.
    """
    from specdecode.acceptance.head import CONFIG_FILE, WEIGHTS_FILE, load_head

    head = load_head(head_dir)
    config = head.config
    if config.rule != "sampling" or not config.drawn_token:
        raise ValueError(
            f"{head_dir} predicts {'greedy' if config.rule == 'greedy' else 'expected'} "
            "acceptance; only a sampling head of the drawn token's acceptance (the default "
            "of `head train --rule sampling`) can be calibrated against acceptance numbers"
        )
    data = load_collections(list(data_dirs), "sampling", law=True, drawn=True)
    for role in ("drafter", "target"):
        made_for = getattr(config, role)
        if made_for is not None and data.meta[role]["fingerprint"] != made_for.fingerprint:
            raise ValueError(
                f"the collection was made with {role} {data.meta[role]['name']}, the head "
                f"{head_dir} for {made_for}: calibrate on data of the head's own pair"
            )
    fit_rows, report_rows = split_by_prompt(data.prompt_index, val_fraction, seed)
    calibrated, report = with_number_calibration(
        head, data, fit_rows, report_rows, reject_weight, seed
    )
    out = Path(out_dir) if out_dir is not None else Path(head_dir)
    out.mkdir(parents=True, exist_ok=True)
    if out != Path(head_dir):
        shutil.copyfile(Path(head_dir) / WEIGHTS_FILE, out / WEIGHTS_FILE)  # weights unchanged
    (out / CONFIG_FILE).write_text(calibrated.config.to_json() + "\n")
    return {
        "head": str(out),
        "data": [str(Path(d).resolve()) for d in data_dirs],
        "examples": len(data.label),
        "fit_examples": int(fit_rows.numel()),
        "held_out_examples": int(report_rows.numel()),
        "reject_weight": reject_weight,
        **report,
    }
