"""Two-step smoke runs of every seq2seq trainer on a tiny corpus, end to end to `translate`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specdecode.seq2seq.corpus import corpus_dir, write_splits
from specdecode.seq2seq.training import LoopConfig, inverse_sqrt, token_batches


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_corpus):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    write_splits(tiny_corpus(), corpus_dir(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny_loop(steps: int, **changes) -> LoopConfig:
    return LoopConfig(
        max_steps=steps, minutes=5, eval_minutes=100, max_tokens=256, threads=1, **changes
    )


def test_inverse_sqrt_schedule():
    f = inverse_sqrt(4)
    assert f(1) == 0.25 and f(4) == 1.0 and f(16) == 0.5


def test_token_batches_cover_everything_within_budget():
    import random

    lengths = [random.Random(i).randrange(1, 40) for i in range(300)]
    batches = token_batches(lengths, 200, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(max(lengths[i] for i in b) * len(b) <= 200 for b in batches if len(b) > 1)


def test_train_distill_draft_export_translate(cache, tmp_path, tiny_corpus):
    from specdecode.cli.main import main
    from specdecode.seq2seq.api import TranslationPair
    from specdecode.seq2seq.block_drafter import BlockDrafter
    from specdecode.seq2seq.distill import distill
    from specdecode.seq2seq.drafter_train import TrainDrafterConfig, train_drafter
    from specdecode.seq2seq.verifier_train import (
        TrainVerifierConfig,
        VerifierConfig,
        train_verifier,
    )

    work = cache / "seq2seq" / "bible-es-en"
    model = VerifierConfig(d_model=32, encoder_layers=1, decoder_layers=2, heads=2, ffn=64,
                           vocab_size=120, max_positions=64)  # fmt: skip
    loop = tiny_loop(2, keep_snapshots=2)
    cfg = TrainVerifierConfig(out=work / "verifier", model=model, loop=loop)
    summary = train_verifier(cfg, progress=False)
    assert summary["steps"] == 2 and len(summary["history"]) == 1
    assert (work / "verifier" / "best" / "model.safetensors").exists()
    # resuming continues from the saved step instead of starting again
    summary = train_verifier(
        TrainVerifierConfig(out=work / "verifier", model=model, loop=replace(loop, max_steps=3)),
        progress=False,
    )
    assert summary["steps"] == 3 and len(summary["history"]) == 2
    snapshots = sorted(p.name for p in (work / "verifier" / "snapshots").iterdir())
    assert snapshots == ["step-0000002", "step-0000003"]
    assert main(["seq2seq", "average", "--last", "2", "--threads", "1"]) == 0
    averaged = json.loads((work / "verifier" / "summary.json").read_text())["averaged"]
    assert [a["snapshots"] for a in averaged] == [snapshots]
    state = json.loads((work / "verifier" / "last" / "state.json").read_text())
    assert state["best_score"] >= averaged[0]["valid_bleu"] - 0.005  # a resumed run must beat it
    assert (work / "verifier" / "averaged" / "tokenizer.json").exists()
    assert main(["seq2seq", "average", "--last", "3"]) == 2  # only two snapshots kept

    distilled = work / "distilled.jsonl"
    distill(work / "verifier" / "best", distilled, limit=5, progress=False)
    distill(work / "verifier" / "best", distilled, limit=8, progress=False)  # extends the file
    rows = [json.loads(line) for line in distilled.read_text().splitlines()]
    assert [r["src"] for r in rows] == [v.src for v in tiny_corpus()["train"][:8]]

    drafter_cfg = TrainDrafterConfig(
        verifier=work / "verifier" / "best",
        train_file=distilled,
        out=work / "drafter",
        block_size=4,
        layers=2,
        glance=0.5,
        valid_sentences=3,
        loop=tiny_loop(2),
    )
    summary = train_drafter(drafter_cfg, progress=False)
    assert summary["steps"] == 2 and len(summary["history"]) == 2  # before training, and at 2
    assert BlockDrafter.load(work / "drafter" / "best").cfg.block_size == 4
    # a drafter started from another: at lr 0 its weights stay those of the one it came from
    # (switched to drafting its first token from the prefix, with the language-model loss)
    frozen = replace(
        drafter_cfg, out=tmp_path / "again", init_drafter=work / "drafter" / "last",
        position_decay=0.5, glance=0.0, first_from_prefix=True, lm_weight=0.5,
        loop=replace(tiny_loop(1), lr=0.0),
    )  # fmt: skip
    train_drafter(frozen, progress=False)
    before = BlockDrafter.load(work / "drafter" / "last").state_dict()
    switched = BlockDrafter.load(tmp_path / "again" / "last")
    assert switched.cfg.first_from_prefix
    after = switched.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the same, switched to reading the verifier's states: a zero projection is added, and a
    # pair with it decodes exactly
    reading = replace(frozen, out=tmp_path / "states", first_from_prefix=False, lm_weight=0.0,
                      target_features=True, extra_train_files=(distilled,))  # fmt: skip
    summary = train_drafter(reading, progress=False)
    states = BlockDrafter.load(tmp_path / "states" / "last")
    assert states.cfg.target_features == model.d_model
    assert not states.feature_proj.weight.any() and not states.feature_proj.bias.any()
    assert all(torch.equal(before[k], v) for k, v in states.state_dict().items() if k in before)
    first = summary["history"][0]["valid_tokens_per_verifier_call"]
    assert summary["best_valid_tokens_per_verifier_call"] >= first >= 1.0

    args = ["seq2seq", "train-assistant", "--max-steps", "1", "--max-tokens", "256",
            "--threads", "1", "--quiet", "--valid-limit", "2"]  # fmt: skip
    assert main(args) == 0
    assistant = json.loads((work / "assistant" / "best" / "config.json").read_text())
    assert assistant["decoder_layers"] == 1 and assistant["encoder_layers"] == 1

    pair_dir = tmp_path / "pair"
    assert main(["seq2seq", "export", "--out", str(pair_dir)]) == 0
    weights = json.loads((pair_dir / "verifier" / "config.json").read_text())
    assert weights["dtype"] == "float16"
    pair = TranslationPair.from_dir(pair_dir)
    sources = [v.src for v in tiny_corpus()["test"]]
    plain = pair.translate(sources, use_drafter=False, max_new_tokens=12)
    spec = pair.translate(sources, block_size=4, max_new_tokens=12, batch_size=2)
    assert spec.token_ids == plain.token_ids and spec.exact
    relaxed = pair.translate(sources, block_size=4, beta=3, tau=2.0, max_new_tokens=12)
    assert not relaxed.exact

    # the benchmark on the exported pair: exact methods reproduce ar, relaxed ones are marked
    out = tmp_path / "bench"
    args = ["bench", "--pair", str(pair_dir), "--limit", "3", "--block-sizes", "2", "4",
            "--relaxed", "3,2.0", "--threads", "1", "--max-new-tokens", "12", "--out", str(out),
            "--quiet", "--no-plots", "--repeats", "2"]  # fmt: skip
    assert main(args) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["repeats"] == 2
    rows = {r["method"]: r for r in record["methods"]}  # one batch size: one row a method
    assert {"ar", "hf", "hf-beam5", "hf-assisted", "specdec[k=2]", "specdec[k=4,b=3,t=2]"} <= set(
        rows
    )
    assert rows["specdec[k=4]"]["identical_to_ar"] == 1.0 and rows["hf"]["identical_to_ar"] == 1.0
    assert rows["specdec[k=4,b=3,t=2]"]["approximate"] and not rows["specdec[k=2]"]["approximate"]
    assert record["ok"] and "(approx.)" in (out / "table.md").read_text()
    assert rows["specdec[k=4,b=3,t=2]"]["bleu"] >= 0 and rows["ar"]["speedup"]["geomean"] == 1.0
    assert [e["ref"] for e in record["examples"]] == [v.ref for v in tiny_corpus()["test"][:3]]
    # the same record rederived: table and plots again, nothing measured
    assert main(["bench", "--rederive", str(out)]) == 0
    assert "| specdec[k=4,b=3,t=2] (approx.) |" in (out / "table.md").read_text()
    plots = {"speedup_vs_k.png", "sentences_per_s.png", "quality_vs_speed.png"}
    assert plots <= {p.name for p in out.iterdir()}
    # a second drafter (the one reading the verifier's states) beside the pair's own, one run
    alt = [
        *args[:-3],
        "--methods",
        "ar",
        "specdec",
        "specdec-alt",
        "specdec-alt-int8",
        "--alt-drafter",
        str(tmp_path / "states" / "last"),
        "--relaxed",
        "--no-plots",
    ]
    assert main(alt) == 0
    record = json.loads((out / "record.json").read_text())
    rows = {r["method"]: r for r in record["methods"]}
    assert {"specdec-alt[k=4]", "specdec-alt-int8[k=2]"} <= set(rows)
    assert all(r["identical_to_ar"] == 1.0 for r in rows.values())
    assert main([*args, "--relaxed", "five"]) == 2  # not BETA,TAU
    assert main([*args, "--repeats", "0"]) == 2
    # exact SpecDec gated by batch beside the ungated one, at the batch size above the gate only
    gated = [*args[:-3], "--methods", "ar", "specdec", "--block-sizes", "2", "--relaxed",
             "--batch-sizes", "1", "3", "--max-draft-batch", "1", "--no-plots"]  # fmt: skip
    assert main(gated) == 0
    record = json.loads((out / "record.json").read_text())
    runs: dict[int, dict[str, dict]] = {}
    for row in record["methods"]:
        runs.setdefault(row["batch_size"], {})[row["method"]] = row
    assert "specdec[k=2,draft<=1]" not in runs[1]
    gate = "specdec[k=2,draft<=1] at batch 1 (the ungated method at 1 rows or fewer)"
    assert gate in record["skipped"]
    assert {"ar", "specdec[k=2]", "specdec[k=2,draft<=1]"} == set(runs[3])
    assert all(r["identical_to_ar"] == 1.0 for r in runs[3].values())
    assert main([*gated, "--max-draft-batch", "0"]) == 2


def test_translate_refuses_bad_input(cache, tmp_path):
    from specdecode.cli.main import main

    assert main(["translate", "--pair", str(tmp_path / "nowhere"), "hola"]) == 2
    assert main(["translate", "--pair", str(tmp_path)]) == 2  # nothing to translate


def test_glance_reveals_more_where_wrong():
    from specdecode.seq2seq.drafter_train import glance_inputs, sample_blocks

    labels = torch.tensor([[5, 6, 7, 8], [5, 6, -100, -100]])
    logits = torch.zeros(2, 4, 10)
    logits[0, :, 0] = 1.0  # row 0: every prediction wrong
    logits[1, 0, 5] = logits[1, 1, 6] = 1.0  # row 1: every prediction right
    reveal, loss_labels = glance_inputs(logits, labels, 0.5, torch.Generator().manual_seed(0))
    assert reveal[0].sum() == 2 and reveal[1].sum() == 0
    assert (loss_labels[reveal] == -100).all() and (loss_labels[~reveal] == labels[~reveal]).all()
    import random

    starts, block_labels = sample_blocks([[9, 8, 7, 1], [4, 1]], 3, 5, random.Random(0))
    assert len(starts) == 2 and all(len(r) == 5 for r in starts)
    for tgt, row_starts, row_labels in zip(
        [[9, 8, 7, 1], [4, 1]], starts, block_labels, strict=True
    ):
        for s, block in zip(row_starts, row_labels, strict=True):
            assert 0 <= s < len(tgt) and len(block) == 3
            assert [t for t in block if t != -100] == tgt[s : s + 3]


def test_block_loss_weights_positions():
    from specdecode.seq2seq.drafter_train import block_loss

    logits = torch.randn(3, 2, 4, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 2, 4), generator=torch.Generator().manual_seed(1))
    labels[0, 0, 2:] = -100
    plain = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 11), labels.flatten(), ignore_index=-100
    )
    assert torch.allclose(block_loss(logits, labels, 1.0, 0.0), plain)
    per = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 11), labels.flatten(), ignore_index=-100, reduction="none"
    ).view(3, 2, 4)
    w = torch.tensor([1.0, 0.5, 0.25, 0.125]).expand(3, 2, 4) * (labels != -100)
    assert torch.allclose(block_loss(logits, labels, 0.5, 0.0), (per * w).sum() / w.sum())
    # the same miss costs more at the first position than at the last
    flat = torch.zeros(3, 2, 4, 11)
    base = block_loss(flat, labels, 0.5, 0.0)
    miss_first, miss_last = flat.clone(), flat.clone()
    miss_first[..., 0, :].scatter_(-1, labels[..., 0:1].clamp(min=0), -10.0)
    miss_last[..., 3, :].scatter_(-1, labels[..., 3:4].clamp(min=0), -10.0)
    first = block_loss(miss_first, labels, 0.5, 0.0) - base
    last = block_loss(miss_last, labels, 0.5, 0.0) - base
    assert first > 4 * last > 0


def test_next_token_loss_reads_each_slot_against_the_token_after_it():
    from specdecode.seq2seq.drafter_train import next_token_loss

    targets = torch.tensor([[0, 5, 6, 7, 1], [0, 8, 1, 0, 0]])  # start token, sentence, padding
    lens = torch.tensor([5, 3])
    right = torch.full((2, 5, 11), -20.0)
    for row in range(2):
        for slot in range(int(lens[row]) - 1):
            right[row, slot, targets[row, slot + 1]] = 20.0  # slot i predicts targets[i + 1]
    assert next_token_loss(right, targets, lens, 0.0) < 1e-6
    # what the padding slots and each row's last slot predict is not scored
    noisy = right.clone()
    noisy[1, 2:] = torch.randn(3, 11)
    noisy[0, 4] = torch.randn(11)
    assert torch.allclose(next_token_loss(noisy, targets, lens, 0.0), torch.tensor(0.0), atol=1e-6)
    wrong = right.clone()
    wrong[0, 1] = right[0, 2]  # slot 1 now predicts 7 instead of 6
    assert next_token_loss(wrong, targets, lens, 0.0) > 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"glance": 0.3, "first_from_prefix": True}, "use --glance 0 with --first-from-prefix"),
        ({"lm_weight": -1.0}, "lm_weight must be >= 0"),
    ],
)
def test_drafter_training_settings_refused(tmp_path, changes, message):
    from specdecode.seq2seq.drafter_train import TrainDrafterConfig

    with pytest.raises(ValueError, match=message):
        TrainDrafterConfig(verifier=tmp_path, train_file=tmp_path, out=tmp_path, **changes)


def test_average_snapshots_means_weights_and_refuses_mismatch(tmp_path):
    from safetensors.torch import load_file, save_file

    from specdecode.seq2seq.training import average_snapshots

    dirs = []
    for i, value in enumerate([1.0, 2.0, 6.0]):
        d = tmp_path / f"step-{i}"
        d.mkdir()
        save_file(
            {"w": torch.full((2, 3), value), "b": torch.tensor([value])}, str(d / "m.safetensors")
        )
        (d / "config.json").write_text(json.dumps({"i": i}))
        dirs.append(d)
    out = average_snapshots(dirs, tmp_path / "avg")
    weights = load_file(str(out / "m.safetensors"))
    assert torch.allclose(weights["w"], torch.full((2, 3), 3.0)) and weights["b"].item() == 3.0
    assert json.loads((out / "config.json").read_text()) == {"i": 2}  # the newest's files
    save_file({"w": torch.zeros(3, 2), "b": torch.zeros(1)}, str(dirs[0] / "m.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        average_snapshots(dirs, tmp_path / "bad")
    save_file({"w": torch.zeros(2, 3)}, str(dirs[0] / "m.safetensors"))
    with pytest.raises(ValueError, match="other tensors"):
        average_snapshots(dirs, tmp_path / "bad")
    with pytest.raises(ValueError, match="no snapshots"):
        average_snapshots([], tmp_path / "none")


def test_augmented_sources_join_cut_and_drop_words():
    from specdecode.seq2seq.distill import augmented_sources

    verses = [
        "Y dijo Dios: Sea la luz, y fué la luz en la tierra.",
        "Y vió Dios que la luz era buena: y apartó Dios la luz de las tinieblas.",
        "Y llamó Dios á la luz Día, y á las tinieblas llamó Noche en aquel día.",
        "Estas son las generaciones de los cielos y de la tierra cuando fueron creados.",
    ]
    out = augmented_sources(verses, seed=1)
    assert out == augmented_sources(verses, seed=1) and len(out) == len(verses)
    assert out[0] == f"{verses[0]} {verses[1]}"  # joined with the next verse
    assert out[1] in verses[1] and out[1] != verses[1]  # one of its clauses
    assert out[1] in ("Y vió Dios que la luz era buena:", "y apartó Dios la luz de las tinieblas.")
    for i in (2, 3):  # words dropped, the rest in order (the last verse has none to join)
        words, kept = verses[i].split(), out[i].split()
        assert 2 <= len(kept) <= len(words)
        it = iter(words)
        assert all(w in it for w in kept)
    assert out[3] != verses[3]  # this seed drops some of its words
