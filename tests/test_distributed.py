"""Every trainer and collector under `accelerate launch` with two CPU processes (gloo).

Why `--multi_gpu` on a machine without a GPU: `accelerate launch --cpu --num_processes 2` runs
*one* process (its CPU launcher starts several only through MPI, `--mpirun_hostfile`), while
`--multi_gpu` starts the processes with torchrun, and accelerate joins them over gloo when the
program asks for the CPU (`specdecode.training.distributed.new_accelerator`). CUDA is hidden so
that a
machine with GPUs runs the same CPU test.

Each launch runs several jobs (`distributed_worker.py`), since starting two Python processes
with torch costs most of the time; single-process runs happen in this process, with one thread,
as the launched processes have. What is checked, for each trainer:

* the two processes train on disjoint rows whose union is the global batch, and over an epoch
  the whole training set;
* the loss at every step equals the single-process loss (`LOSS_RTOL`: measured 1e-7, float32
  rounding of sums split in two), and the weights after the run agree (`WEIGHT_ATOL`);
* only the main process writes under the run's folder;
* a checkpoint written by two processes resumes on one, and one written by one on two, with the
  step count going on and the losses of a run never stopped.

`head collect` and `seq2seq distill` with two processes write the files one process writes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from specdecode.training.distributed import StepRecord, global_means, share, step_seed

WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
LOSS_RTOL = 1e-5  # per-step loss, two processes against one (measured: about 1e-7)
WEIGHT_ATOL = 1e-5  # final weights, likewise (measured: at most 1.6e-6)
STEPS = 6  # of every seq2seq run; the resumed ones stop half-way first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(jobs: list[dict[str, Any]], work: Path, env: dict[str, str] | None = None) -> dict:
    """Run the jobs under `accelerate launch` with two processes; {job name: [record 0, 1]}."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps(jobs, default=str))
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(WORKER), str(work / "jobs.json"),
    ]  # fmt: skip
    full_env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # the gloo run on CPUs, whatever the machine has
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(work / "hf"),  # no accelerate config of this machine's user
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    records = {}
    for job in jobs:
        pair = [json.loads((work / f"{job['name']}-{r}.json").read_text()) for r in (0, 1)]
        assert [p["num_processes"] for p in pair] == [2, 2], "the processes did not join"
        records[job["name"]] = pair
    return records


def job(kind: str, name: str, out: Path, work: Path, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "name": name, "out": str(out), "watch": str(out),
            "records": str(work), **fields}  # fmt: skip


def recorder() -> tuple[list[dict[str, Any]], Any]:
    steps: list[dict[str, Any]] = []
    return steps, lambda record: steps.append(asdict(record))


def assert_same_steps(single: list[dict], pair: list[dict], first_step: int) -> None:
    """Two processes' step records against a single process's, from `first_step` on."""
    by_step = {s["step"]: s for s in single}
    zero, one = pair[0]["steps"], pair[1]["steps"]
    assert [s["step"] for s in zero] == [s["step"] for s in one]
    assert zero[0]["step"] == first_step
    for a, b in zip(zero, one, strict=True):
        ref = by_step[a["step"]]
        assert not set(a["rows"]) & set(b["rows"]), f"step {a['step']}: a row trained twice"
        assert sorted(a["rows"] + b["rows"]) == sorted(ref["rows"]), f"step {a['step']}"
        assert a["loss"] == b["loss"]  # the global batch's loss, on both
        assert a["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), f"step {a['step']}"


def assert_epoch_shared(pairs: list[list[dict]], epoch: int, expected: set[int]) -> None:
    """Over `epoch` (its steps in any of the two-process runs `pairs`) the two processes trained
    on disjoint rows that make up the whole training set."""
    rows: list[list[int]] = [[], []]
    for pair in pairs:
        for process in (0, 1):
            rows[process] += [r for s in pair[process]["steps"] if s["epoch"] == epoch
                              for r in s["rows"]]  # fmt: skip
    assert not set(rows[0]) & set(rows[1]), "a row trained by both processes"
    assert sorted(rows[0] + rows[1]) == sorted(expected), "not every row once"


def assert_one_writer(pair: list[dict]) -> None:
    assert pair[1]["writes"] == [], "process 1 wrote under the run's folder"
    assert pair[0]["writes"], "the main process wrote nothing?"


def max_weight_gap(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


# --------------------------------------------------------------------------- the pieces


def test_share_splits_a_global_batch_and_pads_an_empty_part():
    rows = [7, 3, 9, 1, 4]
    parts = [share(rows, r, 2) for r in range(2)]
    assert parts == [([7, 9, 4], 1.0), ([3, 1], 1.0)]
    assert share([5], 1, 2) == ([5], 0.0)  # fewer rows than processes: one row at weight 0
    with pytest.raises(ValueError, match="not a process"):
        share(rows, 2, 2)


class _Two:
    """Two processes' all-reduce, for `global_means` in one process: the other's sums added."""

    num_processes = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        return tensor + self.other


def test_global_means_give_the_global_gradient_after_averaging():
    """Per-process losses whose average gradient is that of the mean over the global batch."""
    w = torch.tensor([0.5, -1.0], requires_grad=True)
    x = torch.tensor([[1.0, 2.0], [3.0, 1.0], [0.0, 1.0]])

    def losses(rows: list[int]) -> torch.Tensor:
        return (x[rows] @ w) ** 2

    whole = losses([0, 1, 2]).mean()
    (expected,) = torch.autograd.grad(whole, w)
    # process 0 holds rows 0 and 2, process 1 row 1; each all-reduce adds the other's figures
    parts = {0: ([0, 2], losses([0, 2])), 1: ([1], losses([1]))}
    grads = []
    for me, other in ((0, 1), (1, 0)):
        theirs = torch.tensor([parts[other][1].sum().item(), len(parts[other][0])])
        rows, mine = parts[me]
        (loss,), means, counts = global_means(
            _Two(theirs), [(mine.sum(), torch.tensor(float(len(rows))))]
        )
        grads.append(torch.autograd.grad(loss, w)[0])
        assert float(means[0]) == pytest.approx(float(whole.detach())) and float(counts[0]) == 3.0
    torch.testing.assert_close((grads[0] + grads[1]) / 2, expected)  # what DDP's mean gives


def test_step_seeds_differ_by_step_and_process():
    seeds = {step_seed(0, s, p) for s in range(50) for p in range(4)}
    assert len(seeds) == 200 and step_seed(3, 7, 1) == step_seed(3, 7, 1)
    assert StepRecord(1, 0, (2,), 0.5).rows == (2,)


# --------------------------------------------------------------------------- seq2seq


@pytest.fixture(scope="module")
def seq2seq_runs(tmp_path_factory, tiny_corpus):
    """Verifier, distillation and drafter: single-process runs here, two-process ones launched.

    Per trainer: R (one process, STEPS steps, the reference), P (two processes, half-way, then
    resumed here on one), O (one process half-way here, then resumed on two).
    """
    from specdecode.seq2seq.corpus import corpus_dir, write_splits
    from specdecode.seq2seq.distill import distill
    from specdecode.seq2seq.drafter_train import TrainDrafterConfig, train_drafter
    from specdecode.seq2seq.training import LoopConfig
    from specdecode.seq2seq.verifier_train import (
        TrainVerifierConfig,
        VerifierConfig,
        train_verifier,
    )

    root = tmp_path_factory.mktemp("seq2seq")
    cache = root / "cache"
    write_splits(tiny_corpus(), corpus_dir(cache))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(cache))
        model = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "heads": 2, "ffn": 64,
                 "vocab_size": 120, "max_positions": 64, "dropout": 0.0}  # fmt: skip
        # 64 target tokens a global batch: three batches an epoch of the 30 verses
        loop = {"max_steps": STEPS, "minutes": 5, "eval_minutes": 100, "max_tokens": 64,
                "threads": 1, "lr": 3e-3, "warmup": 2}  # fmt: skip
        half = {**loop, "max_steps": STEPS // 2}

        def verifier(out: Path, steps: dict, on_step=None) -> dict:
            cfg = TrainVerifierConfig(
                out=out, model=VerifierConfig(**model), loop=LoopConfig(**steps), valid_limit=2
            )
            return train_verifier(cfg, progress=False, on_step=on_step)

        v_ref, v_ref_cb = recorder()
        verifier(root / "v-R", loop, v_ref_cb)
        verifier(root / "v-O", half)
        best = root / "v-R" / "best"
        distilled = root / "distilled-1.jsonl"
        distill(best, distilled, limit=12, chunk=5, batch_size=2, progress=False)

        drafter_fields = {"verifier": str(best), "train_file": str(distilled), "block_size": 3,
                          "min_block": 1, "layers": 1, "glance": 0.5, "dropout": 0.0,
                          "valid_sentences": 2}  # fmt: skip

        def drafter(out: Path, steps: dict, on_step=None) -> dict:
            fields = {k: Path(v) if k in ("verifier", "train_file") else v
                      for k, v in drafter_fields.items()}  # fmt: skip
            cfg = TrainDrafterConfig(**fields, out=out, loop=LoopConfig(**steps))
            return train_drafter(cfg, progress=False, on_step=on_step)

        drafter_loop = {**loop, "max_tokens": 48}
        d_ref, d_ref_cb = recorder()
        drafter(root / "d-R", drafter_loop, d_ref_cb)
        drafter(root / "d-O", {**drafter_loop, "max_steps": STEPS // 2})

        work = root / "launch"
        jobs = [
            job("verifier", "v-P", root / "v-P", work, model=model, loop=half, valid_limit=2),
            job("verifier", "v-O", root / "v-O", work, model=model, loop=loop, valid_limit=2),
            job("distill", "distill", root / "distilled-2.jsonl", work, verifier=str(best),
                options={"limit": 12, "chunk": 5, "batch_size": 2}),
            job("drafter", "d-P", root / "d-P", work,
                config={**drafter_fields, "loop": {**drafter_loop, "max_steps": STEPS // 2}}),
            job("drafter", "d-O", root / "d-O", work,
                config={**drafter_fields, "loop": drafter_loop}),
        ]  # fmt: skip
        launched = launch(jobs, work, {"SPECDECODE_CACHE": str(cache)})

        v_resumed, v_resumed_cb = recorder()
        v_summary = verifier(root / "v-P", loop, v_resumed_cb)
        d_resumed, d_resumed_cb = recorder()
        d_summary = drafter(root / "d-P", drafter_loop, d_resumed_cb)
    torch.set_num_threads(threads)
    return {
        "root": root,
        "launched": launched,
        "verifier": (v_ref, v_resumed, v_summary),
        "drafter": (d_ref, d_resumed, d_summary),
    }


@pytest.mark.parametrize("trainer", ["verifier", "drafter"])
def test_seq2seq_trainers_share_batches_and_match_one_process(seq2seq_runs, trainer):
    tag = trainer[0]
    launched, root = seq2seq_runs["launched"], seq2seq_runs["root"]
    reference, _, _ = seq2seq_runs[trainer]
    assert [s["step"] for s in reference] == list(range(1, STEPS + 1))
    assert reference[-1]["loss"] < reference[0]["loss"]  # it learns: the losses mean something
    fresh, resumed = launched[f"{tag}-P"], launched[f"{tag}-O"]
    assert_same_steps(reference, fresh, first_step=1)
    assert_same_steps(reference, resumed, first_step=STEPS // 2 + 1)  # 1 -> 2 processes
    # the first epoch, run by two processes (half in each launched run): every row once
    assert reference[-1]["epoch"] == 1, "the runs should cross into the second epoch"
    assert_epoch_shared([fresh, resumed], 0, set(range(30 if trainer == "verifier" else 12)))
    for pair in (fresh, resumed):
        assert_one_writer(pair)
    weights = "model.safetensors" if trainer == "verifier" else "drafter.safetensors"
    gap = max_weight_gap(root / f"{tag}-R" / "last" / weights, root / f"{tag}-O" / "last" / weights)
    assert gap < WEIGHT_ATOL
    state = json.loads((root / f"{tag}-O" / "last" / "state.json").read_text())
    assert state["step"] == STEPS and state["num_processes"] == 2
    assert not list((root / f"{tag}-O").glob("last.*")), "a checkpoint left half-written"


@pytest.mark.parametrize("trainer", ["verifier", "drafter"])
def test_seq2seq_checkpoint_of_two_processes_resumes_on_one(seq2seq_runs, trainer):
    tag = trainer[0]
    root = seq2seq_runs["root"]
    reference, resumed, summary = seq2seq_runs[trainer]
    assert [s["step"] for s in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
    by_step = {s["step"]: s for s in reference}
    for s in resumed:
        assert s["rows"] == by_step[s["step"]]["rows"]
        assert s["loss"] == pytest.approx(by_step[s["step"]]["loss"], rel=LOSS_RTOL)
    assert summary["steps"] == STEPS and summary["num_processes"] == 1
    weights = "model.safetensors" if trainer == "verifier" else "drafter.safetensors"
    gap = max_weight_gap(root / f"{tag}-R" / "last" / weights, root / f"{tag}-P" / "last" / weights)
    assert gap < WEIGHT_ATOL


def test_distill_with_two_processes_writes_the_file_of_one(seq2seq_runs):
    root = seq2seq_runs["root"]
    one = (root / "distilled-1.jsonl").read_text()
    two = (root / "distilled-2.jsonl").read_text()
    assert len(one.splitlines()) == 12 and two == one
    assert_one_writer(seq2seq_runs["launched"]["distill"])


# --------------------------------------------------------------------------- acceptance head

HEAD = {"epochs": 3, "batch_size": 64, "lr": 1e-2, "val_fraction": 0.25, "num_layers": 1,
        "dropout": 0.0}  # fmt: skip
HEAD_STOP = 20  # the stopped runs stop here, inside the second epoch (15 steps an epoch)


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory, tiny_pair, head_data):
    """`head collect` (through the command line) and `head train`, as `seq2seq_runs` does."""
    from specdecode.acceptance.train import TrainConfig, train_head
    from specdecode.cli.main import main

    root = tmp_path_factory.mktemp("head")
    target, draft, prompts = tiny_pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def collect_argv(out: Path, *more: str) -> list[str]:
        return ["head", "collect", "--target", str(target), "--draft", str(draft), "--prompts",
                str(prompts), "--max-new-tokens", "8", "--batch-size", "1", "--temperature",
                "0.7", "--threads", "1", "--out", str(out), "--no-progress", *more]  # fmt: skip

    rounds = ("--rounds", "3")  # inside real rounds (`acceptance.rounds`) as well as mixed
    assert main(collect_argv(root / "c-1")) == 0
    assert main(collect_argv(root / "cr-1", *rounds)) == 0
    data = head_data.write(root / "data")
    config = TrainConfig(rule="greedy", **HEAD)
    reference, reference_cb = recorder()
    result = train_head(data, root / "h-R", config, progress=False, on_step=reference_cb)
    stopped = train_head(data, root / "h-O", config, progress=False, max_steps=HEAD_STOP)

    work = root / "launch"
    head_job = {"data": str(data), "config": {"rule": "greedy", **HEAD}}
    jobs = [
        job("cli", "c", root / "c-2", work, argv=collect_argv(root / "c-2")),
        job("cli", "cr", root / "cr-2", work, argv=collect_argv(root / "cr-2", *rounds)),
        job("head", "h-P", root / "h-P", work, max_steps=HEAD_STOP, **head_job),
        job("head", "h-O", root / "h-O", work, **head_job),
    ]
    launched = launch(jobs, work)
    resumed, resumed_cb = recorder()
    again = train_head(data, root / "h-P", config, progress=False, on_step=resumed_cb)
    torch.set_num_threads(threads)
    return {
        "root": root,
        "launched": launched,
        "reference": (reference, result),
        "stopped": stopped,
        "resumed": (resumed, again),
    }


@pytest.mark.parametrize("kind", ["c", "cr"])  # mixed sequences, inside rounds
def test_head_collect_with_two_processes_writes_the_files_of_one(head_runs, kind):
    root = head_runs["root"]
    one, two = (
        load_file(root / f"{kind}-1" / "examples.safetensors"),
        load_file(root / f"{kind}-2" / "examples.safetensors"),
    )
    assert one.keys() == two.keys() and len(one["label_greedy"]) > 0
    assert ("round" in one) == (kind == "cr")
    for key in one:
        assert torch.equal(one[key], two[key]), key
    meta = [json.loads((root / f"{kind}-{n}" / "meta.json").read_text()) for n in (1, 2)]
    for m in meta:
        m.pop("seconds")
    assert meta[0] == meta[1]
    shards = sorted(p.name for p in (root / f"{kind}-2" / "shards").iterdir())
    assert shards == sorted(p.name for p in (root / f"{kind}-1" / "shards").iterdir())
    assert len(shards) == 4  # one per prompt, two turns of two processes
    assert_one_writer(head_runs["launched"][kind])


def test_head_train_shares_batches_and_matches_one_process(head_runs):
    root = head_runs["root"]
    reference, result = head_runs["reference"]
    per_epoch = math.ceil(result["split"]["train_examples"] / HEAD["batch_size"])
    assert [s["step"] for s in reference] == list(range(1, HEAD["epochs"] * per_epoch + 1))
    fresh, resumed = head_runs["launched"]["h-P"], head_runs["launched"]["h-O"]
    assert_same_steps(reference, fresh, first_step=1)
    assert_same_steps(reference, resumed, first_step=HEAD_STOP + 1)  # 1 -> 2 processes
    assert fresh[0]["result"] == {"step": HEAD_STOP, "stopped": True}
    train_rows = {r for s in reference if s["epoch"] == 1 for r in s["rows"]}
    assert len(train_rows) == result["split"]["train_examples"]
    assert_epoch_shared([fresh], 1, train_rows)  # the stopped run holds all of epoch 1
    for pair in (fresh, resumed):
        assert_one_writer(pair)
    two = json.loads((root / "h-O" / "training.json").read_text())
    assert two["num_processes"] == 2 and two["steps"] == HEAD["epochs"] * per_epoch
    assert two["best_epoch"] == result["best_epoch"]
    for a, b in zip(result["epochs"], two["epochs"], strict=True):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=LOSS_RTOL)
    gap = max_weight_gap(root / "h-R" / "head.safetensors", root / "h-O" / "head.safetensors")
    assert gap < WEIGHT_ATOL
    assert not (root / "h-O" / "checkpoint").exists()  # removed once the head is saved


def test_head_checkpoint_of_two_processes_resumes_on_one(head_runs):
    root = head_runs["root"]
    reference, result = head_runs["reference"]
    stopped = head_runs["stopped"]
    assert stopped["stopped"] and stopped["step"] == HEAD_STOP and stopped["epoch"] == 2
    resumed, again = head_runs["resumed"]
    assert resumed[0]["step"] == HEAD_STOP + 1 and again["num_processes"] == 1
    assert again["steps"] == result["steps"]
    by_step = {s["step"]: s for s in reference}
    for s in resumed:
        assert sorted(s["rows"]) == sorted(by_step[s["step"]]["rows"])
        assert s["loss"] == pytest.approx(by_step[s["step"]]["loss"], rel=LOSS_RTOL)
    assert [e["epoch"] for e in again["epochs"]] == [e["epoch"] for e in result["epochs"]]
    gap = max_weight_gap(root / "h-R" / "head.safetensors", root / "h-P" / "head.safetensors")
    assert gap < WEIGHT_ATOL


def test_head_checkpoint_refuses_other_settings(tmp_path, head_data):
    from specdecode.acceptance.train import TrainConfig, train_head

    data = head_data.write(tmp_path / "data")
    config = TrainConfig(rule="greedy", **HEAD)
    train_head(data, tmp_path / "head", config, progress=False, max_steps=3)
    assert (tmp_path / "head" / "checkpoint" / "state.pt").is_file()
    other = TrainConfig(rule="greedy", **{**HEAD, "lr": 1e-3})
    with pytest.raises(ValueError, match=r"other settings or data \(lr\)"):
        train_head(data, tmp_path / "head", other, progress=False)


def test_bench_shared_across_two_processes_writes_the_one_record(tiny_pair, tmp_path):
    """`accelerate launch` of `specdecode bench` with two processes: the main process writes
    one record whose outputs equal a single process's run of the same prompts."""
    target, draft, prompts = tiny_pair
    args = ["bench", "--backend", "torch", "--target", str(target), "--draft", str(draft),
            "--prompts", str(prompts), "--limit", "4", "--max-new-tokens", "8", "--methods",
            "ar", "sd", "--batch-sizes", "1", "2", "--no-prepack", "--no-plots",
            "--quiet"]  # fmt: skip
    single = tmp_path / "single"
    assert subprocess.run([sys.executable, "-m", "specdecode.cli", *args, "--out", str(single)],
                          capture_output=True, text=True, timeout=600).returncode == 0  # fmt: skip
    shared = tmp_path / "shared"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "specdecode.cli", *args,
        "--out", str(shared),
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    one = json.loads((single / "record.json").read_text())
    two = json.loads((shared / "record.json").read_text())
    assert two["ok"] and one["ok"]

    def texts(record: dict) -> dict:
        return {(r["method"], r["batch_size"]): r["tokens"] for r in record["methods"]}

    assert texts(two) == texts(one)
    assert [len(r["per_batch_seconds"]) for r in two["methods"]] == [
        len(r["per_batch_seconds"]) for r in one["methods"]
    ]
