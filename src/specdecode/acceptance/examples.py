"""A head data collection on disk (`specdecode head collect`'s output): reading and checking it.

A collection is a directory with `examples.safetensors` (per drafted position: the drafter's
hidden state, the labels, the law features, the prompt and position, and for a collection inside
rounds the round and slot) and `meta.json` (the pair, the temperature, how it was collected).
Loading checks every tensor's shape and range and names the file and the fault, since a head
trained on a silently broken collection is wrong in ways no later step can see.

Train and validation are split by prompt, never by position (`split_by_prompt`): positions of
one response share the prompt, the topic and most of the context, so a per-position split would
let the head be scored on near-copies of its training rows and overstate how well it
generalises.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from specdecode.acceptance.head import LAW_FEATURES

EXAMPLES_FILE = "examples.safetensors"
META_FILE = "meta.json"
LABEL_KEYS = {"greedy": "label_greedy", "sampling": "label_sampling"}
REQUIRED_TENSORS = ("hidden", "label_greedy", "label_sampling", "prompt_index", "position")
REQUIRED_META = ("drafter", "target", "temperature")


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
