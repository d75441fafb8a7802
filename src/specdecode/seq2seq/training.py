"""What the seq2seq trainers share: token-budget batches, the inverse-square-root schedule,
resumable checkpoints, a wall-clock budget, and greedy BLEU on the validation split.

Training on a CPU runs in pieces of hours, so every trainer is resumable: the model, optimizer,
scheduler, step counter and data position are saved every few minutes, and the same command
picks up where it stopped. `accelerate` drives the loop, so the same command uses a GPU where
there is one, and several processes under `accelerate launch` (`specdecode.training.distributed`
says how they split the work). `max_tokens` is the *global* batch: the batches of an epoch are
the same whatever the number of processes, each process trains on its share of every batch, and
so a checkpoint resumes at any world size with its step count and data position.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.training.distributed import main_decides


@dataclass(frozen=True)
class LoopConfig:
    """The parts of a training run every trainer has."""

    lr: float = 1e-3
    warmup: int = 400
    max_tokens: int = 2048  # target tokens per global batch (PARALLEL.md: 4096 was worse on CPU)
    minutes: float = 30.0  # wall-clock budget of this call (resume to go on)
    max_steps: int = 0  # 0: no step limit
    eval_minutes: float = 5.0
    checkpoint_minutes: float = 5.0
    clip_norm: float = 3.0
    weight_decay: float = 1e-5
    seed: int = 0
    threads: int = 0  # 0: all cores
    keep_snapshots: int = 0  # > 0: keep the model of the last N checkpoints, for averaging


def inverse_sqrt(warmup: int) -> Callable[[int], float]:
    """Linear warm-up to the peak, then lr * sqrt(warmup / step), as fairseq's `inverse_sqrt`."""

    def factor(step: int) -> float:
        step = max(step, 1)
        return step / warmup if step < warmup else math.sqrt(warmup / step)

    return factor


def token_batches(
    lengths: Sequence[int], max_tokens: int, rng: random.Random, max_rows: int = 512
) -> list[list[int]]:
    """Indices grouped by similar length, each batch's padded size within `max_tokens`, shuffled.

    Sorting by length (with a random tie-break) keeps padding low; shuffling whole batches keeps
    the order random between epochs.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if current and (longest_if * (len(current) + 1) > max_tokens or len(current) >= max_rows):
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass
class LoopState:
    """Progress that survives a restart."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    seconds: float = 0.0
    best_score: float = -1.0  # the figure the best model is chosen by (BLEU, tokens per call)
    history: list | None = None
    num_processes: int = 1  # of the run that wrote this state (it resumes at any number)

    def to_json(self) -> dict:
        return asdict(self)


class Checkpointer:
    """`<dir>/last/` holds the resumable state, `<dir>/best/` the best model by validation BLEU,
    `<dir>/snapshots/step-N/` (with `keep_snapshots`) the models of the last checkpoints."""

    def __init__(self, directory: Path, keep_snapshots: int = 0) -> None:
        self.directory = directory
        self.last = directory / "last"
        self.best = directory / "best"
        self.snapshots = directory / "snapshots"
        self.keep_snapshots = keep_snapshots

    def exists(self) -> bool:
        return (self.last / "state.json").exists()

    def save(self, model, optimizer, scheduler, state: LoopState, save_model: Callable) -> None:
        tmp = self.directory / "last.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        save_model(model, tmp)
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            },
            tmp / "optimizer.pt",
        )
        (tmp / "state.json").write_text(json.dumps(state.to_json(), indent=1))
        if self.last.exists():
            old = self.directory / "last.old"
            self.last.rename(old)
            tmp.rename(self.last)
            _rmtree(old)
        else:
            tmp.rename(self.last)
        if self.keep_snapshots:
            self._snapshot(state.step)

    def _snapshot(self, step: int) -> None:
        """The model files of `last` (not the optimizer) as `snapshots/step-N`; older pruned."""
        target = self.snapshots / f"step-{step:07d}"
        target.mkdir(parents=True, exist_ok=True)
        for f in self.last.iterdir():
            if f.is_file() and f.name not in ("optimizer.pt", "state.json"):
                shutil.copy(f, target / f.name)
        for old in snapshot_dirs(self.directory)[: -self.keep_snapshots]:
            _rmtree(old)

    def restore(self, optimizer, scheduler) -> LoopState:
        blob = torch.load(self.last / "optimizer.pt", weights_only=False)
        optimizer.load_state_dict(blob["optimizer"])
        scheduler.load_state_dict(blob["scheduler"])
        torch.set_rng_state(blob["torch_rng"])
        random.setstate(blob["python_rng"])
        return LoopState(**json.loads((self.last / "state.json").read_text()))


def snapshot_dirs(directory: Path) -> list[Path]:
    """A run's snapshots, oldest first."""
    return sorted(p for p in (Path(directory) / "snapshots").glob("step-*") if p.is_dir())


def average_snapshots(snapshots: Sequence[Path], out: Path) -> Path:
    """The element-wise mean of the snapshots' weights (fairseq's `average_checkpoints`), with
    the newest snapshot's other files (configuration, tokenizer).

    Why: the mean of the last few checkpoints of a run is a cheap, well-known gain in BLEU, and
    a run still descending noisily at the end of a CPU run of a few hours is where it helps most.
    """
    from safetensors.torch import load_file, save_file

    if not snapshots:
        raise ValueError("no snapshots to average")
    names = sorted(f.name for f in snapshots[-1].glob("*.safetensors"))
    if not names:
        raise ValueError(f"{snapshots[-1]} holds no safetensors weights")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in snapshots[-1].iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    for name in names:
        total: dict[str, torch.Tensor] = {}
        dtypes: dict[str, torch.dtype] = {}
        for snap in snapshots:
            if not (snap / name).exists():
                raise ValueError(f"{snap} lacks {name}; snapshots of different models?")
            weights = load_file(str(snap / name))
            if total and weights.keys() != total.keys():
                raise ValueError(f"{snap / name} holds other tensors than {snapshots[0] / name}")
            for key, value in weights.items():
                if key in total and total[key].shape != value.shape:
                    raise ValueError(f"{key} has shape {tuple(value.shape)} in {snap}, "
                                     f"{tuple(total[key].shape)} before")  # fmt: skip
                total[key] = total[key] + value.double() if key in total else value.double()
                dtypes[key] = value.dtype  # the newest snapshot's, as its other files
        save_file(
            {k: (v / len(snapshots)).to(dtypes[k]).contiguous() for k, v in total.items()},
            str(out / name),
            metadata={"format": "pt"},
        )
    return out


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Clock:
    """Wall-clock budget and periodic events (evaluation, checkpoints)."""

    def __init__(self, minutes: float) -> None:
        self.start = time.monotonic()
        self.budget = minutes * 60
        self.marks: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self) -> bool:
        return self.elapsed() >= self.budget

    def every(self, name: str, minutes: float) -> bool:
        last = self.marks.setdefault(name, self.start)
        if time.monotonic() - last >= minutes * 60:
            self.marks[name] = time.monotonic()
            return True
        return False


def end_step(state: LoopState, loop: LoopConfig, clock: Clock, seconds_before: float,
             evaluate: Callable[[], object], checkpoint: Callable[[], None],
             accelerator: Any = None) -> bool:  # fmt: skip
    """Count the step, evaluate and checkpoint when due (and at the end); True when done.

    With an `accelerator` of several processes the main process's clock decides (broadcast, so
    every process stops at the same step) and only the main process evaluates and checkpoints;
    the others go on to the next step, whose gradient all-reduce waits for it.
    """
    state.step += 1
    state.seconds = seconds_before + clock.elapsed()
    out_of_time = clock.out_of_time()
    eval_due = clock.every("eval", loop.eval_minutes)
    ckpt_due = clock.every("ckpt", loop.checkpoint_minutes)
    main = True
    if accelerator is not None:
        out_of_time, eval_due, ckpt_due = main_decides(accelerator, out_of_time, eval_due, ckpt_due)
        main = accelerator.is_main_process
    done = out_of_time or bool(loop.max_steps and state.step >= loop.max_steps)
    if main and (eval_due or done):
        evaluate()
    if main and (ckpt_due or done):
        checkpoint()
    return done


def epoch_batches(
    lengths: Sequence[int], cfg: LoopConfig, state: LoopState
) -> Iterator[tuple[int, list[int]]]:
    """Batches from the current epoch on, skipping those a resumed run already trained on."""
    while True:
        rng = random.Random(cfg.seed * 1000 + state.epoch)
        batches = token_batches(lengths, cfg.max_tokens, rng)
        for b in range(state.batch_in_epoch, len(batches)):
            state.batch_in_epoch = b + 1
            yield state.epoch, batches[b]
        state.epoch += 1
        state.batch_in_epoch = 0


def start_run(loop: LoopConfig, out: Path, config, main: bool = True) -> Path:
    """Threads, the output folder, and the run's configuration written beside its checkpoints
    (by the main process only: `main` False skips the writing)."""
    if loop.threads:
        torch.set_num_threads(loop.threads)
    out = Path(out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(jsonable(asdict(config)), indent=1))
    return out


def jsonable(obj):
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def corpus_bleu(hypotheses: list[str], references: list[list[str]]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, references).score)
