"""Training the acceptance head on synthetic collected data (no models needed).

The label is a noisy function of one direction of the hidden state, so a head that learns
anything must rank validation rows well, and the same head trained on shuffled labels must not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.acceptance.calibration import (
    calibrate_head,
    fit_number_calibration,
    number_calibration_report,
)
from specdecode.acceptance.examples import load_collections, load_examples, split_by_prompt
from specdecode.acceptance.head import load_head
from specdecode.acceptance.metrics import (
    auc,
    expected_calibration_error,
    reliability_bins,
    weighted_bce,
)
from specdecode.acceptance.train import TrainConfig, train_head
from specdecode.cli.head import (
    add_calibrate_arguments,
    add_train_arguments,
    cmd_calibrate,
    cmd_train,
)
from specdecode.core.prices import Prices

FAST = dict(epochs=4, batch_size=32, lr=1e-2, val_fraction=0.25, num_layers=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, head_data) -> Path:
    return head_data.write(tmp_path_factory.mktemp("head") / "data")


@pytest.fixture(scope="module")
def trained(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("head") / "greedy"
    return out, train_head(data_dir, out, TrainConfig(rule="greedy", **FAST), progress=False)


def test_learnable_problem_beats_shuffled_control(trained, tmp_path: Path, head_data) -> None:
    out, result = trained
    assert result["best"]["val_auc"] > 0.8
    assert result["best"]["val_loss"] < result["constant_baseline"]["val_loss"]
    control_data = head_data.write(tmp_path / "shuffled", shuffle_labels=True)
    control = train_head(
        control_data, tmp_path / "control", TrainConfig(rule="greedy", **FAST), progress=False
    )
    assert control["best"]["val_auc"] < 0.65
    # epoch 0 is the law term alone, fitted before the MLP's epochs
    assert [r["epoch"] for r in result["epochs"]] == list(range(FAST["epochs"] + 1))
    saved = json.loads((out / "training.json").read_text())
    assert saved["best_epoch"] == result["best_epoch"]
    assert (out / "reliability.png").stat().st_size > 0


def test_split_keeps_prompts_whole(data_dir: Path, trained, head_data) -> None:
    prompt_index = load_file(data_dir / "examples.safetensors")["prompt_index"]
    train_rows, val_rows = split_by_prompt(prompt_index, 0.25, seed=0)
    train_prompts = set(prompt_index[train_rows].tolist())
    val_prompts = set(prompt_index[val_rows].tolist())
    assert not train_prompts & val_prompts
    assert train_prompts | val_prompts == set(range(head_data.prompts))
    assert len(val_prompts) == 3
    assert train_rows.numel() + val_rows.numel() == prompt_index.numel()
    # the split recorded by the run is this one, and another seed picks other prompts
    assert trained[1]["split"]["val_prompts"] == sorted(val_prompts)
    _, other = split_by_prompt(prompt_index, 0.25, seed=1)
    assert set(prompt_index[other].tolist()) != val_prompts


def test_saved_head_carries_identity(trained, data_dir: Path, tmp_path: Path, head_data) -> None:
    out, _ = trained
    head = load_head(out)
    assert head.config.rule == "greedy"
    assert head.config.temperature == 0.0
    assert head.config.drafter.name == "tiny-drafter"
    assert head.config.target.fingerprint == head_data.meta["target"]["fingerprint"]
    assert head.config.hidden_size == head_data.hidden
    config = TrainConfig(rule="sampling", epochs=1, num_layers=0, val_fraction=0.25)
    train_head(data_dir, tmp_path / "sampling", config, progress=False)
    sampling = load_head(tmp_path / "sampling", rule="sampling")
    assert sampling.config.temperature == head_data.meta["temperature"]
    assert sampling.config.drafter.fingerprint == head_data.meta["drafter"]["fingerprint"]


def test_ece_detects_calibration() -> None:
    g = torch.Generator().manual_seed(0)
    pred = torch.rand(200_000, generator=g) * 0.7  # [N] in [0, 0.7)
    label = torch.bernoulli(pred, generator=g)  # calibrated by construction
    assert expected_calibration_error(pred, label) < 0.03
    assert expected_calibration_error(pred + 0.3, label) == pytest.approx(0.3, abs=0.03)


def test_reliability_bins_count_everything() -> None:
    g = torch.Generator().manual_seed(1)
    pred = torch.rand(1000, generator=g)
    pred[:3] = torch.tensor([0.0, 1.0, 0.5])  # the edges belong to the first and last bins
    label = torch.bernoulli(pred, generator=g)
    mean_pred, mean_label, counts = reliability_bins(pred, label, bins=10)
    assert counts.sum() == 1000
    assert mean_pred.shape == mean_label.shape == counts.shape == (10,)
    _, _, sparse = reliability_bins(torch.tensor([0.05, 0.95]), torch.tensor([0.0, 1.0]))
    assert sparse.tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1]


def test_auc_rank_formula() -> None:
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5  # ties count half


def test_weighted_bce_matches_formula() -> None:
    logits = torch.tensor([-2.0, 0.3, 1.5, 4.0], dtype=torch.float64)
    y = torch.tensor([0.0, 0.4, 1.0, 0.9], dtype=torch.float64)  # soft labels allowed
    s, w = torch.sigmoid(logits), 6.0
    expected = -(y * s.log() + w * (1 - y) * (1 - s).log()).sum() / (y + w * (1 - y)).sum()
    assert float(weighted_bce(logits, y, w)) == pytest.approx(float(expected), rel=1e-9)


def test_same_seed_same_weights(data_dir: Path, tmp_path: Path) -> None:
    config = TrainConfig(epochs=2, batch_size=128, num_layers=1, val_fraction=0.25, seed=3)
    for name in ("a", "b"):
        train_head(data_dir, tmp_path / name, config, progress=False)
    first = load_file(tmp_path / "a" / "head.safetensors")
    second = load_file(tmp_path / "b" / "head.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_law_features_carry_what_the_hidden_state_lacks(tmp_path: Path, head_data) -> None:
    data = head_data.write(tmp_path / "law", signal_in_law=True)
    with_law = train_head(data, tmp_path / "with", TrainConfig(**FAST), progress=False)
    config = TrainConfig(law_features=False, **FAST)
    without = train_head(data, tmp_path / "without", config, progress=False)
    assert with_law["best"]["val_auc"] > 0.85
    assert without["best"]["val_auc"] < 0.65
    assert load_head(tmp_path / "with").reads_law and not load_head(tmp_path / "without").reads_law


def test_data_without_law_features_is_refused_or_trained_without(tmp_path: Path, head_data) -> None:
    data = head_data.write(tmp_path / "old")
    tensors = load_file(data / "examples.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("law_")},
        data / "examples.safetensors",
    )
    with pytest.raises(ValueError, match=r"no law_greedy.*--no-law-features"):
        train_head(data, tmp_path / "out", TrainConfig(**FAST), progress=False)
    result = train_head(
        data, tmp_path / "out", TrainConfig(law_features=False, **FAST), progress=False
    )
    assert result["best"]["val_auc"] > 0.8


def test_sampling_heads_learn_the_drawn_tokens_acceptance(
    data_dir: Path, tmp_path: Path, head_data
) -> None:
    """By default a sampling head reads the drawn token's log probability and learns its
    acceptance; --expected-label learns the expectation over the law; greedy heads never read
    it (the drawn token is the argmax there)."""
    drawn = train_head(data_dir, tmp_path / "drawn", TrainConfig(rule="sampling", **FAST), False)
    assert drawn["label_base_rate"]["label"] == "label_drawn"
    assert drawn["best"]["val_loss"] < 0.8 * drawn["constant_baseline"]["val_loss"]
    head = load_head(tmp_path / "drawn", rule="sampling")
    assert head.reads_drawn and head.config.num_features == 4
    config = TrainConfig(rule="sampling", drawn_token=False, **FAST)
    expected = train_head(data_dir, tmp_path / "expected", config, progress=False)
    assert expected["label_base_rate"]["label"] == "label_sampling"
    assert not load_head(tmp_path / "expected").reads_drawn
    train_head(data_dir, tmp_path / "greedy", TrainConfig(rule="greedy", **FAST), False)
    assert not load_head(tmp_path / "greedy").reads_drawn
    tensors = load_file(data_dir / "examples.safetensors")
    old = head_data.write(tmp_path / "old")
    save_file({k: v for k, v in tensors.items() if "drawn" not in k}, old / "examples.safetensors")
    with pytest.raises(ValueError, match=r"no label_drawn.*--expected-label"):
        train_head(old, tmp_path / "out", TrainConfig(rule="sampling", **FAST), progress=False)


def test_clear_errors(tmp_path: Path, data_dir: Path, head_data) -> None:
    with pytest.raises(ValueError, match="rule"):
        TrainConfig(rule="beam")
    with pytest.raises(ValueError, match="val_fraction"):
        TrainConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="width must be >= 1"):
        TrainConfig(width=0)
    with pytest.raises(ValueError, match="preview_bound"):
        TrainConfig(preview_bound=(3, 2))
    with pytest.raises(ValueError, match="verify_slope must be a finite number"):
        TrainConfig(preview_prices=Prices.stated(0.2, verify_slope=float("nan")))
    with pytest.raises(FileNotFoundError, match=r"examples\.safetensors"):
        (tmp_path / "empty").mkdir()
        train_head(tmp_path / "empty", tmp_path / "out", progress=False)
    empty = tmp_path / "no_examples"
    empty.mkdir()
    save_file(
        {
            "hidden": torch.zeros(0, head_data.hidden, dtype=torch.float16),
            **{k: torch.zeros(0) for k in ("label_greedy", "label_sampling")},
            **{k: torch.zeros(0, dtype=torch.int64) for k in ("prompt_index", "position")},
        },
        empty / "examples.safetensors",
    )
    (empty / "meta.json").write_text(json.dumps(head_data.meta))
    with pytest.raises(ValueError, match="no examples"):
        train_head(empty, tmp_path / "out", progress=False)
    one_prompt = head_data.write(tmp_path / "one")
    tensors = load_file(one_prompt / "examples.safetensors")
    tensors["prompt_index"] = torch.zeros_like(tensors["prompt_index"])
    save_file(tensors, one_prompt / "examples.safetensors")
    with pytest.raises(ValueError, match="at least 2 distinct prompts"):
        train_head(one_prompt, tmp_path / "out", progress=False)
    (one_prompt / "meta.json").write_text(
        json.dumps({**head_data.meta, "hidden_size": head_data.hidden + 1})
    )
    with pytest.raises(ValueError, match="hidden size mismatch"):
        load_examples(one_prompt, "greedy")
    with pytest.raises(ValueError, match="rule"):
        load_examples(data_dir, "beam")


def test_cli_prints_summary(data_dir: Path, tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = tmp_path / "cli"
    args = parser.parse_args(
        [str(data_dir), "--out", str(out), "--epochs", "1", "--layers", "1", "--width", "4"]
        + ["--val-fraction", "0.25", "--no-progress", "--preview-bound", "2", "6"]
        + ["--preview-costs", "0.3", "0.05", "--preview-verify-curve", "1", "1", "1.2"]
    )
    assert cmd_train(args) == 0
    printed = capsys.readouterr().out
    assert "best epoch 1/1" in printed and "AUC" in printed and str(out) in printed
    assert "rounds of 2..6" in printed and "a drafted token 0.3" in printed
    # the curve, then 0.05 a token past it
    assert "a verify pass of 1..6 drafted: 1.00 / 1.00 / 1.20 / 1.25 / 1.30 / 1.35" in printed
    assert "k=6:" in printed and "k=7:" not in printed
    config = load_head(out).config
    assert (config.num_layers, config.width) == (1, 4)


def test_collections_combine_with_prompts_kept_apart(
    data_dir: Path, tmp_path: Path, head_data
) -> None:
    """Two collections for one pair train one head; their prompt 0s stay different prompts."""
    other = head_data.write(tmp_path / "other", seed=1)
    one = load_examples(data_dir, "sampling", law=True)
    both = load_collections([data_dir, other], "sampling", law=True)
    assert len(both.label) == 2 * len(one.label)
    assert torch.unique(both.prompt_index).numel() == 2 * head_data.prompts
    assert torch.equal(both.hidden[len(one.label) :], load_examples(other, "sampling").hidden)
    assert both.features is not None and both.features.shape == (2 * len(one.label), 3)
    result = train_head([data_dir, other], tmp_path / "head", TrainConfig(**FAST), False)
    assert result["data"]["examples"] == 2 * len(one.label)
    assert result["data"]["prompts"] == 2 * head_data.prompts
    assert len(result["data"]["dirs"]) == 2

    # collections recorded inside rounds: round ids, like prompts, stay apart
    rounds = []
    n = head_data.prompts * head_data.per_prompt
    for directory in (data_dir, other):
        tensors = load_file(directory / "examples.safetensors")
        tensors["round"] = torch.arange(n) // 4  # rounds of 4 drafts
        tensors["slot"] = torch.arange(n) % 4
        copy = tmp_path / f"{directory.name}-rounds"
        copy.mkdir()
        save_file(tensors, copy / "examples.safetensors")
        (copy / "meta.json").write_text((directory / "meta.json").read_text())
        rounds.append(copy)
    joined = load_collections(rounds, "greedy")
    assert joined.round is not None and joined.slot is not None
    assert torch.unique(joined.round).numel() == 2 * n // 4
    assert torch.equal(joined.slot, torch.arange(2 * n) % 4)
    assert load_collections([rounds[0], other], "greedy").round is None  # not all have rounds

    def variant(name: str, **meta) -> Path:
        directory = head_data.write(tmp_path / name, seed=2)
        (directory / "meta.json").write_text(json.dumps({**head_data.meta, **meta}))
        return directory

    stranger = variant("stranger", drafter={"name": "other", "fingerprint": "e" * 16})
    with pytest.raises(ValueError, match=r"drafter other.*a head is for one pair"):
        load_collections([data_dir, stranger], "greedy")
    hotter = variant("hotter", temperature=1.0)
    with pytest.raises(ValueError, match=r"temperature 1\.0"):
        load_collections([data_dir, hotter], "sampling")
    assert len(load_collections([data_dir, hotter], "greedy").label) == 2 * len(one.label)
    with pytest.raises(ValueError, match="no head data"):
        load_collections([], "greedy")


def test_sampling_head_is_calibrated_against_acceptance_numbers(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, head_data
) -> None:
    """A drawn-token sampling head also fits logit P(accept | z, u) = bias + a z + b log u on
    verdicts drawn from its labels: a larger number means a likelier rejection (b < 0), and on
    held-out prompts the head reading u predicts verdicts better than the head alone."""
    result = train_head(data_dir, tmp_path / "drawn", TrainConfig(rule="sampling", **FAST), False)
    bias, a, b = result["number_calibration"]["weights"]
    held = result["number_calibration"]["held_out"]
    assert a > 0 and b < 0
    assert held["head_u_loss"] < held["head_loss"] and held["head_u_auc"] > held["head_auc"]
    assert load_head(tmp_path / "drawn").config.number_calibration == pytest.approx((bias, a, b))
    greedy = train_head(data_dir, tmp_path / "greedy", TrainConfig(rule="greedy", **FAST), False)
    assert greedy["number_calibration"] is None
    assert load_head(tmp_path / "greedy").config.number_calibration is None

    # `head calibrate` refits it on a collection, into a copy or in place
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    args = parser.parse_args([str(tmp_path / "drawn"), str(data_dir), "--out", str(tmp_path / "c")])
    assert cmd_calibrate(args) == 0
    assert "head-u" in capsys.readouterr().out
    refit = load_head(tmp_path / "c").config.number_calibration
    assert refit is not None and refit[2] < 0
    assert torch.equal(
        load_file(tmp_path / "c" / "head.safetensors")["out.weight"],
        load_file(tmp_path / "drawn" / "head.safetensors")["out.weight"],
    )
    with pytest.raises(ValueError, match="only a sampling head of the drawn token"):
        calibrate_head(tmp_path / "greedy", [data_dir])
    other = head_data.write(tmp_path / "other")
    meta = json.loads((other / "meta.json").read_text())
    meta["target"] = {"name": "another-target", "fingerprint": "0123456789abcdef"}
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="calibrate on data of the head's own pair"):
        calibrate_head(tmp_path / "c", [other])


def test_number_calibration_recovers_how_verdicts_depend_on_the_number() -> None:
    """With the head's logit equal to logit(r), verdicts 1[u < r]: P(accept) falls with u at
    any r, and the fit's held-out loss is below the head alone's."""
    g = torch.Generator().manual_seed(0)
    r = torch.rand(4000, generator=g, dtype=torch.float64).clamp(0.02, 0.98)
    z = torch.logit(r)
    calibration = fit_number_calibration(z, r, reject_weight=1.0)
    assert calibration[1] > 0 and calibration[2] < 0
    report = number_calibration_report(z, r, calibration, reject_weight=1.0)
    assert report["head_u_loss"] < report["head_loss"]
