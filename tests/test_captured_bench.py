"""The captured path's bench: acceptance held where it is set, every method on the same text."""

from __future__ import annotations

import json
import re
import statistics

import pytest
import torch

from specdecode.bench.captured import (
    CapturedBenchConfig,
    random_model,
    run_captured_bench,
    shape_config,
    shape_names,
    with_margins,
)
from specdecode.bench.report import markdown_table
from specdecode.cli import main


def pair_files(root, **fields) -> list[str]:
    """Config files of a target of 2 layers and a drafter of 1, otherwise alike."""
    paths = []
    for name, layers in (("target", 2), ("draft", 1)):
        path = root / f"{name}.json"
        path.write_text(json.dumps(dict(fields, num_hidden_layers=layers)))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Config files of a tiny target and drafter (the published shapes are gigabytes)."""
    return pair_files(
        tmp_path_factory.mktemp("shapes"), model_type="llama", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )  # fmt: skip


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
    # what auto plans at each batch size: nothing where no draft is ever kept; the plan's gain
    # over plain is its ratio at the prices measured, which a plan of no draft leaves at 1
    plans = {(p["batch_size"], p["acceptance"]): p for p in record["auto_plans"]}
    assert set(plans) == {(b, a) for b in (1, 2) for a in (0.0, 1.0)}
    for batch in (1, 2):
        assert plans[(batch, 0.0)]["k"] == [0] and plans[(batch, 0.0)]["gain"] == 1.0
        kept = plans[(batch, 1.0)]
        assert (kept["gain"] > 1.0) == (kept["k"] != [0]) and kept["gain"] >= 1.0
    # the start-up and each method's warm-up are timed; nothing is captured on the CPU
    startup = record["startup"]
    assert startup["build_seconds"] > 0 and startup["first_token_seconds"] > 0
    assert startup["captures"] == {"target": [], "drafter": []} and not record["captured"]
    assert all(r["warm_up_seconds"] > 0 for r in record["methods"] if r["method"] != "graph-ar")
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


@pytest.fixture(scope="module")
def wide_shapes(tmp_path_factory):
    """A Qwen3 pair whose vocabulary is wide enough for random logits to nearly tie."""
    return pair_files(
        tmp_path_factory.mktemp("wide"), model_type="qwen3", vocab_size=8192, hidden_size=64,
        intermediate_size=128, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip


def top_two_gap(model, ids: torch.Tensor) -> torch.Tensor:
    """The gap between each position's top logit and its second, over the max logit."""
    logits = model(ids).logits.float()  # [batch, n, vocab]
    top = logits.topk(2, dim=-1).values  # [batch, n, 2]
    return (top[..., 0] - top[..., 1]) / top[..., 0].abs()


def test_margins_put_the_next_token_far_ahead(wide_shapes):
    """The margined target's next token leads by a share of its logit that bfloat16 rounding
    (2^-8 of it) cannot cross, where the same random weights without margins tie somewhere."""
    ids = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(1))
    plain = random_model(wide_shapes[0], torch.bfloat16, "cpu", 0)
    margined = with_margins(random_model(wide_shapes[0], torch.bfloat16, "cpu", 0), 0)
    with torch.no_grad():
        assert top_two_gap(plain, ids).min() < 2**-7
        assert top_two_gap(margined, ids).min() > 0.25
        # the head is untied and every shape kept: the passes cost what they did
        assert margined.lm_head.weight.data_ptr() != margined.model.embed_tokens.weight.data_ptr()
        assert {n: p.shape for n, p in margined.state_dict().items()} == {
            n: p.shape for n, p in plain.state_dict().items()
        }


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_acceptance_holds_in_both_dtypes(wide_shapes, dtype):
    """Acceptance 0.8 measured within 0.03 of it and `sd` equal to `ar`, in bfloat16 as in
    float32, on the static and the eager path, one row and four."""
    cfg = CapturedBenchConfig(
        target=wide_shapes[0],
        draft=wide_shapes[1],
        dtype=dtype,
        acceptance=(0.8,),
        num_draft_tokens=(3,),
        batch_sizes=(1, 4),
        prompts=8,
        prompt_tokens=8,
        max_new_tokens=128,
        methods=("ar", "sd", "eager-sd"),
    )
    record = run_captured_bench(cfg, progress=False)
    drafted = [r for r in record["methods"] if "acceptance_set" in r]
    assert len(drafted) == 4
    for row in drafted:
        assert row["acceptance_measured"] == pytest.approx(0.8, abs=0.03), row["method"]
        assert row["mismatches"] == [], row["method"]
    assert record["ok"]


def test_auto_plans_read_each_row_counts_prices():
    """What the record says auto plans comes from the planner at each row count's own prices:
    where a verify pass costs a step and the drafter little (a GPU's one row), it drafts, and
    further at higher acceptance; where every token costs a step (compute-bound rows), never."""
    from specdecode.bench.captured import auto_plans

    cfg = CapturedBenchConfig(target="qwen3-4b", draft="qwen3-0.6b", batch_sizes=(1, 8),
                              acceptance=(0.5, 0.9), num_draft_tokens=(2, 5))  # fmt: skip
    timed = {
        1: ({w: 0.010 * (1 + 0.01 * (w - 1)) for w in range(1, 7)}, 0.001),
        8: ({w: 0.080 * w for w in range(1, 7)}, 0.008),  # every token a full pass
    }
    plans = {(p["batch_size"], p["acceptance"]): p for p in auto_plans(timed, cfg)}
    assert 0 < plans[(1, 0.5)]["k"][0] < plans[(1, 0.9)]["k"][0] <= 5
    assert plans[(1, 0.9)]["gain"] > plans[(1, 0.5)]["gain"] > 1.0
    assert plans[(1, 0.9)]["drafter_step"] == pytest.approx(0.1)
    assert plans[(8, 0.5)]["k"] == plans[(8, 0.9)]["k"] == [0]
    assert plans[(8, 0.9)]["verify_steps"] == pytest.approx(6.0)
