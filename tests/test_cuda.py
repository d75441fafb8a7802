"""The engine on a GPU: the same guarantees as on the CPU, with models and head on CUDA.

Skipped where no CUDA device is present (CI has none); run on a GPU machine with
`python -m pytest -q tests/test_cuda.py`. Under greedy every policy must give the target's own
greedy text; under coupled sampling every policy must commit one text, and thousands of seeded
rows must follow the target's exact law; the bench's step timer must time the kernels (a GPU
runs ahead of the host) on inputs it places on the model's device.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.timing import step_seconds
from specdecode.config import RoundPrices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = "cuda"
# the greedy prompts, the policies, seeds and law check of test_coupled: conftest's `coupled_runs`


def on_cuda(target, drafter, head) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        copy.deepcopy(target).to(CUDA),
        drafter=copy.deepcopy(drafter).to(CUDA),
        acceptance_head=copy.deepcopy(head).to(CUDA),
    )


@pytest.fixture(scope="module")
def pair(tiny_llama, noisy_copy, drawn_head):
    target = tiny_llama(seed=0, init=0.3)
    return target, noisy_copy(target, 0.1), drawn_head(32)


def test_greedy_every_policy_is_the_targets_greedy_text(pair, spread_head, coupled_runs) -> None:
    prompts, policies = [list(p) for p in coupled_runs.prompts], coupled_runs.policies
    gpu = on_cuda(pair[0], pair[1], spread_head(32))  # a head that learnt greedy acceptance
    cpu = SpeculativeDecoder(pair[0], drafter=pair[1])
    plain = gpu.generate(prompts, max_new_tokens=24, use_drafter=False, stop_token_ids=[])
    # the device moves nothing but the arithmetic: the CPU's plain text is the GPU's
    cpu_plain = cpu.generate(prompts, max_new_tokens=24, use_drafter=False, stop_token_ids=[])
    assert plain.new_tokens == cpu_plain.new_tokens
    for name, policy in policies.items():
        out = gpu.generate(prompts, max_new_tokens=24, stop_token_ids=[], **policy)
        assert out.new_tokens == plain.new_tokens, name
        # drafts were rejected, and rows accepted differently: per-row rollback ran on the GPU
        assert 0 < out.stats.total.acceptance_rate < 1, name
        assert len({tuple(row.accepted_hist) for row in out.stats.rows}) > 1, name


def test_coupled_every_policy_commits_one_text(pair, coupled_runs) -> None:
    coupled_generate, policies, seeds = (
        coupled_runs.generate,
        coupled_runs.policies,
        coupled_runs.seeds,
    )
    gpu = on_cuda(*pair)
    texts = {name: coupled_generate(gpu, True, **p).new_tokens for name, p in policies.items()}
    assert all(text == texts["k=1"] for text in texts.values()), texts
    # the rows are seeded, so the CPU draws the same numbers: its text is the GPU's
    cpu = SpeculativeDecoder(pair[0], drafter=pair[1], acceptance_head=pair[2])
    assert coupled_generate(cpu, True, **policies["k=3"]).new_tokens == texts["k=1"]
    assert (
        coupled_generate(gpu, True, [s + 1 for s in seeds], **policies["k=3"]).new_tokens
        != (texts["k=1"])
    )


def test_sampled_law_equals_target_on_cuda(coupled_runs) -> None:
    coupled_runs.assert_sampled_law_is_targets("head", CUDA)


def test_step_timer_times_the_kernels_on_the_models_device(tiny_llama) -> None:
    model = tiny_llama(seed=0, layers=4).to(CUDA)
    seconds = step_seconds(model, list(range(5, 60)), [1, 4, 8], reps=3)
    assert set(seconds) == {1, 4, 8} and all(0 < s < 1 for s in seconds.values())


def test_priced_head_on_cuda(pair, spread_head, coupled_runs) -> None:
    """Round prices timed on the GPU, and a head weighing them there: its table of bars moves
    to the round's device, and the text is the target's under greedy and under coupling."""
    prompts, policies = [list(p) for p in coupled_runs.prompts], coupled_runs.policies
    coupled_generate = coupled_runs.generate
    gpu = on_cuda(pair[0], pair[1], spread_head(32))
    prices = gpu.measure_round_prices(max_tokens=6)
    assert len(prices.verify) == 6 and prices.draft > 0
    assert all(0 < cost < 20 for cost in prices.verify)
    jump = RoundPrices(0.2, (1.0, 1.0, 1.0, 1.4, 1.45, 1.5))
    policy = dict(length_policy="head", stop_threshold=0.5, bound=(1, 6))
    plain = gpu.generate(prompts, max_new_tokens=24, use_drafter=False, stop_token_ids=[])
    for round_prices in (prices, jump):
        out = gpu.generate(
            prompts, max_new_tokens=24, stop_token_ids=[], round_prices=round_prices, **policy
        )
        assert out.new_tokens == plain.new_tokens
    coupled = on_cuda(*pair)
    texts = [
        coupled_generate(coupled, True, **policies["k=1"]).new_tokens,
        coupled_generate(coupled, True, round_prices=jump, **policies["head"]).new_tokens,
    ]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_on_cuda(tiny_pair, tmp_path, dtype: str) -> None:
    """The bench's every GPU method on the models' device: calibration, ours, transformers'."""
    import json

    from specdecode.cli.main import main

    target, draft, prompts = tiny_pair
    out = tmp_path / dtype
    args = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    args += ["--limit", "3", "--max-new-tokens", "10", "--device", CUDA, "--dtype", dtype]
    args += ["--length-policy", "constant", "heuristic", "confidence", "--batch-sizes", "1", "2"]
    assert main([*args, "--out", str(out), "--quiet", "--no-plots"]) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["ok"] and record["config"]["device"] == CUDA
    assert record["machine"]["cuda"] is not None
    labels = {row["method"] for row in record["methods"]}
    assert {"ar", "hf", "hf-assisted", "sd[k=4]"} <= labels and len(labels) >= 6
    assert all(not row["mismatches"] for row in record["methods"])
    assert 0 < record["costs"]["target_step_s"] < 1
