"""Train the SpecDec++ acceptance head on examples written by `specdecode head collect`.

Choices that are not obvious from the code:

* Train and validation are split by prompt, never by position: positions of one response share
  the prompt, the topic and most of the context, so a per-position split would let the head be
  scored on near-copies of its training rows and overstate how well it generalises.
* The loss is the seed's weighted BCE, ``-(y log s + w (1 - y) log(1 - s)) / sum(y + w (1 - y))``
  with ``w = reject_weight``. A missed rejection (drafting on past a token the target rejects)
  wastes a whole target pass, so rejections count ``w`` times more. Its minimiser is
  ``p / (p + w (1 - p))``, not ``p``: with ``w > 1`` the head deliberately under-predicts
  acceptance, and the validation ECE and reliability plot show that shift rather than a fault.
  The plain BCE is reported beside it so the two effects can be told apart.
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

import itertools
import json
import math
import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from specdecode.acceptance_head import (
    LAW_FEATURES,
    RULES,
    AcceptanceHead,
    HeadConfig,
    ModelIdentity,
    number_logit,
)
from specdecode.config import RoundPrices
from specdecode.length_policies import going_on_prices, worth_drafting_on

EXAMPLES_FILE = "examples.safetensors"
META_FILE = "meta.json"
TRAINING_FILE = "training.json"
RELIABILITY_FILE = "reliability.png"
LABEL_KEYS = {"greedy": "label_greedy", "sampling": "label_sampling"}
REQUIRED_TENSORS = ("hidden", "label_greedy", "label_sampling", "prompt_index", "position")
REQUIRED_META = ("drafter", "target", "temperature")


@dataclass(frozen=True)
class PreviewCosts:
    """How the preview prices a round, in target decoding steps.

    A round that drafts m tokens costs one verify pass plus m drafter passes of `draft_cost`.
    The verify pass costs `verify_curve[m - 1]` steps when the curve is given (the bench's
    calibrated "verify pass of k+1 tokens", k = 1, 2, ...; past its end, the last entry plus
    `verify_slope` a token), else `1 + verify_slope * m`. A curve matters where the machine's
    cost is not a line: on the 2-core AMD EPYC, with padded products, a pass of 1 to 6 drafted
    tokens costs about one step and 7 or 8 cost 1.2-1.3, so a line either overprices short
    passes or underprices long ones, and the replayed gain of a head swings with it. The
    defaults are the default pair's on a 2-core Intel Xeon (the int8 0.5B drafter against the
    1.5B target, from `specdecode bench`'s calibration: c = 0.23, verify cost 1.04 + 0.07 k).
    """

    draft_cost: float = 0.23
    verify_slope: float = 0.07
    verify_curve: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name, value in (
            ("draft_cost", self.draft_cost),
            ("verify_slope", self.verify_slope),
            *(("verify_curve", v) for v in self.verify_curve),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"preview {name} must be a finite number >= 0, got {value}")
        object.__setattr__(self, "verify_curve", tuple(float(v) for v in self.verify_curve))

    def round_cost(self, drafted: int) -> float:
        """Target steps of a round that drafts `drafted` tokens (its verify pass and drafts)."""
        curve = self.verify_curve
        if not curve or drafted < 1:
            verify = 1 + self.verify_slope * drafted
        elif drafted <= len(curve):
            verify = curve[drafted - 1]
        else:
            verify = curve[-1] + self.verify_slope * (drafted - len(curve))
        return verify + self.draft_cost * drafted

    def round_prices(self, most_drafted: int) -> RoundPrices:
        """These prices as a priced head reads them, for rounds of 1..most_drafted tokens."""
        verify = (self.round_cost(m) - self.draft_cost * m for m in range(1, most_drafted + 1))
        return RoundPrices(self.draft_cost, tuple(verify))

    def describe(self) -> str:
        if not self.verify_curve:
            verify = f"a verify pass 1 + {self.verify_slope:g} m steps"
        else:
            steps = " / ".join(f"{v:g}" for v in self.verify_curve)
            m = f"m = 1..{len(self.verify_curve)}"
            verify = f"a verify pass of {m} drafted tokens {steps} steps"
            if self.verify_slope:
                verify += f" (+{self.verify_slope:g} a token past it)"
        return f"{verify}, a drafted token {self.draft_cost:g}"


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
    preview_costs: PreviewCosts = PreviewCosts()  # checks its own values

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


# ----------------------------------------------------------------------------- metrics


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


# ----------------------------------------------------------------------------- data


@dataclass
class HeadData:
    hidden: torch.Tensor  # [N, H] float16
    label: torch.Tensor  # [N] float32, the label of the chosen rule
    label_greedy: torch.Tensor  # [N] float32
    prompt_index: torch.Tensor  # [N] int64
    meta: dict[str, Any]
    position: torch.Tensor | None = None  # [N] int64 index in the response
    features: torch.Tensor | None = None  # [N, F] float32 law features of the chosen rule
    round: torch.Tensor | None = None  # [N] int64 round of a collection inside real rounds
    slot: torch.Tensor | None = None  # [N] int64 index of the drafted token in its round


def load_examples(
    data_dir: str | Path, rule: str, law: bool = False, drawn: bool = False
) -> HeadData:
    """Read and check a collected data directory; errors name the file and what is wrong.

    With `law`, the law features of `rule` are loaded too (and required). With `drawn` (rule
    sampling), the label is the drawn token's acceptance and its log probability is a fourth
    feature.
    """
    if rule not in LABEL_KEYS:
        raise ValueError(f"rule must be one of {tuple(LABEL_KEYS)}, got {rule!r}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"head data directory {data_dir} does not exist; "
            "create it with `specdecode head collect`"
        )
    for name in (EXAMPLES_FILE, META_FILE):
        if not (data_dir / name).is_file():
            raise FileNotFoundError(
                f"{data_dir} has no {name}; it is not a head data directory "
                "(write one with `specdecode head collect`)"
            )
    try:
        meta = json.loads((data_dir / META_FILE).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{data_dir / META_FILE} is not valid JSON: {error}") from error
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise ValueError(f"{data_dir / META_FILE} lacks {', '.join(missing)}")
    for role in ("drafter", "target"):
        if not (isinstance(meta[role], dict) and {"name", "fingerprint"} <= meta[role].keys()):
            raise ValueError(f"{data_dir / META_FILE}: {role} must hold a name and a fingerprint")

    tensors = load_file(data_dir / EXAMPLES_FILE)
    missing = [key for key in REQUIRED_TENSORS if key not in tensors]
    if missing:
        raise ValueError(f"{data_dir / EXAMPLES_FILE} lacks the tensors {', '.join(missing)}")
    hidden = tensors["hidden"]
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [N, hidden_size], got shape {tuple(hidden.shape)}")
    n, hidden_size = hidden.shape
    if n == 0:
        raise ValueError(
            f"{data_dir / EXAMPLES_FILE} holds no examples; collect with more prompts or tokens"
        )
    if hidden_size == 0:
        raise ValueError(f"{data_dir / EXAMPLES_FILE}: hidden has size 0")
    for key in REQUIRED_TENSORS[1:]:
        if tuple(tensors[key].shape) != (n,):
            raise ValueError(
                f"{data_dir / EXAMPLES_FILE}: {key} has shape {tuple(tensors[key].shape)}, "
                f"expected ({n},) to match hidden"
            )
    declared = meta.get("hidden_size")
    if declared is not None and int(declared) != hidden_size:
        raise ValueError(
            f"hidden size mismatch in {data_dir}: meta.json says {declared}, "
            f"but hidden has {hidden_size} columns"
        )
    if drawn and (rule != "sampling" or not law):
        raise ValueError("the drawn token's label is for sampling heads with law features")
    label_key = "label_drawn" if drawn else LABEL_KEYS[rule]
    if label_key not in tensors:
        raise ValueError(
            f"{data_dir / EXAMPLES_FILE} has no {label_key} (collected before it was "
            "recorded): rerun the same `specdecode head collect` command, which adds it, or "
            "train with --expected-label"
        )
    label = tensors[label_key].float()
    if tuple(label.shape) != (n,):
        raise ValueError(f"{data_dir / EXAMPLES_FILE}: {label_key} must have shape ({n},)")
    if not torch.isfinite(label).all() or label.min() < 0 or label.max() > 1:
        raise ValueError(f"{label_key} must hold finite values in [0, 1]")
    if not torch.isfinite(hidden).all():
        raise ValueError(f"{data_dir / EXAMPLES_FILE}: hidden holds inf or NaN")
    features = None
    if law:
        key = f"law_{rule}"
        if key not in tensors:
            raise ValueError(
                f"{data_dir / EXAMPLES_FILE} has no {key} (collected before the law features "
                "were recorded): rerun the same `specdecode head collect` command, which adds "
                "them, or train with --no-law-features"
            )
        features = tensors[key].float()
        if drawn:  # [N, 4]: the law's features and the drawn token's log probability
            features = torch.cat([features, tensors["drawn_log_prob"].float()[:, None]], 1)
        want = (n, len(LAW_FEATURES) + drawn)
        if tuple(features.shape) != want or not torch.isfinite(features).all():
            raise ValueError(
                f"{data_dir / EXAMPLES_FILE}: the law features of {key} must be finite with "
                f"shape {want}, got {tuple(features.shape)}"
            )
    rounds = {}
    if "round" in tensors or "slot" in tensors:  # collected inside real rounds
        for key in ("round", "slot"):
            if key not in tensors or tuple(tensors[key].shape) != (n,):
                raise ValueError(
                    f"{data_dir / EXAMPLES_FILE}: a collection inside rounds needs round and "
                    f"slot, each of shape ({n},)"
                )
            rounds[key] = tensors[key].long()
    return HeadData(
        **rounds,
        hidden=hidden.to(torch.float16),
        label=label,
        label_greedy=tensors["label_greedy"].float(),
        prompt_index=tensors["prompt_index"].long(),
        meta=meta,
        position=tensors["position"].long(),
        features=features,
    )


def load_collections(
    data_dirs: Sequence[str | Path], rule: str, law: bool = False, drawn: bool = False
) -> HeadData:
    """`load_examples` of several collections for the same pair, as one: a code set and a chat
    set, say, so one head serves both kinds of text.

    Prompt indices and round ids are renumbered so that those of different collections never
    meet (the validation split keeps whole prompts, and the replay chains rounds by id). A
    sampling head needs every collection drawn at the same temperature: the labels mean
    acceptance under that law. Round and slot survive only if every collection has them.
    """
    if not data_dirs:
        raise ValueError("no head data directories given")
    parts = [load_examples(d, rule, law=law, drawn=drawn) for d in data_dirs]
    first = parts[0]
    for data_dir, part in zip(data_dirs[1:], parts[1:], strict=True):
        for role in ("drafter", "target"):
            if part.meta[role]["fingerprint"] != first.meta[role]["fingerprint"]:
                raise ValueError(
                    f"{data_dir} was collected with {role} {part.meta[role]['name']}, "
                    f"{data_dirs[0]} with {first.meta[role]['name']}: a head is for one pair"
                )
        if part.hidden.shape[1] != first.hidden.shape[1]:
            raise ValueError(f"{data_dir}: hidden size differs from {data_dirs[0]}")
        if rule == "sampling" and float(part.meta["temperature"]) != float(
            first.meta["temperature"]
        ):
            raise ValueError(
                f"{data_dir} was sampled at temperature {part.meta['temperature']}, "
                f"{data_dirs[0]} at {first.meta['temperature']}: sampling labels of one head "
                "must share the drafting law"
            )
    if len(parts) == 1:
        return first

    def joined(name: str, apart: bool = False) -> torch.Tensor | None:
        """One tensor of all parts (None if a part lacks it); `apart`: each part's ids shifted
        past those of the parts before it."""
        values = [getattr(part, name) for part in parts]
        if any(v is None for v in values):
            return None
        if apart:
            shifts = itertools.accumulate([0] + [int(v.max()) + 1 for v in values[:-1]])
            values = [v + shift for v, shift in zip(values, shifts, strict=True)]
        return torch.cat(values)

    rounds = joined("round", apart=True)  # round ids are a collection's own, like prompts
    return HeadData(
        hidden=joined("hidden"),
        label=joined("label"),
        label_greedy=joined("label_greedy"),
        prompt_index=joined("prompt_index", apart=True),
        meta={**first.meta, "collections": [part.meta for part in parts]},
        position=joined("position"),
        features=joined("features"),
        round=rounds,
        slot=joined("slot") if rounds is not None else None,
    )


def split_by_prompt(
    prompt_index: torch.Tensor, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, validation rows): whole prompts go to validation, chosen by the seed.

    prompt_index: [N]. At least one prompt lands on each side, so at least two are needed.
    """
    prompts = torch.unique(prompt_index)  # [P] sorted, so the choice depends on ids, not order
    if prompts.numel() < 2:
        raise ValueError(
            f"need at least 2 distinct prompts to split train/validation by prompt, "
            f"got {prompts.numel()}; collect with more prompts"
        )
    generator = torch.Generator().manual_seed(seed)
    order = prompts[torch.randperm(prompts.numel(), generator=generator)]  # [P]
    n_val = min(max(1, round(val_fraction * prompts.numel())), prompts.numel() - 1)
    is_val = torch.isin(prompt_index, order[:n_val])  # [N]
    return torch.nonzero(~is_val).squeeze(1), torch.nonzero(is_val).squeeze(1)


# ----------------------------------------------------------------------------- training


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
    hidden_size = data.hidden.shape[1]
    temperature = float(data.meta["temperature"]) if config.rule == "sampling" else 0.0

    accelerator = Accelerator()
    set_seed(config.seed)
    head = AcceptanceHead(
        HeadConfig(
            hidden_size=hidden_size,
            num_layers=config.num_layers,
            width=config.width,
            dropout=config.dropout,
            law_features=config.law_features,
            drawn_token=drawn,
            rule=config.rule,
            temperature=temperature,
            drafter=ModelIdentity(**data.meta["drafter"]),
            target=ModelIdentity(**data.meta["target"]),
        )
    )
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
        final, number = _with_number_calibration(
            final, data, train_rows, val_rows, config.reject_weight, config.seed
        )
    mean_pred, mean_label, counts = reliability_bins(*best_val)
    out_dir = Path(out_dir)
    result: dict[str, Any] = {
        "config": asdict(config),
        "data": {
            "dirs": [str(Path(d).resolve()) for d in data_dirs],
            "examples": int(data.hidden.shape[0]),
            "hidden_size": int(hidden_size),
            "prompts": int(torch.unique(data.prompt_index).numel()),
            "meta": data.meta,
        },
        "head": asdict(final.config),
        "split": {
            "train_examples": int(train_rows.numel()),
            "val_examples": int(val_rows.numel()),
            "train_prompts": torch.unique(data.prompt_index[train_rows]).tolist(),
            "val_prompts": torch.unique(data.prompt_index[val_rows]).tolist(),
        },
        "label_base_rate": {
            "label": "label_drawn" if drawn else LABEL_KEYS[config.rule],
            "train": float(data.label[train_rows].mean()),
            "val": float(data.label[val_rows].mean()),
            "greedy_all": float(data.label_greedy.mean()),
        },
        # What a head that ignores the hidden state would score: the train base rate, constant.
        "constant_baseline": _constant_baseline(data, train_rows, val_rows, config),
        "epochs": history,
        "best_epoch": best["epoch"],
        "best": best,
        "reliability": {
            "bins": int(counts.numel()),
            "mean_pred": _nan_to_none(mean_pred),
            "mean_label": _nan_to_none(mean_label),
            "counts": counts.tolist(),
        },
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


def _with_number_calibration(
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
    from specdecode.acceptance_head import CONFIG_FILE, WEIGHTS_FILE, load_head

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
    calibrated, report = _with_number_calibration(
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


PREVIEW_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def _stop_lengths(keep: torch.Tensor, low: int, h: float) -> torch.Tensor:
    """keep [N, MAX] (running product of acceptances of a round starting at each position) ->
    [N] drafted tokens: the first m >= low with 1 - keep > h, else MAX."""
    high = keep.shape[1]
    steps = torch.arange(1, high + 1)[None, :]  # [1, MAX]
    stop = (1 - keep > h) & (steps >= low)  # [N, MAX] a stop after token m
    return torch.where(stop, steps, high).min(1).values


def _run_rounds(
    label: torch.Tensor, starts: list[int], drafted: torch.Tensor, costs: PreviewCosts
) -> dict[str, float]:
    """Expected totals when rounds follow one another along each response.

    label [N] acceptance probabilities in response order; starts: the first index of each
    response (and N at the end); drafted [N] tokens a round starting there drafts. A round at t
    accepts n tokens with probability prod_{i<n} a_{t+i} (1 - a_{t+n}) (n < m), or
    prod_{i<m} a_{t+i} (n = m), commits n + 1 and the next round starts at t + n + 1. A backward
    recursion gives each response's expected rounds, tokens, drafted tokens and cost exactly.
    """
    a, m_all = label.tolist(), drafted.tolist()
    totals = [0.0, 0.0, 0.0, 0.0]  # rounds, committed tokens, drafted tokens, cost
    for first, last in itertools.pairwise(starts):
        length = last - first
        ahead = [[0.0] * 4 for _ in range(length + 2)]  # expectations from position t on
        for t in range(length - 1, -1, -1):
            m = m_all[first + t]
            here = [1.0, 0.0, float(m), costs.round_cost(m)]
            survive = 1.0  # P(the first n drafted tokens all accepted)
            for n in range(m + 1):
                chance = survive * (1 - a[first + t + n]) if n < m else survive
                rest = ahead[min(t + n + 1, length)]
                here[0] += chance * rest[0]
                here[1] += chance * (n + 1 + rest[1])
                here[2] += chance * rest[2]
                here[3] += chance * rest[3]
                if n < m:
                    survive *= a[first + t + n]
            ahead[t] = here
        totals = [x + y for x, y in zip(totals, ahead[0], strict=True)]
    rounds, tokens, drafted_total, cost = totals
    return {
        "tokens_per_round": tokens / rounds,
        "drafted_per_round": drafted_total / rounds,
        "est_speed": tokens / cost,
    }


def preview_policies(
    pred: torch.Tensor,
    label: torch.Tensor,
    prompt_index: torch.Tensor,
    position: torch.Tensor,
    bound: tuple[int, int] = (1, 12),
    costs: PreviewCosts | None = None,
) -> dict[str, dict[str, float]]:
    """What each stop threshold (and each constant k) would do on held-out responses.

    Decoding is replayed along each response: a round starts where the last one ended, the head
    stops it once 1 - prod(pred) > h (within `bound`), and its accepted tokens follow the labels
    (0/1 under greedy; each drafted token's acceptance probability under sampling, so the
    replay takes the expectation over verdicts). `est_speed` is committed tokens per target step
    under `costs`. Rounds starting where earlier rounds end, rather than at every position,
    matter: decoding spends more of its rounds in hard stretches, where a constant k wastes its
    drafts and a head stops early, and starting everywhere under-weights them. Still a guide
    for choosing thresholds, not a measurement: the states follow the mixed collection
    sequences, not real drafts. Rows `oracle h=...` run the rule on the labels themselves: the
    most any head could get from these responses.
    """
    # pred, label, prompt_index, position: [N]
    costs = costs or PreviewCosts()
    order = torch.argsort(prompt_index * (int(position.max()) + 1) + position)
    pred, label, prompt = pred[order].double(), label[order].double(), prompt_index[order]
    low, high = bound
    n = len(pred)
    # windows[j, m] = the m-th position of a round starting at j (same response, else absent)
    idx = torch.arange(n)[:, None] + torch.arange(high)[None, :]  # [N, MAX]
    inside = (idx < n) & (prompt[idx.clamp(max=n - 1)] == prompt[:, None])
    idx = idx.clamp(max=n - 1)
    keep_p = torch.where(inside, pred[idx], 0.0).cumprod(1)  # [N, MAX] predicted all-accepted
    keep_l = torch.where(inside, label[idx], 0.0).cumprod(1)  # [N, MAX] actual all-accepted
    starts = torch.nonzero(torch.diff(prompt, prepend=prompt[:1] - 1)).squeeze(1).tolist() + [n]
    available = inside.sum(1)  # [N]

    def replay(drafted: torch.Tensor) -> dict[str, float]:
        return _run_rounds(label, starts, torch.minimum(drafted, available), costs)

    rows = {f"k={k}": replay(torch.full((n,), k)) for k in range(1, high + 1)}
    rows |= {f"head h={h:g}": replay(_stop_lengths(keep_p, low, h)) for h in PREVIEW_THRESHOLDS}
    # The same rule fed the true labels: what a perfect head would do on these rounds, the
    # ceiling for head training (greedy: stop exactly at the first rejection; sampling: the
    # exact acceptance probability of each drafted token, still a gamble on the verdict)
    rows |= {f"oracle h={h:g}": replay(_stop_lengths(keep_l, low, h)) for h in PREVIEW_THRESHOLDS}
    return rows


BONUS = -1  # in a chain of recorded rounds: the bonus token after a round that accepted all


def rounds_by_prompt(
    prompt_index: torch.Tensor, round_id: torch.Tensor, slot: torch.Tensor
) -> dict[int, list[list[int]]]:
    """A collection inside rounds as prompt -> its rounds in decoding order, each the example
    rows of slots 0, 1, ... (all [N] inputs)."""
    order = torch.argsort(round_id * (int(slot.max()) + 1) + slot).tolist()
    rounds: dict[int, list[int]] = {}
    for i in order:
        rounds.setdefault(int(round_id[i]), []).append(i)
    by_prompt: dict[int, list[list[int]]] = {}
    for rows in rounds.values():  # round ids grow with decoding steps
        if [int(slot[i]) for i in rows] != list(range(len(rows))):
            raise ValueError("each recorded round must hold the slots 0..m-1 of its drafted tokens")
        by_prompt.setdefault(int(prompt_index[rows[0]]), []).append(rows)
    return by_prompt


def _chained_rounds(
    prompt_index: torch.Tensor, position: torch.Tensor, round_id: torch.Tensor, slot: torch.Tensor
) -> list[tuple[list[int], int]]:
    """Recorded rounds joined into chains: (example rows, accepted count before the rejection).

    A round's accepted count is where the next round of its response starts, less one (the
    token committed after the accepted drafts); the last round of each response has no
    successor and is left out. A round that accepted all its drafts continues, through its
    bonus token (`BONUS`, a position with no recorded draft), into the next one, so that a
    replayed round may run past the recorded round's end.
    """
    chains = []
    for prompt, seq in rounds_by_prompt(prompt_index, round_id, slot).items():
        chain: list[int] = []
        for rows, after in itertools.pairwise(seq):
            accepted = int(position[after[0]]) - int(position[rows[0]]) - 1
            if not 0 <= accepted <= len(rows):
                raise ValueError(
                    f"recorded rounds do not chain: a round of {len(rows)} drafts is followed "
                    f"{accepted + 1} positions later"
                )
            if accepted < len(rows):  # a rejection ends the chain
                chains.append((chain + rows, len(chain) + accepted, prompt))
                chain = []
            else:  # all accepted: the bonus token, then the next round, continue the chain
                chain += rows + [BONUS]
        if chain:
            chains.append((chain[:-1], len(chain) - 1, prompt))
    return chains


def preview_rounds(
    pred: torch.Tensor,
    label: torch.Tensor,
    prompt_index: torch.Tensor,
    position: torch.Tensor,
    round_id: torch.Tensor,
    slot: torch.Tensor,
    bound: tuple[int, int] = (1, 12),
    costs: PreviewCosts | None = None,
    first_pred: torch.Tensor | None = None,
) -> dict[str, dict[str, Any]]:
    """Each policy replayed on the recorded responses themselves, with the recorded verdicts.

    A collection inside rounds of K (`head collect --rounds K`) holds, per round, the K drafts
    with their states, and (from where the next round starts) how many were accepted. Coupled
    on the same random numbers, any length policy commits the very same text; only where its
    rounds end differs. Recorded rounds that accepted everything are joined, through their
    bonus token, to the next into one chain of drafts ending at a rejection. A round of the
    replayed policy starting at slot s of a chain drafts m tokens (its decisions read the
    recorded states at slots s, s+1, ...), and then:
    - if the chain accepted them all, they are committed with the token after them, which is
      the recorded draft at slot s + m when that was accepted (the bonus token and the accepted
      draft are one coupled draw), so the next round starts at slot s + m + 1;
    - otherwise it commits the accepted ones and the recorded correction, and the next round
      starts at the next chain.
    So the counts are those decoding with the policy would make on this text, with no model of
    acceptance, with one approximation: a recorded bonus token has no draft, so a replayed
    round that passes over it counts it as a drafted token predicted and labelled 1 (accepted,
    no stop), and a round starting at the bonus token that ends a chain drafts one.
    `oracle h=...` feeds the rule the acceptance labels; `head h=...` the head's predictions,
    or `first_pred` [N] for a round's first drafted token when given (what a policy knowing more
    where a round starts would predict there, e.g. from the target's state at that point).
    A round of m drafted tokens costs `costs.round_cost(m)` target steps. Each row also lists,
    per prompt (in prompt order), the committed tokens, rounds, drafted tokens and steps.
    """
    # pred, label, prompt_index, position, round_id, slot: [N]
    costs = costs or PreviewCosts()
    chained = _chained_rounds(prompt_index, position, round_id, slot)
    low, high = bound
    pred_l, label_l = pred.double().tolist() + [1.0], label.double().tolist() + [1.0]  # BONUS
    first_l = None if first_pred is None else first_pred.double().tolist() + [1.0]

    def replay(stop_after) -> dict[str, Any]:
        per_prompt: dict[int, list[float]] = {}  # prompt -> [committed, rounds, drafted, steps]
        for rows, accepted, prompt in chained:
            rounds = committed = drafted = steps = 0
            s = 0
            while s <= accepted and s < len(rows):
                m = stop_after(rows[s : s + high])
                rounds, drafted, steps = rounds + 1, drafted + m, steps + costs.round_cost(m)
                if s + m <= accepted:  # all m accepted: commit them and the coupled next token
                    committed += m + 1
                    s += m + 1
                else:
                    committed += accepted - s + 1
                    s = accepted + 1
            if s == len(rows) == accepted:  # a chain cut by the data ends in a bonus token
                rounds, drafted, committed = rounds + 1, drafted + 1, committed + 1
                steps += costs.round_cost(1)
            totals = per_prompt.setdefault(prompt, [0, 0, 0, 0.0])
            for j, x in enumerate((committed, rounds, drafted, steps)):
                totals[j] += x
        committed, rounds, drafted, steps = (
            sum(t[j] for t in per_prompt.values()) for j in range(4)
        )
        return {
            "tokens_per_round": committed / rounds,
            "drafted_per_round": drafted / rounds,
            "est_speed": committed / steps,
            "per_prompt": [per_prompt[p] for p in sorted(per_prompt)],
        }

    def threshold(values: list[float], h: float, first: list[float] | None = None):
        first = values if first is None else first

        def stop_after(rows: list[int]) -> int:
            keep = 1.0
            for m, i in enumerate(rows, 1):
                keep *= (first if m == 1 else values)[i]
                if m >= low and 1 - keep > h:
                    return m
            return len(rows)

        return stop_after

    def priced(values: list[float], h: float):
        bar = going_on_prices(costs.round_prices(high), h, high)  # [high, high]

        def stop_after(rows: list[int]) -> int:
            keep = 1.0
            for m, i in enumerate(rows, 1):
                keep *= values[i]
                if m >= low:  # the bar's row for `high` drafted is all inf: a stop there
                    last = torch.tensor([values[i]], dtype=torch.float64)
                    if not worth_drafting_on(last.new_tensor([keep]), last, bar[m - 1]):
                        return m
            return len(rows)

        return stop_after

    out = {f"k={k}": replay(lambda rows, k=k: min(k, len(rows))) for k in range(1, high + 1)}
    out |= {f"head h={h:g}": replay(threshold(pred_l, h, first_l)) for h in PREVIEW_THRESHOLDS}
    if costs.draft_cost > 0 and first_l is None:  # the head told these prices (`--priced`)
        out |= {f"priced h={h:g}": replay(priced(pred_l, h)) for h in PREVIEW_THRESHOLDS}
    out |= {f"oracle h={h:g}": replay(threshold(label_l, h)) for h in PREVIEW_THRESHOLDS}
    return out


def _paired_interval(
    row: dict[str, Any], base: dict[str, Any], resamples: int = 2000
) -> list[float]:
    """95% bootstrap interval over prompts of a replayed policy's speed ratio to `base`.

    Paired: both replay the same recorded text, so a resample draws prompts, not texts.
    """
    a = torch.tensor(row["per_prompt"], dtype=torch.float64)  # [P, 4] committed, .., steps
    b = torch.tensor(base["per_prompt"], dtype=torch.float64)
    pick = torch.randint(len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(0))

    def speed(t: torch.Tensor) -> torch.Tensor:  # [resamples, P, 4] -> [resamples]
        total = t.sum(1)
        return total[:, 0] / total[:, 3]

    ratios = speed(a[pick]) / speed(b[pick])
    return [
        float(x) for x in torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=ratios.dtype))
    ]


def replay_heads(
    data_dir: str | Path,
    heads: list[str | Path],
    bound: tuple[int, int] = (1, 12),
    costs: PreviewCosts | None = None,
) -> dict[str, Any]:
    """Replay saved heads (and every constant k, and a perfect head) on a collection made
    inside rounds, e.g. on evaluation prompts: the paired comparison the bench cannot make
    under sampling, where each method writes its own text.

    Returns {"examples", "best_constant", "constants": rows, "heads": {dir: rows}}, rows as
    `preview_rounds` gives them, with `vs_best_constant` added.
    """
    from specdecode.acceptance_head import load_head

    loaded = [(str(h), load_head(h).float()) for h in heads]
    if not loaded:
        raise ValueError("name at least one head to replay (--head DIR)")
    result: dict[str, Any] = {"heads": {}}
    collections: dict[tuple, HeadData] = {}  # heads that read the same columns share one load
    for name, head in loaded:
        reads = (head.config.rule, head.reads_law, head.reads_drawn)
        if reads not in collections:
            rule, law, drawn = reads
            collections[reads] = load_examples(data_dir, rule, law=law, drawn=drawn)
        data = collections[reads]
        if data.round is None or data.slot is None:
            raise ValueError(
                f"{data_dir} was collected along mixed sequences; replaying needs a collection "
                "inside rounds (`specdecode head collect --rounds K`)"
            )
        pred = head.acceptance(data.hidden, data.features)  # [N]
        columns = (data.prompt_index, data.position, data.round, data.slot)
        rows = preview_rounds(pred, data.label, *columns, bound, costs)
        constants = {k: v for k, v in rows.items() if k.startswith("k=")}
        best = max(constants, key=lambda k: constants[k]["est_speed"])
        for row in rows.values():
            row["vs_best_constant"] = row["est_speed"] / constants[best]["est_speed"]
            row["vs_best_constant_95"] = _paired_interval(row, constants[best])
        result["heads"][name] = {k: v for k, v in rows.items() if not k.startswith("k=")}
        result |= {"examples": len(pred), "best_constant": best, "constants": constants}
    return result


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
