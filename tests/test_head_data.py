"""Head data: labels equal what verification does, and collect -> train -> bench runs end to end."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from specdecode.acceptance.collect import EXAMPLES_FILE, CollectConfig, collect
from specdecode.acceptance.head import law_features
from specdecode.cli.main import main
from specdecode.core.config import SamplingConfig
from specdecode.core.sampling import RowRandom, logits_to_probs
from specdecode.core.verification import GreedyRule, LosslessSamplingRule

PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]


def collected(tiny_llama, tmp_path, temperature: float, mixing: float = 0.3):
    target, drafter = tiny_llama(0, init=0.2), tiny_llama(0, init=0.2)
    torch.manual_seed(1)
    with torch.no_grad():  # the same weights perturbed: partial agreement
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn_like(p))
    cfg = CollectConfig(max_new_tokens=12, temperature=temperature, mixing_ratio=mixing)
    collect(target, drafter, PROMPTS, tmp_path, cfg, stop_ids=(), progress=False)
    return target, drafter, load_file(tmp_path / EXAMPLES_FILE)


def prefixes(examples: dict) -> list[list[int]]:
    """The committed sequence before every example, rebuilt from the recorded tokens."""
    committed: dict[int, list[int]] = {}
    order = sorted(
        range(len(examples["position"])),
        key=lambda i: (int(examples["prompt_index"][i]), int(examples["position"][i])),
    )
    rebuilt = [None] * len(order)
    for i in order:
        row = int(examples["prompt_index"][i])
        seq = committed.setdefault(row, list(PROMPTS[row]))
        rebuilt[i] = list(seq)
        seq.append(int(examples["token"][i]))
    return rebuilt


@torch.no_grad()
def fresh(model, prefix: list[int]):
    out = model(torch.tensor([prefix]), output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


def test_greedy_labels_are_what_greedy_verification_accepts(tmp_path, tiny_llama):
    target, drafter, ex = collected(tiny_llama, tmp_path, temperature=0.0)
    labels = ex["label_greedy"]
    assert 0.1 < labels.mean() < 0.9, "the pair must give both accepts and rejects"
    assert set(ex["prompt_index"].tolist()) == {0, 1, 2}
    for i, prefix in enumerate(prefixes(ex)):
        p_logits, _ = fresh(target, prefix)
        q_logits, hidden = fresh(drafter, prefix)
        proposal = q_logits.argmax()
        assert int(ex["proposal"][i]) == int(proposal)
        verdict = GreedyRule().verify(
            proposal.view(1, 1),
            None,
            torch.stack([p_logits, p_logits])[None],
            torch.ones(1, dtype=torch.long),
            None,
        )
        assert int(verdict.num_accepted[0]) == int(labels[i])
        torch.testing.assert_close(ex["hidden"][i].float(), hidden, atol=2e-2, rtol=1e-2)
        law = law_features(q_logits.softmax(-1))
        torch.testing.assert_close(ex["law_greedy"][i], law, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ex["law_sampling"][i], law, atol=1e-4, rtol=1e-4)
        expected = proposal if ex["mixed"][i] else p_logits.argmax()
        assert int(ex["token"][i]) == int(expected)
    assert 0 < ex["mixed"].float().mean() < 0.7
    # the drawn token is the argmax: its label is the greedy label, its log prob the top one
    torch.testing.assert_close(ex["label_drawn"], labels)
    torch.testing.assert_close(ex["drawn_log_prob"], ex["law_greedy"][:, 0], atol=1e-5, rtol=0)


def test_sampling_labels_are_the_lossless_acceptance_probability(tmp_path, tiny_llama):
    target, drafter, ex = collected(tiny_llama, tmp_path, temperature=0.8)
    sampling = SamplingConfig(0.8)
    rule = LosslessSamplingRule(sampling)
    for i, prefix in list(enumerate(prefixes(ex)))[:: max(1, len(ex["position"]) // 6)]:
        p_logits, _ = fresh(target, prefix)
        q_logits, _ = fresh(drafter, prefix)
        p, q = (
            logits_to_probs(p_logits[None], sampling)[0],
            logits_to_probs(q_logits[None], sampling)[0],
        )
        assert float(ex["label_sampling"][i]) == pytest.approx(
            float(torch.minimum(p, q).sum()), abs=1e-5
        )
        torch.testing.assert_close(ex["law_sampling"][i], law_features(q), atol=1e-4, rtol=1e-4)
        z = int(ex["proposal"][i])
        assert float(ex["label_drawn"][i]) == pytest.approx(min(1.0, float(p[z] / q[z])), abs=1e-5)
        assert float(ex["drawn_log_prob"][i]) == pytest.approx(math.log(q[z]), abs=1e-5)
        law = law_features(q_logits.softmax(-1))
        torch.testing.assert_close(ex["law_greedy"][i], law, atol=1e-4, rtol=1e-4)
        # Monte Carlo through the rule itself: draw from q, verify, count acceptances
        n = 3000
        gen = torch.Generator().manual_seed(i)
        drafts = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]  # [n, 1]
        logits = torch.stack([p_logits, p_logits])[None].expand(n, 2, -1)
        rng = RowRandom.for_batch(n, None, tuple(range(i * n, (i + 1) * n)))
        verdict = rule.verify(
            drafts, q.expand(n, 1, -1), logits, torch.ones(n, dtype=torch.long), rng
        )
        rate = verdict.num_accepted.float().mean().item()
        assert rate == pytest.approx(float(ex["label_sampling"][i]), abs=0.035)


def test_collection_resumes_and_refuses_other_settings(tmp_path, tiny_llama):
    target, drafter = tiny_llama(0), tiny_llama(1, layers=1)
    cfg = CollectConfig(max_new_tokens=4, batch_size=2)
    first = collect(target, drafter, PROMPTS[:2], tmp_path, cfg, (), progress=False)
    more = collect(target, drafter, PROMPTS, tmp_path, cfg, (), progress=False)
    assert more["num_prompts"] == 3 and more["num_examples"] > first["num_examples"]
    with pytest.raises(ValueError, match="other settings or models"):
        collect(
            target, drafter, PROMPTS, tmp_path, CollectConfig(max_new_tokens=5), (), progress=False
        )


def test_collect_train_bench_end_to_end(tiny_pair, tmp_path, capsys):
    target, draft, prompts = tiny_pair
    data, head, bench = tmp_path / "data", tmp_path / "head", tmp_path / "bench"
    common = ["--target", str(target), "--draft", str(draft)]
    assert (
        main(
            [
                "head",
                "collect",
                *common,
                "--prompts",
                str(prompts),
                "--skip",
                "1",
                "--max-new-tokens",
                "16",
                "--batch-size",
                "2",
                "--temperature",
                "0",
                "--out",
                str(data),
                "--no-progress",
            ]
        )
        == 0
    )
    meta = json.loads((data / "meta.json").read_text())
    assert meta["skip"] == 1 and meta["num_prompts"] == 3 and meta["mixing_ratio"] == 0.15
    assert (
        main(
            [
                "head",
                "train",
                str(data),
                "--out",
                str(head),
                "--epochs",
                "2",
                "--batch-size",
                "16",
                "--val-fraction",
                "0.34",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (head / "head.safetensors").is_file() and (head / "reliability.png").is_file()
    code = main(
        [
            "bench",
            *common,
            "--prompts",
            str(prompts),
            "--limit",
            "2",
            "--max-new-tokens",
            "10",
            "--methods",
            "ar",
            "sd",
            "--num-draft-tokens",
            "2",
            "3",
            "--length-policy",
            "constant",
            "heuristic",
            "confidence",
            "head",
            "--stop-threshold",
            "0.3",
            "0.7",
            "--head",
            str(head),
            "--bound",
            "1",
            "5",
            "2",
            "5",
            "--priced",
            "--out",
            str(bench),
            "--quiet",
        ]
    )
    assert code == 0
    record = json.loads((bench / "record.json").read_text())
    assert record["ok"]
    labels = {r["method"] for r in record["methods"]}
    assert {
        "sd[k=2]",
        "sd[heuristic k0=3 1..5]",
        "sd[heuristic k0=3 2..5]",
        "sd[confidence t=0.4 1..5]",
        "sd[head t=0.7 2..5]",
        "sd[head t=0.3 1..5]",
        "sd[head t=0.7 1..5]",
        "sd[head t=0.7 1..5 priced]",  # --priced: each head method also priced
        "sd[head t=0.3 2..5 priced]",
    } <= labels
    assert not any("priced" in label for label in labels if "head" not in label)
    head_row = next(r for r in record["methods"] if r["method"] == "sd[head t=0.3 1..5]")
    assert head_row["policy_seconds"] > 0 and head_row["policy_ms_per_drafted_token"] > 0
    assert "leviathan_bound" not in head_row  # the bound assumes a constant k
    measured = record["models"]["head"]  # the record names the exact head it measured
    assert measured["dir"] == str(head) and measured["config"]["rule"] == "greedy"
    assert (
        measured["sha256"] == hashlib.sha256((head / "head.safetensors").read_bytes()).hexdigest()
    )
    assert {"policy_sweep.png", "policy_pareto.png"} <= {p.name for p in bench.iterdir()}
    compared = {c["method"]: c for c in record["policy_comparison"]}
    assert compared["sd[head t=0.3 1..5]"]["best_constant"] in ("sd[k=2]", "sd[k=3]")
    assert compared["sd[heuristic k0=3 1..5]"]["batches"] == 2
    # a floor of 2 tokens per round: no round of that policy drafted fewer (budget allowing)
    floored = next(r for r in record["methods"] if r["method"] == "sd[head t=0.7 2..5]")
    assert floored["drafted_per_round"] >= 1.5
    # decoding after the first round (the prefills), beside the end-to-end ratio
    for row in record["methods"]:
        assert len(row["per_batch_decode_speedup"]) == 2
    ar_row = next(r for r in record["methods"] if r["method"] == "ar")
    assert ar_row["decode_speedup"]["geomean"] == pytest.approx(1.0)
    decode = compared["sd[head t=0.3 1..5]"]
    assert decode["decode_best_constant"] in ("sd[k=2]", "sd[k=3]")
    d_low, d_high = decode["decode_vs_best_constant_95ci"]
    assert d_low <= decode["decode_vs_best_constant"] <= d_high
    low, high = compared["sd[head t=0.3 1..5]"]["vs_best_constant_95ci"]
    assert low <= compared["sd[head t=0.3 1..5]"]["vs_best_constant"] <= high
    assert "against the best constant k" in (bench / "table.md").read_text()
    assert all(r["modelled_speedup"] > 0 for r in record["methods"] if r["method"] != "ar")
    assert compared["sd[head t=0.3 1..5]"]["modelled_best_constant"] in ("sd[k=2]", "sd[k=3]")
    # a saved run's derived figures are recomputed from its measurements alone
    record["policy_comparison"] = []
    for row in record["methods"]:
        row.pop("modelled_speedup", None)
    (bench / "record.json").write_text(json.dumps(record))
    assert main(["bench", "--rederive", str(bench), "--no-plots"]) == 0
    again = json.loads((bench / "record.json").read_text())
    assert {c["method"] for c in again["policy_comparison"]} == set(compared)
    assert all(r["modelled_speedup"] > 0 for r in again["methods"] if r["method"] != "ar")
    # the trained head drives generation from the command line too
    assert (
        main(
            [
                "generate",
                *common,
                "--prompt",
                "t5 t6",
                "--max-new-tokens",
                "6",
                "--drafting",
                "model",
                "--length-policy",
                "head",
                "--head",
                str(head),
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    priced = [*common, "--prompt", "t5 t6", "--max-new-tokens", "6", "--head", str(head)]
    priced += ["--drafting", "model"]
    assert main(["generate", *priced, "--length-policy", "head", "--priced", "--json"]) == 0
    assert "[round prices] a drafted token" in capsys.readouterr().err
    assert main(["generate", *priced, "--length-policy", "confidence", "--priced"]) != 0
    assert "--priced prices the head policies' rounds" in capsys.readouterr().err


def test_head_for_another_drafter_is_refused_on_the_command_line(tiny_pair, tmp_path, capsys):
    from specdecode.acceptance.head import AcceptanceHead, HeadConfig, ModelIdentity

    target, draft, _ = tiny_pair
    AcceptanceHead(HeadConfig(32, drafter=ModelIdentity("other", "0" * 16), target=None)).save(
        tmp_path / "h"
    )
    code = main(
        [
            "generate",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--prompt",
            "t5",
            "--drafting",
            "model",
            "--length-policy",
            "head",
            "--head",
            str(tmp_path / "h"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "trained for the drafter 'other'" in err and "specdecode head collect" in err


def test_policy_preview_replays_decoding_like_a_direct_walk():
    """On 0/1 labels decoding is deterministic: walk each response round by round."""
    from specdecode.acceptance.replay import preview_policies
    from specdecode.core.prices import Prices

    gen = torch.Generator().manual_seed(0)
    label = (torch.rand(40, generator=gen) < 0.7).float()
    pred = torch.rand(40, generator=gen) * 0.5 + 0.5
    prompt = torch.tensor([0] * 25 + [1] * 15)
    position = torch.cat([torch.arange(25), torch.arange(15)])
    shuffle = torch.randperm(40, generator=gen)  # the preview must not rely on storage order
    costs = Prices.stated(draft=0.2, verify_slope=0.05)
    rows = preview_policies(
        pred[shuffle], label[shuffle], prompt[shuffle], position[shuffle], (2, 5), costs
    )

    def walk(stop_after) -> dict[str, float]:
        rounds = tokens = drafted = cost = 0
        for first, end in ((0, 25), (25, 40)):
            t = first
            while t < end:  # a round starts where the last one ended
                m = stop_after(t, end)
                accepted = 0
                while accepted < m and label[t + accepted] == 1:
                    accepted += 1
                rounds, tokens, drafted = rounds + 1, tokens + accepted + 1, drafted + m
                cost += 1 + (0.05 + 0.2) * m
                t += accepted + 1
        return {"tokens": tokens / rounds, "drafted": drafted / rounds, "speed": tokens / cost}

    def head_stop(h):
        def stop_after(j, end):
            prod, m = 1.0, 0
            while m < 5 and j + m < end:
                prod *= float(pred[j + m])
                m += 1
                if m >= 2 and 1 - prod > h:
                    break
            return m

        return stop_after

    def check(row, expected):
        assert row["tokens_per_round"] == pytest.approx(expected["tokens"])
        assert row["drafted_per_round"] == pytest.approx(expected["drafted"])
        assert row["est_speed"] == pytest.approx(expected["speed"])

    check(rows["k=3"], walk(lambda j, e: min(3, e - j)))
    for h in (0.3, 0.6):
        check(rows[f"head h={h:g}"], walk(head_stop(h)))

    # a perfect head on 0/1 labels drafts exactly up to the first rejection (at least 2, the
    # bound's minimum, and at most 5), so it wastes at most one drafted token a round
    def up_to_first_rejection(j, e):
        m = 1
        while m < min(5, e - j) and label[j + m - 1] == 1:
            m += 1
        return min(max(m, 2), e - j)

    oracle = rows["oracle h=0.5"]
    check(oracle, walk(up_to_first_rejection))
    assert oracle["drafted_per_round"] <= oracle["tokens_per_round"] + 1
    assert oracle["drafted_per_round"] < rows["k=5"]["drafted_per_round"]


def test_policy_preview_takes_the_expectation_over_sampled_verdicts():
    """Two positions, k = 1, acceptance a0 and a1: the replay's expectations by hand."""
    from specdecode.acceptance.replay import preview_policies
    from specdecode.core.prices import Prices

    a0, a1 = 0.3, 0.8
    rows = preview_policies(
        torch.tensor([0.9, 0.9]),
        torch.tensor([a0, a1]),
        torch.tensor([0, 0]),
        torch.tensor([0, 1]),
        (1, 1),
        Prices.stated(draft=0.5, verify_slope=0.0),
    )
    # from position 1: one round, 1 + a1 tokens; from 0: rejected (1 - a0) -> 1 token, then the
    # round at 1; accepted (a0) -> 2 tokens and the response is done
    rounds = 1 + (1 - a0)
    tokens = (1 - a0) * (1 + 1 + a1) + a0 * 2
    assert rows["k=1"]["tokens_per_round"] == pytest.approx(tokens / rounds)
    assert rows["k=1"]["est_speed"] == pytest.approx(tokens / (1.5 * rounds))
    with pytest.raises(ValueError, match="draft must be a finite number"):
        Prices.stated(draft=-1.0)


def test_shipped_heads_are_found_for_their_exact_pair(tmp_path, monkeypatch, tiny_llama):
    """A head shipped in the package is used for its pair and rule only, with no loading step."""
    from specdecode.acceptance import head as acceptance_head
    from specdecode.acceptance.head import AcceptanceHead, HeadConfig, ModelIdentity, load_head
    from specdecode.api import SpeculativeDecoder

    for shipped in sorted(acceptance_head.SHIPPED_DIR.glob("*/head_config.json")):
        head = load_head(shipped.parent)  # every shipped head loads and names its pair
        assert head.config.rule in ("greedy", "sampling") and head.config.drafter is not None

    target, drafter = tiny_llama(0), tiny_llama(1, layers=1)
    monkeypatch.setattr(acceptance_head, "SHIPPED_DIR", tmp_path)
    config = HeadConfig(
        32, rule="greedy", drafter=ModelIdentity.of(drafter), target=ModelIdentity.of(target)
    )
    AcceptanceHead(config).save(tmp_path / "pair-greedy")
    assert acceptance_head.find_shipped_head(drafter, target, "greedy") == tmp_path / "pair-greedy"
    assert acceptance_head.find_shipped_head(drafter, target, "sampling") is None
    assert acceptance_head.find_shipped_head(tiny_llama(2), target, "greedy") is None
    # the same pair loaded in lower precision (a GPU's bfloat16) still finds its head
    low = [copy.deepcopy(m).to(torch.bfloat16) for m in (drafter, target)]
    assert acceptance_head.find_shipped_head(*low, "greedy") == tmp_path / "pair-greedy"
    low_other = tiny_llama(2, layers=1).to(torch.bfloat16)
    assert acceptance_head.find_shipped_head(low_other, low[1], "greedy") is None
    decoder = SpeculativeDecoder(target, drafter=drafter)
    out = decoder.generate(
        [[5, 6, 7]], max_new_tokens=8, drafting="model", length_policy="head", stop_token_ids=[]
    )
    plain = decoder.generate([[5, 6, 7]], max_new_tokens=8, use_drafter=False, stop_token_ids=[])
    assert out.new_tokens == plain.new_tokens and out.stats.policy_seconds > 0
    with pytest.raises(ValueError, match="none ships for this drafter"):
        decoder.generate(
            [[5, 6, 7]], max_new_tokens=8, drafting="model", length_policy="head", temperature=0.7
        )
