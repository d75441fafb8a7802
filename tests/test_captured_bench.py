"""The captured path's bench: acceptance held where it is set, every method on the same text."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.captured import CapturedBenchConfig, run_captured_bench, shape_config
from specdecode.bench.metrics import expected_tokens_per_call
from specdecode.cli import main


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Config files of a tiny target and drafter (the published shapes are gigabytes)."""
    root = tmp_path_factory.mktemp("shapes")
    paths = []
    for name, layers in (("target", 2), ("draft", 1)):
        fields = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)  # fmt: skip
        path = root / f"{name}.json"
        path.write_text(json.dumps(fields))
        paths.append(str(path))
    return paths


def test_published_shapes_have_their_sizes():
    config = shape_config("qwen3-4b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        2560,
        36,
        8,
    )
    assert shape_config("qwen2.5-7b").vocab_size == 152064


def test_acceptance_is_what_was_set_and_outputs_equal_plain(shapes):
    cfg = CapturedBenchConfig(
        target=shapes[0],
        draft=shapes[1],
        dtype="float32",
        acceptance=(0.0, 1.0),
        num_draft_tokens=(3,),
        batch_sizes=(1, 2),
        prompts=2,
        prompt_tokens=8,
        max_new_tokens=13,
        methods=("ar", "sd", "eager-ar", "hf-static", "graph-ar"),
    )
    record = run_captured_bench(cfg, progress=False)
    rows = {(r["method"], r["batch_size"]): r for r in record["methods"]}
    for batch in (1, 2):
        always, never = rows[("sd[k=3,a=1]", batch)], rows[("sd[k=3,a=0]", batch)]
        assert always["tokens_per_target_call"] == pytest.approx(13 / 4)  # 3 rounds of 4, 1
        assert never["tokens_per_target_call"] == 1.0  # every replaced token rejected
        assert always["mismatches"] == never["mismatches"] == []  # lossless: ar's text
        assert rows[("hf-static", batch)]["tokens"] == 2 * 13  # no early stop on random text
    prices, row = record["prices"], rows[("sd[k=3,a=1]", 1)]  # the bound from what was measured
    cost = 3 * prices["drafter_step"] + prices["verify_steps"]["3"]
    tokens = expected_tokens_per_call(row["acceptance_measured"], 3)
    assert row["leviathan_bound"] == pytest.approx(tokens / cost)
    assert row["of_bound"] == pytest.approx(row["speedup"]["geomean"] / row["leviathan_bound"])
    assert record["ok"] and "controlled" in record["acceptance_control"]
    assert any("graph-ar" in s and "CUDA only" in s for s in record["skipped"])


def test_command_line(shapes, tmp_path, capsys):
    code = main(["bench", "--shapes", *shapes, "--limit", "1", "--prompt-tokens", "6",
                 "--max-new-tokens", "6", "--methods", "ar", "sd", "--acceptance", "0.9",
                 "--out", str(tmp_path), "--no-plots", "--quiet"])  # fmt: skip
    assert code == 0
    table = (tmp_path / "table.md").read_text()
    assert "Acceptance controlled" in table and "sd[k=4,a=0.9]" in table
    assert main(["bench", "--shapes", "no-such-shape", shapes[1]]) == 2
    assert "unknown shape 'no-such-shape'" in capsys.readouterr().err
