"""Benchmark arithmetic on known numbers, and a smoke run of `specdecode bench` on tiny models."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from specdecode.bench.methods import CAUSAL, Method, Registry, Result, Settings
from specdecode.bench.metrics import (
    alpha_from_tokens_per_call,
    bootstrap_interval,
    expected_tokens_per_call,
    geometric_mean,
    leviathan_speedup,
    modelled_speedup,
    summarize,
)
from specdecode.bench.runner import measure, round_prices, speed_rows
from specdecode.cli.main import main
from specdecode.core.prices import Prices
from specdecode.prompts import load_prompts


def test_modelled_speedup_from_counts_and_a_fitted_verify_line() -> None:
    # verify costs on the line 1 + 0.1 k; 0.25 target calls and 0.75 drafter passes per token
    # at 3 drafted per round: 0.25 * 1.3 + 0.75 * (0.2 + 0.05) = 0.5125 steps per token
    costs = {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    assert modelled_speedup(0.25, 0.75, 3.0, costs, 0.2, 0.05) == pytest.approx(1 / 0.5125)
    # noisy calibrations are smoothed: one outlier moves the line, not the figure at k alone
    noisy = {**costs, 2: 1.6}
    assert modelled_speedup(0.25, 0.75, 2.0, noisy, 0.2) < modelled_speedup(
        0.25, 0.75, 2.0, costs, 0.2
    )
    assert modelled_speedup(0.25, 0.75, 2.0, noisy, 0.2) > 1 / (0.25 * 1.6 + 0.75 * 0.2)
    with pytest.raises(ValueError, match="at least two"):
        modelled_speedup(0.25, 0.75, 3.0, {3: 1.3}, 0.2)


@pytest.mark.parametrize("alpha,k,c", [(0.7, 4, 0.0), (0.8, 3, 0.1), (0.9, 5, 0.35), (0.5, 1, 0.2)])
def test_leviathan_bound_closed_form(alpha, k, c):
    series = sum(alpha**i for i in range(k + 1))  # 1 + a + ... + a^k
    assert expected_tokens_per_call(alpha, k) == pytest.approx(series)
    assert leviathan_speedup(alpha, k, c) == pytest.approx(series / (k * c + 1))


def test_leviathan_table_values():
    """The table in the performance notes: alpha 0.8, c 0.1 gives 2.47 at the best k."""
    best = max(leviathan_speedup(0.8, k, 0.1) for k in range(1, 20))
    assert best == pytest.approx(2.47, abs=0.01)
    assert max(leviathan_speedup(0.9, k, 0.0) for k in range(1, 200)) == pytest.approx(10, abs=0.01)
    assert expected_tokens_per_call(1.0, 4) == 5


def test_alpha_inversion_round_trip():
    for alpha in (0.0, 0.3, 0.75, 0.95):
        tau = expected_tokens_per_call(alpha, 4)
        assert alpha_from_tokens_per_call(tau, 4) == pytest.approx(alpha, abs=1e-9)
    with pytest.raises(ValueError, match="tokens per call"):
        alpha_from_tokens_per_call(6.0, 4)


def test_ratio_summaries():
    values = [1.0, 2.0, 4.0]
    assert geometric_mean(values) == pytest.approx(2.0)
    s = summarize([4.0, 1.0, 2.0, 3.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 4.0, 4)
    assert s["p10"] == pytest.approx(1.3) and s["p90"] == pytest.approx(3.7)
    assert s["geomean"] == pytest.approx(math.prod([4.0, 1.0, 2.0, 3.0]) ** 0.25)
    with pytest.raises(ValueError):
        geometric_mean([1.0, 0.0])


def test_bootstrap_interval_of_a_geometric_mean():
    same = bootstrap_interval([1.1] * 8)
    assert same == pytest.approx((1.1, 1.1))  # no spread, no uncertainty
    ratios = [0.8, 1.3, 0.95, 1.2, 1.05, 0.9, 1.4, 1.0]
    low, high = bootstrap_interval(ratios)
    assert low < geometric_mean(ratios) < high
    assert bootstrap_interval(ratios) == (low, high)  # seeded: a rederived record is the same
    wider = bootstrap_interval([r**2 for r in ratios])  # twice the spread in log space
    assert wider[0] < low and wider[1] > high
    sixteen = bootstrap_interval(ratios * 2)  # twice the prompts, same spread: narrower
    assert sixteen[1] - sixteen[0] < high - low
    with pytest.raises(ValueError, match="positive"):
        bootstrap_interval([1.0, -0.5])
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(ratios, level=1.0)


def test_method_expansion_and_errors():
    methods = Method.expand(["ar", "sd", "hf-assisted+dense"], [2, 3])
    assert [m.label for m in methods] == ["ar", "sd[k=2]", "sd[k=3]", "hf-assisted+dense"]
    with pytest.raises(ValueError, match="unknown method"):
        Method.expand(["nope"], [1])


def test_adaptive_methods_run_once_per_bound_and_threshold():
    methods = Method.expand(
        ["ar", "sd"],
        [4, 5],
        ["constant", "heuristic", "head"],
        {"head": [0.6, 0.7]},
        [(1, 12), (3, 12)],
    )
    assert [m.label for m in methods] == [
        "ar",
        "sd[k=4]",
        "sd[k=5]",
        "sd[heuristic k0=5 1..12]",
        "sd[heuristic k0=5 3..12]",
        "sd[head t=0.6 1..12]",
        "sd[head t=0.7 1..12]",
        "sd[head t=0.6 3..12]",
        "sd[head t=0.7 3..12]",
    ]
    assert {m.bound for m in methods if m.adaptive} == {(1, 12), (3, 12)}
    with pytest.raises(ValueError, match="a bound is required"):
        Method("sd", 4, policy="head", threshold=0.7)
    with pytest.raises(ValueError, match="a bound is unused"):
        Method("sd", 4, bound=(1, 4))


def test_priced_head_methods_and_their_prices():
    """--priced runs each head method twice, flat and priced by the run's calibration."""
    methods = Method.expand(
        ["ar", "sd"],
        [4],
        ["constant", "confidence", "head"],
        {"head": [0.7], "confidence": [0.4]},
        [(1, 3)],
        priced=True,
    )
    assert [m.label for m in methods] == [
        "ar",
        "sd[k=4]",
        "sd[confidence t=0.4 1..3]",
        "sd[head t=0.7 1..3]",
        "sd[head t=0.7 1..3 priced]",
    ]
    with pytest.raises(ValueError, match="only head policies are priced, not 'confidence'"):
        Method("sd", 4, policy="confidence", threshold=0.4, bound=(1, 3), priced=True)
    costs = {
        "target_step_s": 0.05,
        "verify_cost_in_steps": {1: 1.0, 2: 1.1, 3: 1.3, 4: 1.4},
        "c": {"sd": 0.3},
    }
    prices = round_prices(costs, 3)
    assert prices == {"sd": Prices((1,), ((1.0, 1.0, 1.1, 1.3),), (0.3,), 0.05)}
    assert [prices["sd"].rounds(1).verify(m) for m in (1, 2, 3)] == [1.0, 1.1, 1.3]
    assert round_prices(costs, 0) == {}


class Toy:
    """A method with no model: the runner's whole contract, timed by a clock it is handed."""

    def __init__(self, label, seconds, offset=0, exact=True, only_batch1=False, log=None):
        self.label, self.exact, self.pairing = label, exact, None
        self.seconds, self.offset, self.only_batch1 = list(seconds), offset, only_batch1
        self.log = [] if log is None else log  # labels in the order of the calls
        self.prepared = False

    def skips(self, batch_size):
        return "batch size 1 only" if self.only_batch1 and batch_size > 1 else None

    def prepare(self, sample):
        self.prepared = True

    def run(self, batch):
        self.log.append(self.label)
        return Result([[x + self.offset] * 2 for x in batch], self.seconds.pop(0))


def test_one_runner_measures_any_method_behind_the_protocol():
    """Warm-up first, fastest of the repeats kept, rotation from batch to batch, differences
    from ar of exact methods only, batch-1-only methods skipped and said so."""
    inputs, log = [1, 2, 3, 4], []
    # at batch 2: 2 batches, 2 repeats each; then 4 batches of 1, 2 repeats each
    ar = Toy("ar", [2.0, 1.0, 2.0, 2.0] + [1.0] * 8, log=log)
    fast = Toy("fast", [1.0, 0.5, 1.0, 0.25] + [0.5] * 8, log=log)
    off = Toy("off", [1.0] * 12, offset=1, log=log)  # differs from ar everywhere
    approx = Toy("approx", [1.0] * 8, offset=1, exact=False, only_batch1=True, log=log)
    methods = [ar, fast, off, approx]
    records, skipped = measure(methods, inputs, [2, 1], repeats=2, progress=False)
    assert all(m.prepared for m in methods)
    assert skipped == ["approx at batch 2 (batch size 1 only)"]
    assert records[("fast", 2)].seconds == [0.5, 0.25] and records[("ar", 2)].seconds == [1.0, 2.0]
    assert records[("off", 2)].differing == [0, 1, 2, 3] and not records[("approx", 1)].differing
    assert log[:12] == ["ar", "fast", "off"] * 2 + ["fast", "off", "ar"] * 2  # rotated
    rows = {(r["method"], r["batch_size"]): r for r in speed_rows(methods, records, "sentences")}
    assert rows[("fast", 2)]["per_batch_speedup"] == [2.0, 8.0]
    assert rows[("fast", 2)]["sentences_per_s"] == pytest.approx(4 / 0.75)
    assert rows[("approx", 1)]["identical_to_ar"] == 0.0 and rows[("ar", 1)]["exact"]
    assert rows[("fast", 2)]["speedup_vs_hf"] is None  # no hf in this run


def test_a_method_that_changes_its_output_on_a_repeat_fails_the_run():
    class Drifting(Toy):
        def run(self, batch):
            self.offset += 1
            return super().run(batch)

    methods = [Toy("ar", [1.0] * 4), Drifting("drift", [1.0] * 4)]
    with pytest.raises(RuntimeError, match="drift changed its output on a repeat"):
        measure(methods, [1], [1], repeats=2, progress=False)


def test_methods_are_one_class_and_one_registry_entry():
    registry = Registry("toy")

    @registry.add
    class Plain:
        name = "plain"

    assert registry.lookup("plain") is Plain
    with pytest.raises(ValueError, match="registered twice"):
        registry.add(Plain)
    with pytest.raises(ValueError, match=r"unknown method 'nope'; known: plain"):
        registry.lookup("nope")
    assert {"ar", "sd", "sd-int8", "sd-lookup", "hf", "hf-assisted", "hf-lookup"} <= set(CAUSAL)
    assert CAUSAL["hf-assisted"].batch1_only and CAUSAL["sd-int8"].cpu_kernels


def test_decode_ratios_leave_out_the_first_round():
    from specdecode.bench.runner import MethodRecord, decode_ratios

    # ar: 1 s of prefill for 1 token, then 9 tokens in 9 s; the method: the same prefill
    # committing 3 tokens, then 9 tokens in 3 s -> 3x after the first round (1.67x end to end)
    base = MethodRecord("ar", 1, seconds=[10.0, 10.0], tokens=[10, 10])
    base.first_round_seconds, base.first_round_tokens = [1.0, 1.0], [1, 1]
    rec = MethodRecord("sd", 1, seconds=[4.0, 2.0], tokens=[12, 3])
    rec.first_round_seconds, rec.first_round_tokens = [1.0, 2.0], [3, 3]
    ratios = decode_ratios(rec, base)
    assert ratios[0] == pytest.approx(3.0)
    assert ratios[1] is None  # that batch ended in its first round: no decode phase
    outside = MethodRecord("hf", 1, seconds=[5.0], tokens=[10])
    outside.first_round_seconds, outside.first_round_tokens = [None], [None]
    assert decode_ratios(outside, base) is None  # run outside the engine: not measured


def test_in_run_costs_per_call_leave_out_the_first_rounds():
    from specdecode.core.stats import CostFigures, DecodeStats

    # 10 s in 6 calls, of which the first round's 1 call took 4 s (the prefill): 1.2 s a call
    stats = DecodeStats([], verify_seconds=4.0, target_passes=1, draft_seconds=0.5)
    stats.end_first_round(CostFigures(), 4.5, 2)
    assert stats.costs_after_first_round() == CostFigures()  # nothing after the first round
    stats.verify_seconds, stats.target_passes = 10.0, 6
    after = stats.costs_after_first_round()
    assert after.verify_seconds / after.target_passes == pytest.approx(1.2)
    assert stats.first_round_costs == CostFigures(4.0, 0.5, 1, 0)


def test_bench_refuses_an_odd_bound_list(capsys):
    code = main(["bench", "--limit", "1", "--bound", "1", "12", "3", "--out", "/nonexistent"])
    assert code != 0
    assert "MIN MAX pairs" in capsys.readouterr().err


def test_bench_smoke_run(tiny_pair, tmp_path, capsys):
    target, draft, prompts = tiny_pair
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--skip",
            "1",
            "--limit",
            "3",
            "--max-new-tokens",
            "10",
            "--methods",
            "ar",
            "hf",
            "hf-assisted",
            "sd",
            "sd-int8",
            "--num-draft-tokens",
            "2",
            "3",
            "--batch-sizes",
            "1",
            "2",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((out / "record.json").read_text())
    assert record["ok"]
    labels = {(r["method"], r["batch_size"]) for r in record["methods"]}
    assert ("sd[k=3]", 2) in labels and ("hf-assisted", 1) in labels
    assert ("hf-assisted", 2) not in labels and any(
        "batch size 1 only" in s for s in record["skipped"]
    )
    for row in record["methods"]:
        assert not row["mismatches"]
        if row["method"] == "ar":
            assert row["speedup"]["geomean"] == pytest.approx(1.0)
        if row.get("leviathan_bound"):  # by hand: E[tokens a call] / cost of a call in steps
            k, alpha, c = row["k"], row["alpha"], row["c"]
            tokens = sum(alpha**i for i in range(k + 1))
            assert tokens == pytest.approx(row["tokens_per_target_call"], rel=1e-6)
            assert row["leviathan_bound"] == pytest.approx(tokens / (k * c + 1))
            speedup = statistics.geometric_mean(row["per_batch_speedup"])
            assert row["efficiency"] == pytest.approx(speedup / (tokens / (k * c + 1)))
        if row["method"].startswith("sd"):  # costs are calibrated on one row: batch 1 only
            assert ("modelled_speedup" in row) == (row["batch_size"] == 1), row
    assert {"speedup_vs_k.png", "tokens_per_s.png", "table.md"} <= {p.name for p in out.iterdir()}
    assert "| sd[k=2] |" in (out / "table.md").read_text()
    assert "record written" in capsys.readouterr().out
    # --skip 1 --limit 3: the set's prompts 1..3, said in the table
    assert record["prompt_ids"] == [p.id for p in load_prompts(prompts)][1:4]
    assert record["kernels"]["prepacked"] and record["kernels"]["packed_from_rows"] in (1, 2)
    assert "(3 after the first 1)" in (out / "table.md").read_text()


def test_bench_coupled_sampling_pairs_the_policies(tiny_pair, tmp_path, capsys):
    """--coupled: every method of one drafter commits the same sampled text on each prompt, so
    the policies' per-prompt ratios are paired; the coupling's own passes are timed apart."""
    target, draft, prompts = tiny_pair
    out = tmp_path / "coupled"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    args += ["--limit", "3", "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "5"]
    args += ["--methods", "ar", "sd", "--num-draft-tokens", "1", "3"]
    args += ["--length-policy", "constant", "heuristic", "--bound", "1", "4", "--coupled"]
    assert main([*args, "--out", str(out), "--quiet", "--no-plots"]) == 0
    record = json.loads((out / "record.json").read_text())
    rows = {r["method"]: r for r in record["methods"]}
    drafting = [r for label, r in rows.items() if label != "ar"]
    assert len(drafting) == 3 and all(r["unpaired"] == [] for r in drafting)
    assert len({r["drafted_per_round"] for r in drafting}) >= 2  # they did draft differently
    assert all(r["coupling_seconds"] > 0 for r in drafting)
    assert "| paired |" in (out / "table.md").read_text()
    bad = ["--temperature", "0", "--out", str(tmp_path / "greedy")]
    assert main([*args[:-1], *bad]) == 0  # the same run, greedy, without --coupled is fine
    assert main([*args, *bad]) != 0
    assert "--coupled pairs sampled text" in capsys.readouterr().err


def test_cli_generate_on_local_model_dirs(tiny_pair, capsys):
    target, draft, _ = tiny_pair
    code = main(
        [
            "generate",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--prompt",
            "t5 t6 t7",
            "--prompt",
            "t9",
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
            "--json",
            "--timings",
        ]
    )
    assert code == 0
    said = capsys.readouterr()
    records = json.loads(said.out)
    assert [r["prompt"] for r in records] == ["t5 t6 t7", "t9"]
    timings = next(x for x in said.err.splitlines() if x.startswith("[timings] "))
    stages = ["arguments", "imports", "model files", "tokenizer", "weights", "corpus", "prices"]
    assert [p.rsplit(" ", 2)[0] for p in timings[10:].split(";")[0].split(", ")] == [
        *stages,
        "decoding",
    ]
    # each row's tokens: the target's own greedy continuation (transformers, one prompt at a
    # time), up to and including its end token, and the completion is their text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    for record in records:
        ids = tokenizer(record["prompt"], return_tensors="pt").input_ids  # [1, prompt]
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=0,
                                    pad_token_id=0)[0, ids.shape[1]:].tolist()  # fmt: skip
        assert record["tokens"] == greedy[: greedy.index(0) + 1 if 0 in greedy else 6]
        assert record["completion"] == tokenizer.decode(record["tokens"], skip_special_tokens=True)


def test_cli_bad_input_message(tiny_pair, capsys):
    target, draft, _ = tiny_pair
    code = main(
        [
            "generate",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--prompt",
            "t5",
            "--top-p",
            "2",
        ]
    )
    assert code == 2
    assert "top_p must be in (0, 1], got 2.0" in capsys.readouterr().err
    prompts = tiny_pair[2]  # 4 prompts: skipping them all leaves nothing to bench
    code = main(["bench", "--target", "nowhere", "--prompts", str(prompts), "--skip", "4"])
    assert code == 2
    assert "no prompts to run" in capsys.readouterr().err


def test_seq2seq_bench_dense_variants_and_their_errors():
    from specdecode.bench.seq2seq import Seq2SeqBenchConfig

    cfg = Seq2SeqBenchConfig(
        pair="unused", methods=("ar", "ar+dense", "specdec", "specdec+dense"), block_sizes=(2, 3),
        relaxed=((5, 3.0),),
    )  # fmt: skip
    methods = cfg.method_list()
    packed = ["ar", "specdec[k=2]", "specdec[k=3]", "specdec[k=2,b=5,t=3]", "specdec[k=3,b=5,t=3]"]
    assert [m.label for m in methods] == packed + [f"{label}+dense" for label in packed]
    assert [m.dense for m in methods] == [False] * 5 + [True] * 5
    assert [m.exact for m in methods] == [True, True, True, False, False] * 2
    int8 = Seq2SeqBenchConfig(
        pair="unused", methods=("ar", "specdec-int8", "specdec-relaxed"), block_sizes=(3,),
        relaxed=((5, 3.0),),
    ).method_list()  # fmt: skip
    assert [m.label for m in int8] == [
        "ar", "specdec[k=3,b=5,t=3]", "specdec-int8[k=3]", "specdec-int8[k=3,b=5,t=3]",
    ]  # fmt: skip
    assert [m.exact for m in int8] == [True, False, True, False]
    alt = Seq2SeqBenchConfig(
        pair="unused", methods=("ar", "specdec-alt", "specdec-alt-int8"), block_sizes=(3,),
        relaxed=(), alt_drafter="elsewhere",
    ).method_list()  # fmt: skip
    assert [m.label for m in alt] == ["ar", "specdec-alt[k=3]", "specdec-alt-int8[k=3]"]
    assert all(m.exact and (m.kind == "ar") != m.speculative for m in alt)
    with pytest.raises(ValueError, match=r"need a second drafter: give --alt-drafter"):
        Seq2SeqBenchConfig(pair="unused", methods=("ar", "specdec-alt-int8+dense"))
    with pytest.raises(ValueError, match=r"unknown seq2seq methods \['sd\+dense'\]"):
        Seq2SeqBenchConfig(pair="unused", methods=("ar", "sd+dense"))
    with pytest.raises(ValueError, match="must include 'ar'"):
        Seq2SeqBenchConfig(pair="unused", methods=("ar+dense", "specdec"))
    with pytest.raises(ValueError, match=r"\+dense compares with packed kernels"):
        Seq2SeqBenchConfig(pair="unused", methods=("ar", "ar+dense"), prepack=False)


def test_from_pretrained_packs_the_target_and_can_draft_in_int8(tiny_pair):
    """On the CPU in fp32 the target gets packed kernels by default (verify passes cost about a
    step), and neither the packing nor an int8 drafter changes greedy output."""
    from specdecode.api import SpeculativeDecoder
    from specdecode.backends.kernels import kernel_summary, prepack_available

    target, draft, _ = tiny_pair
    plain = SpeculativeDecoder.from_pretrained(str(target), str(draft), prepack=False)
    assert not kernel_summary(plain.target)["prepacked"]
    packed = SpeculativeDecoder.from_pretrained(str(target), str(draft), drafter_int8=True)
    assert kernel_summary(packed.target)["prepacked"] == prepack_available()
    assert any(
        isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in packed.drafter.modules()
    )
    assert not kernel_summary(packed.drafter)["prepacked"]  # int8 instead
    fp32 = SpeculativeDecoder.from_pretrained(str(target), str(draft))  # drafter packed too
    assert kernel_summary(fp32.drafter)["prepacked"] == prepack_available()
    assert not kernel_summary(plain.drafter)["prepacked"]
    prompts = [[5, 6, 7], [9]]
    alone = SpeculativeDecoder.from_pretrained(str(target), None, prepack=False)
    ar = alone.generate(prompts, max_new_tokens=12)
    for decoder in (plain, packed, fp32):
        out = decoder.generate(prompts, max_new_tokens=12, num_draft_tokens=3)
        assert out.new_tokens == ar.new_tokens
    with pytest.raises(ValueError, match="drafter_int8 needs a drafter"):
        SpeculativeDecoder.from_pretrained(str(target), None, drafter_int8=True)
    with pytest.raises(ValueError, match="prepack needs float32 on the CPU"):
        SpeculativeDecoder.from_pretrained(str(target), None, dtype=torch.bfloat16, prepack=True)


def test_max_draft_batch_is_a_pair_bench_option(tiny_pair, tmp_path, capsys):
    target, draft, prompts = tiny_pair
    args = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    assert main([*args, "--max-draft-batch", "2", "--out", str(tmp_path / "b")]) == 2
    assert "--max-draft-batch is a --pair (seq2seq) bench option" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dtype", "bfloat16", "--methods", "ar", "sd-int8"], "run CPU kernels"),
        (["--device", "cuda:0", "--methods", "ar", "sd+dense"], "run CPU kernels"),
        (["--pair", "--device", "cuda"], "float32 on the CPU"),
    ],
)
def test_bench_refuses_cpu_kernels_elsewhere(extra, message, capsys):
    code = main(["bench", "--limit", "1", "--out", "/nonexistent", *extra])
    assert code != 0
    assert message in capsys.readouterr().err


def test_bench_runs_the_pair_in_the_dtype_asked(tiny_pair, tmp_path):
    """--dtype reaches the models (it was once parsed and dropped): bfloat16 runs on the CPU
    too, without the fp32-only methods, and greedy speculative text still equals ar's."""
    target, draft, prompts = tiny_pair
    out = tmp_path / "bf16"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    args += ["--limit", "2", "--max-new-tokens", "8", "--dtype", "bfloat16", "--quiet"]
    assert main([*args, "--out", str(out), "--no-plots"]) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["dtype"] == "bfloat16" and not record["config"]["prepack"]
    assert {r["method"] for r in record["methods"]} == {"ar", "hf", "hf-assisted", "sd[k=4]"}
    assert record["ok"] and not record["kernels"]["prepacked"]


def test_bench_prompt_lookup_methods(tiny_pair, tmp_path):
    """sd-lookup (this engine) and hf-lookup (transformers) draft by n-gram lookup: no drafter
    model, greedy output equal to plain decoding, hf-lookup at batch 1 only; sd-int8-lookup-first
    looks up before its int8 drafter."""
    target, draft, prompts = tiny_pair
    out = tmp_path / "bench"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]
    args += ["--limit", "3", "--max-new-tokens", "16", "--methods", "ar", "sd-lookup"]
    args += ["hf-lookup", "sd-int8-lookup-first", "--num-draft-tokens", "3"]
    args += ["--batch-sizes", "1", "2"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["ok"]
    rows = {(r["method"], r["batch_size"]): r for r in record["methods"]}
    assert {("sd-lookup[k=3]", 1), ("sd-lookup[k=3]", 2), ("hf-lookup[k=3]", 1)} <= set(rows)
    assert ("hf-lookup[k=3]", 2) not in rows and ("sd-int8-lookup-first[k=3]", 2) in rows
    lookup = rows[("sd-lookup[k=3]", 1)]
    assert lookup["drafter_passes_per_token"] == 0 and lookup["drafted_per_round"] > 0
    assert all(not r["mismatches"] for r in record["methods"])


class Priced:
    """A method whose time and output depend on its batch alone, so that a run split across
    processes must record what one process records."""

    def __init__(self, label, offset=0, exact=True):
        self.label, self.exact, self.pairing, self.offset = label, exact, None, offset

    def skips(self, batch_size):
        return None

    def prepare(self, sample):
        pass

    def run(self, batch):
        seconds = 0.1 * sum(batch) + 0.01 * len(batch)
        return Result([[x + self.offset, x % 3] for x in batch], seconds)


def test_a_run_shared_across_processes_merges_into_the_single_process_record():
    """Inputs cut into chunks of lcm(batch sizes), dealt to 3 processes, measured apart and
    merged: the same batches, times, outputs and differences, in input order."""
    from specdecode.bench.runner import chunks_of, measure, merge

    inputs = list(range(1, 12))  # 11 inputs: the last chunk is short
    sizes = [1, 2, 4]
    methods = [Priced("ar"), Priced("same"), Priced("bad", offset=1)]
    whole, _ = measure(methods, inputs, sizes, progress=False)
    parts = []
    for process in range(3):
        mine = chunks_of(len(inputs), sizes, process, 3)
        records, _ = measure(methods, [inputs[i] for i in mine], sizes, progress=False)
        parts.append((mine, records))
    assert sorted(i for mine, _ in parts for i in mine) == list(range(len(inputs)))
    merged = merge(parts, sizes)
    assert merged.keys() == whole.keys()
    for key, rec in whole.items():
        got = merged[key]
        assert got.outputs == rec.outputs and got.differing == rec.differing, key
        assert got.seconds == pytest.approx(rec.seconds) and got.inputs == rec.inputs, key
    assert merged[("bad", 4)].differing == list(range(len(inputs)))


def test_the_verdict_is_said_once_in_the_table(capsys):
    """A differing text is judged once the run is over, not announced while it runs: the
    table's column says yes, a near tie within the run's noise bound, or MISMATCH, and the
    record fails only on a mismatch."""
    from specdecode.bench.report import markdown_table, verdict
    from specdecode.bench.runner import TorchBenchConfig, bench_record

    methods = [Priced("ar"), Priced("tie", offset=1), Priced("bad", offset=1), Priced("same")]
    records, _ = measure(methods, [1, 2, 3], [1], progress=False)
    assert capsys.readouterr() == ("", "")  # nothing above the table
    rows = {r["method"]: r for r in speed_rows(methods, records, "tokens", also_against=())}
    assert rows["tie"]["differing"] == rows["bad"]["differing"] == [0, 1, 2]
    # as the llama.cpp bench judges them: top-2 gaps at the first divergences against its bound
    noise = 0.05
    for label, gaps in (("tie", [0.01, 0.02, 0.03]), ("bad", [0.01, 0.2, 0.03])):
        found = [{"input": i, "token": 0, "top2_gap": g} for i, g in enumerate(gaps)]
        rows[label].update(divergences=found)
        rows[label]["mismatches"] = [d["input"] for d in found if d["top2_gap"] > noise]
    config = TorchBenchConfig(target="t", draft="d", prompts="p", limit=3, max_new_tokens=2)
    record = bench_record(config, list(rows.values()), [], noise_bound=noise)
    assert not record["ok"]
    cells = {
        line.split("|")[1].strip(): line.strip().strip("|").split("|")[-1].strip()
        for line in markdown_table(record).splitlines()
        if line.startswith("| ") and not line.startswith("| method")
    }
    assert cells["same"] == "yes" == verdict(rows["same"], noise)
    assert cells["tie"].startswith("near tie") and "noise bound 0.050" in cells["tie"]
    assert "0: 0.010" in cells["tie"] and "2: 0.030" in cells["tie"]
    assert cells["bad"] == "MISMATCH (input 1)"
    assert cells["ar"] == "yes"


class FakeLlamaModel:
    """A llama.cpp model as the llama.cpp bench's `Shared` sees it: built, settled, closed."""

    def __init__(self, path: str, *, role: str, threads: int, context: int) -> None:
        self.role, self.context, self.closed = role, context, False
        self.huge_page_bytes = 0

    def close(self) -> None:
        self.closed = True


class FakeDecoder:
    """A decoder that counts its price timings and takes prices given to it."""

    timings = 0

    def __init__(self, target: FakeLlamaModel, tokenizer: object, drafter: object) -> None:
        self.target, self.drafter = target, drafter
        self.known_prices: object | None = None

    def prices(self, retime: bool = False) -> object:
        FakeDecoder.timings += 1
        self.known_prices = object()
        return self.known_prices

    def use_prices(self, prices: object) -> None:
        self.known_prices = prices


class FakePeer:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_llama_bench_holds_one_holders_models_at_a_time(monkeypatch):
    """A peer's turn closes this engine's target and drafter (and a peer's turn the other
    peer's, an engine method's turn the peer's); this engine's decoder is loaded again with the
    prices the run timed at its first load, rescaled where they were, and not timed again; its
    contexts are sized to the run, with room for the prices' passes, not to 4096 tokens."""
    from specdecode.bench import llamacpp as bench
    from specdecode.core.prices import PRICE_CONTEXT_TOKENS

    monkeypatch.setattr(bench, "LlamaCppModel", FakeLlamaModel)
    monkeypatch.setattr(bench, "SpeculativeDecoder", FakeDecoder)
    monkeypatch.setattr(bench, "gguf_path", lambda name: name)
    monkeypatch.setattr(bench.Shared, "tokenizer", lambda self: None)
    monkeypatch.setattr(FakeDecoder, "timings", 0)
    shared = bench.Shared(bench.LlamaBenchConfig(target="t", draft="d", threads=2), context=256)
    first = shared.decoder("model")
    target, drafter = first.target, first.drafter
    assert (target.role, drafter.role) == ("target", "drafter")
    assert target.context == drafter.context == shared.engine_context() > PRICE_CONTEXT_TOKENS
    assert FakeDecoder.timings == 1
    rescaled = first.known_prices = object()  # as the prices' watch rescales them

    peer = shared.peer_model("peer", FakePeer)
    assert target.closed and drafter.closed
    assert not shared.loaded("decoder model") and not shared.loaded("target")
    other = shared.peer_model("other peer", FakePeer)
    assert peer.closed and not other.closed

    again = shared.decoder("model")
    assert other.closed and not shared.loaded("other peer")
    assert again is not first and not again.target.closed and not again.drafter.closed
    assert again.known_prices is rescaled and FakeDecoder.timings == 1
    plain = shared.decoder(None)
    assert plain.target is again.target  # one holder's models are shared among its decoders
    shared.release()
    assert again.target.closed and again.drafter.closed and shared.holder is None


def test_an_engine_method_loads_and_warms_up_again_after_a_peer(monkeypatch):
    """The runner's timed call of an engine method after a peer's turn finds its models
    loaded and warmed up: the load and the warm-up (8 tokens) come first, untimed."""
    from specdecode.bench import llamacpp as bench

    calls: list[tuple[str, int, bool]] = []

    def fake_generate(self, prompts, s):
        calls.append((self.name, s.max_new_tokens, self.shared.loaded(self.key)))
        self.shared.held_model(self.holder, self.key, FakePeer)
        return Result([[1]] * len(prompts), 0.1)

    class Engine(bench.EngineOnLlama):
        name, holder, key = "engine-method", bench.ENGINE, "decoder model"
        generate = fake_generate

    class Peer(bench.LlamaMethod):
        name, holder, key = "peer-method", "peer-method", "peer-method"
        generate = fake_generate

        def loaded(self) -> bool:
            return self.shared.loaded(self.key)

    shared = bench.Shared(bench.LlamaBenchConfig(target="t", draft="d", threads=2))
    settings = Settings(max_new_tokens=16)
    engine, peer = Engine(None, shared, settings), Peer(None, shared, settings)
    for method in (engine, peer, engine):
        method.run([[5, 6]])
    assert calls == [
        ("engine-method", 8, False),  # loaded, warmed up
        ("engine-method", 16, True),  # timed
        ("peer-method", 8, False),
        ("peer-method", 16, True),
        ("engine-method", 8, False),  # closed at the peer's turn: loaded again, warmed up
        ("engine-method", 16, True),
    ]
