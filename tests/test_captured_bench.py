"""The captured path's bench: acceptance held where it is set, every method on the same text."""

from __future__ import annotations

import json
import re
import statistics

import pytest
import torch

from specdecode.bench.captured import (
    CapturedBenchConfig,
    run_captured_bench,
    shape_config,
    shape_names,
)
from specdecode.bench.report import markdown_table
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


@pytest.mark.parametrize("name", shape_names())
def test_published_shapes_have_the_size_their_names_say(name):
    """Each shape's parameters, counted on the meta device (no memory), within 10% of the
    size its name states (qwen3-4b: 4e9): a wrong layer count or width in a shape file fails."""
    from transformers import AutoModelForCausalLM

    stated = float(re.search(r"-(\d+(?:\.\d+)?)b$", name).group(1)) * 1e9
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(name))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(stated, rel=0.1)


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
    # the bound by hand from what was measured: the acceptance that explains 13 tokens in 4
    # calls, E[tokens a call] = 1 + a + a^2 + a^3 at it, over a call's cost in target steps
    prices, row = record["prices"], rows[("sd[k=3,a=1]", 1)]
    alpha = row["acceptance_measured"]
    tokens = sum(alpha**i for i in range(4))
    assert tokens == pytest.approx(13 / 4, rel=1e-4)
    cost = 3 * prices["drafter_step"] + prices["verify_steps"]["3"]
    assert row["leviathan_bound"] == pytest.approx(tokens / cost, rel=1e-4)
    # of the bound: the measured speedup, from each batch's seconds (equal tokens: ar's time
    # over sd's), as a share of it
    pairs = zip(rows[("ar", 1)]["per_batch_seconds"], row["per_batch_seconds"], strict=True)
    speedup = statistics.geometric_mean([a / b for a, b in pairs])
    assert row["of_bound"] == pytest.approx(speedup / (tokens / cost), rel=1e-4)
    assert record["ok"] and "controlled" in record["acceptance_control"]
    assert any("graph-ar" in s and "CUDA only" in s for s in record["skipped"])
    # the table: a line per row, in its cells the row's own figures
    table = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in markdown_table(record).splitlines()
        if line.startswith("| ")
    ]
    header, lines = table[0], {(cells[0], cells[1]): cells for cells in table[1:]}
    assert len(lines) == len(record["methods"])
    for r in record["methods"]:
        cells = dict(zip(header, lines[(r["method"], str(r["batch_size"]))], strict=True))
        assert cells["tok/s"] == f"{r['tokens'] / r['seconds']:.2f}"
        assert cells["speedup vs ar (geomean)"] == f"{r['speedup']['geomean']:.2f}"
        if "acceptance_set" in r:
            set_, measured = cells["acceptance set / measured"].split(" / ")
            assert (float(set_), float(measured)) == pytest.approx(
                (r["acceptance_set"], r["acceptance_measured"]), abs=0.005
            )


def test_command_line(shapes, tmp_path, capsys):
    code = main(["bench", "--shapes", *shapes, "--limit", "1", "--prompt-tokens", "6",
                 "--max-new-tokens", "6", "--methods", "ar", "sd", "--acceptance", "0.9",
                 "--out", str(tmp_path), "--no-plots", "--quiet"])  # fmt: skip
    assert code == 0
    table = (tmp_path / "table.md").read_text()
    assert "Acceptance controlled" in table and "sd[k=4,a=0.9]" in table
    assert main(["bench", "--shapes", "no-such-shape", shapes[1]]) == 2
    assert "unknown shape 'no-such-shape'" in capsys.readouterr().err
