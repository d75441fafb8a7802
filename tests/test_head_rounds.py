"""Head data recorded inside real rounds: every drafted token, labelled as verification decides."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from specdecode.acceptance.collect import EXAMPLES_FILE, CollectConfig, collect
from specdecode.acceptance.head import law_features
from specdecode.acceptance.replay import preview_rounds, replay_heads
from specdecode.acceptance.train import TrainConfig, train_head
from specdecode.backends.torch_eager import CachedModel
from specdecode.cli.main import main
from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.drafting.model import ModelDrafter
from specdecode.core.engine import decode
from specdecode.core.length_policies import ConstantLength
from specdecode.core.prices import Prices
from specdecode.core.sampling import logits_to_probs
from specdecode.core.verification import make_rule

PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20, 21]]
K = 3


def pair(tiny_llama):
    target, drafter = tiny_llama(0, init=0.2), tiny_llama(0, init=0.2)
    torch.manual_seed(1)
    with torch.no_grad():  # the same weights perturbed: partial agreement
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return target, drafter


def plain_outputs(target, drafter, temperature: float) -> list[list[int]]:
    """What the engine commits with a constant k = K and the collection's row seeds."""
    sampling = SamplingConfig(temperature)
    cfg = DecodeConfig(
        max_new_tokens=12, num_draft_tokens=K, sampling=sampling, row_seeds=(0, 1, 2, 3)
    )
    vocab = target.get_output_embeddings().weight.shape[0]
    model_drafter = ModelDrafter(CachedModel(drafter), sampling, vocab, ConstantLength(K))
    out: list[list[int]] = [[] for _ in PROMPTS]
    rule = make_rule(None, sampling)
    for event in decode(CachedModel(target), model_drafter, rule, PROMPTS, cfg):
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            out[row] += tokens
    return out


@torch.no_grad()
def fresh(model, prefix: list[int]):
    out = model(torch.tensor([prefix]), output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]


def collected(tiny_llama, tmp_path, temperature: float):
    target, drafter = pair(tiny_llama)
    cfg = CollectConfig(max_new_tokens=12, temperature=temperature, mixing_ratio=0.0, rounds=K)
    meta = collect(target, drafter, PROMPTS, tmp_path, cfg, stop_ids=(), progress=False)
    assert meta["rounds"] == K
    return target, drafter, load_file(tmp_path / EXAMPLES_FILE)


def rounds_of(ex: dict) -> dict[int, list[int]]:
    """round id -> its examples in slot order."""
    out: dict[int, list[int]] = {}
    for i in sorted(
        range(len(ex["slot"])), key=lambda i: (int(ex["round"][i]), int(ex["slot"][i]))
    ):
        out.setdefault(int(ex["round"][i]), []).append(i)
    return out


def prefix_of(ex: dict, i: int, rounds: dict, texts: list[list[int]]) -> list[int]:
    """Prompt + committed text before the round + the round's earlier drafts."""
    row, slot = int(ex["prompt_index"][i]), int(ex["slot"][i])
    start = int(ex["position"][i]) - slot
    same_round = rounds[int(ex["round"][i])][:slot]
    return PROMPTS[row] + texts[row][:start] + [int(ex["proposal"][j]) for j in same_round]


def test_greedy_rounds_label_every_drafted_token_as_verification_does(tmp_path, tiny_llama):
    target, drafter, ex = collected(tiny_llama, tmp_path, temperature=0.0)
    texts = plain_outputs(*pair(tiny_llama), temperature=0.0)
    rounds = rounds_of(ex)
    labels = ex["label_greedy"]
    assert 0.1 < labels.mean() < 0.9, "the pair must give both accepts and rejects"
    assert set(ex["prompt_index"].tolist()) == set(range(len(PROMPTS)))
    for members in rounds.values():
        assert [int(ex["slot"][i]) for i in members] == list(range(len(members)))
        assert len(members) <= K
    # the next round of a prompt starts after the accepted drafts (the leading 1s) + one token
    by_prompt: dict[int, list[list[int]]] = {}
    for members in rounds.values():
        by_prompt.setdefault(int(ex["prompt_index"][members[0]]), []).append(members)
    for row, row_rounds in by_prompt.items():
        for this, nxt in itertools.pairwise(row_rounds):
            accepted = 0
            while accepted < len(this) and labels[this[accepted]] == 1:
                accepted += 1
            assert int(ex["position"][nxt[0]]) == int(ex["position"][this[0]]) + accepted + 1
        # and the committed text holds each accepted draft
        for members in row_rounds:
            start = int(ex["position"][members[0]])
            for i in members:
                if labels[i] != 1:
                    break
                assert texts[row][start + int(ex["slot"][i])] == int(ex["proposal"][i])
    for i in range(len(labels)):
        prefix = prefix_of(ex, i, rounds, texts)
        p_logits, _ = fresh(target, prefix)
        q_logits, hidden = fresh(drafter, prefix)
        assert int(ex["proposal"][i]) == int(q_logits.argmax())
        assert float(labels[i]) == float(q_logits.argmax() == p_logits.argmax())
        torch.testing.assert_close(ex["hidden"][i].float(), hidden, atol=2e-2, rtol=1e-2)
        law = law_features(q_logits.softmax(-1))
        torch.testing.assert_close(ex["law_greedy"][i], law, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ex["label_drawn"], labels)
    torch.testing.assert_close(ex["label_sampling"], labels)


def test_sampled_rounds_label_the_drawn_token_and_change_no_output(tmp_path, tiny_llama):
    target, drafter, ex = collected(tiny_llama, tmp_path, temperature=0.8)
    # the fresh passes below see the text plain decoding commits: recording changes nothing
    texts = plain_outputs(*pair(tiny_llama), temperature=0.8)
    rounds = rounds_of(ex)
    sampling = SamplingConfig(0.8)
    assert (ex["slot"] > 0).any(), "rounds must hold drafts after drafts"
    for i in range(len(ex["slot"])):
        prefix = prefix_of(ex, i, rounds, texts)
        p_logits, _ = fresh(target, prefix)
        q_logits, _ = fresh(drafter, prefix)
        p = logits_to_probs(p_logits[None], sampling)[0]
        q = logits_to_probs(q_logits[None], sampling)[0]
        z = int(ex["proposal"][i])
        assert float(ex["label_drawn"][i]) == pytest.approx(min(1.0, float(p[z] / q[z])), abs=1e-5)
        assert float(ex["label_sampling"][i]) == pytest.approx(
            float(torch.minimum(p, q).sum()), abs=1e-5
        )
        assert float(ex["drawn_log_prob"][i]) == pytest.approx(math.log(q[z]), abs=1e-4)
        assert float(ex["label_greedy"][i]) == float(q_logits.argmax() == p_logits.argmax())
        torch.testing.assert_close(ex["law_sampling"][i], law_features(q), atol=1e-4, rtol=1e-4)


def test_a_head_trains_on_rounds_and_previews_them_round_by_round(tmp_path, capsys, tiny_llama):
    collected(tiny_llama, tmp_path / "data", temperature=0.8)
    config = TrainConfig(rule="sampling", epochs=1, num_layers=1, val_fraction=0.5)
    result = train_head(tmp_path / "data", tmp_path / "head", config, progress=False)
    assert result["preview_kind"] == "rounds"
    preview = result["policy_preview"]
    assert {"k=1", f"k={K}", "head h=0.5", "oracle h=0.5"} <= preview.keys()
    # a higher threshold stops later: rounds never get shorter
    drafted = [preview[f"head h={h:g}"]["drafted_per_round"] for h in (0.1, 0.5, 0.9)]
    assert drafted == sorted(drafted)
    assert preview["k=1"]["drafted_per_round"] == pytest.approx(1.0)

    # `head replay` replays the saved head on the whole collection, paired with the constants
    main(
        [
            "head",
            "replay",
            str(tmp_path / "data"),
            "--head",
            str(tmp_path / "head"),
            "--json",
            str(tmp_path / "replay.json"),
        ]
    )
    out = capsys.readouterr().out
    replay = json.loads((tmp_path / "replay.json").read_text())
    best = replay["best_constant"]
    assert f"best constant {best}" in out
    assert replay["constants"][best]["vs_best_constant"] == pytest.approx(1.0)
    assert all(r["vs_best_constant"] <= 1.0 + 1e-12 for r in replay["constants"].values())
    rows = replay["heads"][str(tmp_path / "head")]
    assert {"head h=0.5", "oracle h=0.5"} <= rows.keys()
    # the paired interval holds the ratio; the best constant against itself is exactly 1
    assert replay["constants"][best]["vs_best_constant_95"] == pytest.approx([1.0, 1.0])
    for row in [*rows.values(), *replay["constants"].values()]:
        low, high = row["vs_best_constant_95"]
        assert low - 1e-9 <= row["vs_best_constant"] <= high + 1e-9
    # a collection along mixed sequences cannot be replayed round by round
    mixed = CollectConfig(max_new_tokens=6, temperature=0.8)
    collect(*pair(tiny_llama), PROMPTS, tmp_path / "mixed", mixed, stop_ids=(), progress=False)
    with pytest.raises(ValueError, match="collect --rounds K"):
        replay_heads(tmp_path / "mixed", [tmp_path / "head"])


def replay_inputs(rounds: list[tuple[int, list[float]]]):
    """One response's recorded rounds as (start position, labels of the drafts) -> the
    tensors `preview_rounds` reads, with the labels as predictions too."""
    cols: dict[str, list] = {"label": [], "prompt": [], "position": [], "round": [], "slot": []}
    for r, (start, labels) in enumerate(rounds):
        for j, a in enumerate(labels):
            for key, value in zip(cols, (a, 0, start + j, r, j), strict=True):
                cols[key].append(value)
    label = torch.tensor(cols["label"])
    ints = (torch.tensor(cols[k]) for k in ("prompt", "position", "round", "slot"))
    return label, label, *ints


def test_round_preview_replays_the_recorded_text_round_by_round():
    """Rounds of 3 recorded: A accepts 1 of 3, B all 3 (its bonus token follows), C none;
    D is the last (no successor, left out). By hand: text A0 + correction, then B0 B1 B2 +
    bonus, C0's correction: 7 tokens, whatever the policy."""
    recorded = [(0, [1.0, 0.0, 1.0]), (2, [1.0, 1.0, 1.0]), (6, [0.0, 1.0, 1.0]), (7, [1.0])]
    costs = Prices.stated(draft=0.2, verify_slope=0.1)
    rows = preview_rounds(*replay_inputs(recorded), (1, 3), costs)

    def rounds_of(row):
        committed = 7
        assert row["tokens_per_round"] == pytest.approx(
            committed / round(committed / row["tokens_per_round"])
        )
        return round(committed / row["tokens_per_round"])

    # k = 3 is the recording itself: 3 rounds, 9 drafted
    assert rounds_of(rows["k=3"]) == 3
    assert rows["k=3"]["drafted_per_round"] == pytest.approx(3.0)
    # k = 1: A0 (+A1 correction... no: A0 accepted, bonus coupled with A1's rejection) = 1
    # round; B0+B1, B2+bonus, C0 rejected: 3 rounds
    assert rounds_of(rows["k=1"]) == 4
    assert rows["k=1"]["est_speed"] == pytest.approx(7 / (4 + 0.3 * 4))
    # k = 2: A0 A1(rejected) = 1 round; B0 B1 + B2; bonus C0(rejected): 2 rounds, 5 drafted
    assert rounds_of(rows["k=2"]) == 3
    assert rows["k=2"]["drafted_per_round"] == pytest.approx(6 / 3)
    # the oracle on 0/1 labels stops at the first predicted rejection: A0 A1 stop (1 round),
    # B0 B1 B2 (3 drafted, all kept: bonus), then C0 stops: 3 rounds, 2 + 3 + 1 drafted
    oracle = rows["oracle h=0.5"]
    assert rounds_of(oracle) == 3
    assert oracle["drafted_per_round"] == pytest.approx(6 / 3)


def test_a_verify_curve_prices_each_round_by_its_length():
    """The rounds of the hand-made recording above, priced by a curve: a curve that follows
    the line replays as the line does, and a curve flat to 2 then dear prices k = 1's four
    rounds of 1 and k = 3's three rounds of 3 by its own entries."""
    recorded = [(0, [1.0, 0.0, 1.0]), (2, [1.0, 1.0, 1.0]), (6, [0.0, 1.0, 1.0]), (7, [1.0])]
    inputs = replay_inputs(recorded)
    line = preview_rounds(*inputs, (1, 3), Prices.stated(0.2, 0.1))
    as_line = preview_rounds(*inputs, (1, 3), Prices.stated(0.2, 0.1, verify_curve=(1.1, 1.2)))
    for name, row in line.items():
        assert as_line[name]["est_speed"] == pytest.approx(row["est_speed"]), name
    dear = preview_rounds(*inputs, (1, 3), Prices.stated(0.2, 0.0, verify_curve=(0.9, 0.9, 2.0)))
    assert dear["k=1"]["est_speed"] == pytest.approx(7 / (4 * (0.9 + 0.2)))
    assert dear["k=3"]["est_speed"] == pytest.approx(7 / (3 * (2.0 + 3 * 0.2)))
    assert dear["k=3"]["per_prompt"] == [[7, 3, 9, pytest.approx(7.8)]]
    costs = Prices.stated(0.1, 0.05, verify_curve=(0.9, 1.0)).rounds(1)
    assert [costs.round_cost(m) for m in (1, 2, 4)] == pytest.approx([1.0, 1.2, 1.5])
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="verify_curve must be a finite number"):
            Prices.stated(0.2, verify_curve=(1.0, bad))


def test_priced_replay_rows_follow_the_prices():
    """`priced h=...` rows: a head told the replay's own prices. Where the verify pass is
    flat they replay as the threshold rule's rows; where the third token's pass is dear, a
    head of middling predictions stops at two where the threshold rule drafted three."""
    recorded = [(0, [1.0, 0.0, 1.0]), (2, [1.0, 1.0, 1.0]), (6, [0.0, 1.0, 1.0]), (7, [1.0])]
    label, _, *ints = replay_inputs(recorded)
    middling = torch.full_like(label, 0.8)  # P(all accepted): 0.8, 0.64, 0.51
    flat = preview_rounds(middling, label, *ints, (1, 3), Prices.stated(0.2, 0.0))
    for h in ("0.3", "0.5", "0.7", "0.9"):
        assert flat[f"priced h={h}"] == flat[f"head h={h}"], h
    jump = Prices.stated(0.2, 0.0, verify_curve=(1.0, 1.0, 1.6))
    dear = preview_rounds(middling, label, *ints, (1, 3), jump)
    assert dear["head h=0.5"]["drafted_per_round"] == pytest.approx(3.0)  # risk 0.49 at 3
    assert dear["priced h=0.5"]["est_speed"] == pytest.approx(dear["k=2"]["est_speed"])
    assert dear["priced h=0.5"]["est_speed"] > dear["head h=0.5"]["est_speed"]
    assert [jump.rounds(1).verify(m) for m in (1, 2, 3)] == pytest.approx([1.0, 1.0, 1.6])
    assert "priced h=0.5" not in preview_rounds(middling, label, *ints, (1, 3), Prices.stated(0.0))


def test_a_rounds_first_token_can_be_predicted_apart():
    """`first_pred` serves a round's first drafted token only: a head sure of every token but
    told the first of each round is doomed stops every round after one token (as k = 1 does),
    and told it is safe drafts as the sure head does (as k = 3, the bound)."""
    recorded = [(0, [1.0, 0.0, 1.0]), (2, [1.0, 1.0, 1.0]), (6, [0.0, 1.0, 1.0]), (7, [1.0])]
    label, _, *ints = replay_inputs(recorded)
    sure = torch.ones_like(label)
    costs = Prices.stated(0.2, 0.1)
    doomed = preview_rounds(sure, label, *ints, (1, 3), costs, first_pred=torch.zeros_like(label))
    safe = preview_rounds(sure, label, *ints, (1, 3), costs, first_pred=sure)
    for h in ("0.1", "0.5", "0.9"):
        assert doomed[f"head h={h}"]["est_speed"] == pytest.approx(doomed["k=1"]["est_speed"])
        assert safe[f"head h={h}"]["est_speed"] == pytest.approx(safe["k=3"]["est_speed"])
    assert doomed["k=1"]["est_speed"] != pytest.approx(doomed["k=3"]["est_speed"])


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=2, max_size=12))
@settings(max_examples=60, deadline=None)
def test_every_policy_commits_the_recorded_text(shape):
    """Rounds of n drafts accepting a (<= n): every replayed policy commits the same tokens,
    and the constant of the recording's own length reproduces its rounds."""
    gen = torch.Generator().manual_seed(len(shape))
    recorded, start = [], 0
    for n, a in shape:
        a = min(a, n)
        labels = [1.0] * a + [0.0] * (n - a)
        recorded.append((start, labels))
        start += a + 1
    label, _, *ints = replay_inputs(recorded)
    pred = torch.rand(len(label), generator=gen)
    rows = preview_rounds(pred, label, *ints, (1, 4), Prices.stated(0.1, 0.0))
    text = sum(min(a, n) + 1 for n, a in shape[:-1])
    for name, row in rows.items():
        rounds = text / row["tokens_per_round"]
        assert rounds == pytest.approx(round(rounds)), name
        assert row["est_speed"] == pytest.approx(
            text / (rounds + 0.1 * rounds * row["drafted_per_round"])
        )
    if len({n for n, _ in shape[:-1]}) == 1:  # one round length n: k = n is the recording
        n = shape[0][0]
        assert text / rows[f"k={n}"]["tokens_per_round"] == pytest.approx(len(shape) - 1)
    with pytest.raises(ValueError, match=r"slots 0\.\.m-1"):
        preview_rounds(label[:2], label[:2], *(t[:2] for t in ints[:3]), torch.tensor([0, 2]))


def test_rounds_refuse_mixing():
    with pytest.raises(ValueError, match="mixing_ratio must be 0 with rounds"):
        CollectConfig(rounds=4)
    with pytest.raises(ValueError, match="rounds must be >= 0"):
        CollectConfig(rounds=-1, mixing_ratio=0.0)
