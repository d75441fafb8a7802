"""The engine on a GPU: the same guarantees as on the CPU, with models and head on CUDA.

Skipped where no CUDA device is present (CI has none); run on a GPU machine with
`python -m pytest -q tests/test_cuda.py`. Under greedy every policy must give the target's own
greedy text; under coupled sampling every policy must commit one text, and thousands of seeded
rows must follow the target's exact law; the pass timer must time the kernels (a GPU runs
ahead of the host) on inputs it places on the model's device.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.torch_eager import CachedModel
from specdecode.core.prices import Prices
from specdecode.pricebook import pass_seconds

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


def test_pass_timer_times_the_kernels_on_the_models_device(tiny_llama) -> None:
    backend = CachedModel(tiny_llama(seed=0, layers=4).to(CUDA))
    for rows in (1, 3):
        (seconds,) = pass_seconds([(backend, [1, 4, 8])], list(range(5, 60)), 3, rows=rows)
        assert set(seconds) == {1, 4, 8} and all(0 < s < 1 for s in seconds.values())


def test_priced_head_on_cuda(pair, spread_head, coupled_runs) -> None:
    """Round prices timed on the GPU, and a head weighing them there: its table of bars moves
    to the round's device, and the text is the target's under greedy and under coupling."""
    prompts, policies = [list(p) for p in coupled_runs.prompts], coupled_runs.policies
    coupled_generate = coupled_runs.generate
    gpu = on_cuda(pair[0], pair[1], spread_head(32))
    prices = gpu.prices(rows=len(prompts))
    rounds = prices.rounds(len(prompts))
    assert rounds.draft > 0 and all(0 < rounds.verify(m) < 20 * len(prompts) for m in range(7))
    jump = Prices.stated(0.2, 0.0, (1.0, 1.0, 1.0, 1.4, 1.45, 1.5))
    policy = dict(drafting="model", length_policy="head", stop_threshold=0.5, bound=(1, 6))
    plain = gpu.generate(prompts, max_new_tokens=24, use_drafter=False, stop_token_ids=[])
    for priced in (prices, jump):
        out = gpu.generate(prompts, max_new_tokens=24, stop_token_ids=[], prices=priced, **policy)
        assert out.new_tokens == plain.new_tokens
    coupled = on_cuda(*pair)
    texts = [
        coupled_generate(coupled, True, **policies["k=1"]).new_tokens,
        coupled_generate(coupled, True, prices=jump, **policies["head"]).new_tokens,
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


# ---- the static path (`backends.torch_static`): passes captured by hand as CUDA graphs ----

COMPILE = pytest.mark.skipif(
    not os.environ.get("SPECDECODE_TEST_COMPILE"),
    reason="torch.compile takes minutes on a GPU: set SPECDECODE_TEST_COMPILE=1",
)


@pytest.mark.parametrize("mode", ["captured", pytest.param("compiled", marks=COMPILE)])
def test_static_path_greedy_ragged_rows_and_rollback(tiny_llama, mode: str) -> None:
    """Greedy speculative text on the static path (captured by hand by default, or through
    torch.compile) is the eager path's plain text, with ragged prompts, rows finishing
    mid-draft (the row bucket shrinks under live graphs) and rollback."""
    from specdecode.backends.torch_static import StaticCachedModel

    target = copy.deepcopy(tiny_llama(seed=0, init=0.3)).to(CUDA)
    drafter = copy.deepcopy(tiny_llama(seed=3, layers=1, init=0.3)).to(CUDA)
    prompts = [list(range(5, 25)), list(range(30, 47)), list(range(50, 68))]
    compiled = mode == "compiled"
    target_lm = StaticCachedModel(target, "target", compile=compiled)
    drafter_lm = StaticCachedModel(drafter, "drafter", compile=compiled)
    assert (target_lm.graphs is not None) == (not compiled)  # by hand: CUDA's default
    static = SpeculativeDecoder(target_lm, drafter=drafter_lm)
    eager = SpeculativeDecoder(target)
    plain = eager.generate(prompts, max_new_tokens=24, use_drafter=False, stop_token_ids=[])
    for k in (2, 4):
        spec = static.generate(
            prompts, max_new_tokens=24, drafting="model", num_draft_tokens=k, stop_token_ids=[]
        )
        assert spec.new_tokens == plain.new_tokens
    stop = plain.new_tokens[0][9]
    stopped = static.generate(
        prompts, max_new_tokens=24, drafting="model", num_draft_tokens=4, stop_token_ids=[stop]
    )
    for tokens, reference in zip(stopped.new_tokens, plain.new_tokens, strict=True):
        cut = reference.index(stop) + 1 if stop in reference else len(reference)
        assert tokens == reference[:cut]
    if not compiled:  # every shape captured once: the graphs outlive rows leaving
        shapes = [(c.rows, c.width, c.hidden) for c in target_lm.capture_times]
        assert shapes and len(shapes) == len(set(shapes))
        assert drafter_lm.capture_times


def test_static_path_sampled_law_on_cuda(tiny_llama, sampled_law) -> None:
    from specdecode.backends.torch_static import StaticCachedModel

    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    drafter = tiny_llama(seed=9, vocab=sampled_law.vocab, init=0.4, layers=1)
    target_lm = StaticCachedModel(copy.deepcopy(target).to(CUDA), "target")
    decoder = SpeculativeDecoder(target_lm, drafter=StaticCachedModel(drafter.to(CUDA), "drafter"))
    total = sampled_law.assert_decoder_follows_target(
        decoder, target, sampled_law.prompt, 2000, 4, drafting="model", num_draft_tokens=3
    )
    assert total.recovered > 0 and total.accepted > 0 and target_lm.capture_times


def test_captured_bench_on_cuda(tmp_path) -> None:
    """The captured bench on the GPU: every method runs, the hand-captured graph included, and
    speculative decoding at full acceptance keeps plain decoding's text."""
    import json

    from specdecode.cli.main import main

    shape = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512)  # fmt: skip
    paths = []
    for name, layers in (("t", 2), ("d", 1)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(shape | {"num_hidden_layers": layers}))
        paths.append(str(path))
    args = ["bench", "--shapes", *paths, "--device", CUDA, "--dtype", "bfloat16", "--limit", "4"]
    args += ["--prompt-tokens", "32", "--max-new-tokens", "24", "--batch-sizes", "1", "4"]
    args += ["--acceptance", "1.0", "--num-draft-tokens", "3", "--out", str(tmp_path / "out")]
    args += ["--methods", "ar", "sd", "eager-ar", "graph-ar"]
    assert main([*args, "--quiet", "--no-plots"]) == 0
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["ok"] and record["captured"] and not record["compiled"]
    labels = {row["method"] for row in record["methods"]}
    assert {"ar", "sd[k=3,a=1]", "eager-ar", "graph-ar"} <= labels
    captures = record["startup"]["captures"]
    assert captures["target"] and captures["drafter"]
    assert {p["batch_size"] for p in record["auto_plans"]} == {1, 4}
