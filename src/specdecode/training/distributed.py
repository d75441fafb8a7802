"""Training and collection under `accelerate launch`: what every trainer does with N processes.

The rules, and why:

* **One global batch, split.** Each step draws one global batch exactly as a single process
  would (from the seed and the epoch only), and process `r` of `N` trains on its rows `r, r + N,
  ...` (`share`). The batches of an epoch are therefore the same whatever N is, the processes
  see disjoint rows whose union is the epoch, and a run's step count and data position
  (epoch, batch in epoch) mean the same thing at any world size: a checkpoint written by two
  processes resumes on one, and the other way round.
* **The global mean, exactly.** DDP (what `accelerator.backward` on a prepared model gives)
  averages the processes' gradients. Each process therefore backpropagates its *sum* of
  per-token (per-example) losses times N over the *global* count (`global_means`), so that the
  average is the gradient of the mean over the whole global batch: the same step a single process
  takes on that batch, up to the order of floating-point sums.
* **Randomness keyed to the step.** Dropout and any other draw of a step come from a seed made
  of (seed, step, process) (`step_seed`): a resumed run needs no saved random state, at any world
  size. Draws that choose data (block positions, glancing) use (seed, step) alone and are made
  for the whole global batch, so they do not depend on N either; only dropout masks do.
* **One writer, one clock.** Checkpoints, logs and exported files are written by the main
  process alone; the time budget and the periodic evaluations and checkpoints are decided by the
  main process's clock and broadcast (`main_decides`), so every process stops at the same step.

A process whose share of a small global batch is empty still runs one row at weight 0, so that
every process takes part in each gradient all-reduce.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class StepRecord:
    """What one process did at one optimizer step (given to a trainer's `on_step` callback)."""

    step: int  # the run's step count after this step (1 for the first step of a fresh run)
    epoch: int  # the epoch the global batch belongs to
    rows: tuple[int, ...]  # the training examples this process trained on, as dataset indices
    loss: float  # the step's loss over the whole global batch (the same on every process)


StepCallback = Callable[[StepRecord], None]


def new_accelerator(**kwargs: Any) -> Any:
    """An `Accelerator` that joins the launch's processes on a machine with or without GPUs.

    Why `cpu=` matters: under `accelerate launch --multi_gpu` (torchrun) on a machine without a
    GPU, accelerate forms a process group (gloo) only when asked for the CPU; a plain
    `Accelerator()` there leaves every process alone, each training on all the data.
    """
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available(), **kwargs)


def process_state() -> Any:
    """accelerate's `PartialState` (rank, world size, barriers) without an Accelerator, joined
    as `new_accelerator` joins: for the collectors, which train nothing."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def share(rows: Sequence[int], index: int, count: int) -> tuple[list[int], float]:
    """Process `index` of `count`'s part of a global batch: `rows[index::count]`, weight 1.

    Rows come sorted by length in the seq2seq batches, so taking every count-th row gives each
    process about the same number of tokens. An empty part (fewer rows than processes) is the
    batch's first row at weight 0: the process still runs forward and backward, which DDP needs,
    and adds nothing.
    """
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process {index} of {count} is not a process")
    if not rows:
        raise ValueError("an empty global batch has nothing to share")
    mine = list(rows[index::count])
    return (mine, 1.0) if mine else ([rows[0]], 0.0)


def global_means(
    accelerator: Any, terms: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per term (local sum [], local count []): the loss to backpropagate, and the global means
    [T] and counts [T] (tensors, so that a GPU need not sync for them every step).

    The loss is local_sum * N / global_count, so DDP's average over the N processes is the
    gradient of global_sum / global_count. One all-reduce carries every term's sum and count
    (the counts cannot always be known without it: glancing hides slots by the model's own
    predictions). With one process it is the plain mean.
    """
    sums = torch.stack([s.detach().float() for s, _ in terms])  # [T]
    counts = torch.stack([c.detach().float().to(sums.device) for _, c in terms])  # [T]
    totals = torch.cat([sums, counts])
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    n = len(terms)
    global_sums, global_counts = totals[:n], totals[n:].clamp_min(1e-9)
    losses = [s * (accelerator.num_processes / global_counts[i]) for i, (s, _) in enumerate(terms)]
    return losses, global_sums / global_counts, totals[n:]


def step_seed(seed: int, step: int, process: int = 0) -> int:
    """A seed for the draws of one step (of one process): a function of the three numbers only."""
    return ((seed * 1_000_003 + step) * 1_009 + process) % (2**63 - 1)


def main_decides(accelerator: Any, *flags: bool) -> list[bool]:
    """The main process's flags, on every process (one small broadcast; none with one process)."""
    if accelerator.num_processes == 1:
        return list(flags)
    from accelerate.utils import broadcast

    values = torch.tensor([float(f) for f in flags], device=accelerator.device)
    return [bool(v) for v in broadcast(values, from_process=0).tolist()]


def main_object(accelerator: Any, value: Any) -> Any:
    """The main process's `value` (picklable), on every process."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def agreed_on_resume(accelerator: Any, found: bool, what: Path | str) -> bool:
    """Whether to resume: what the main process found, on every process; a process that does
    not see the checkpoint the main process sees stops with a clear error (rather than train
    from step 0 beside processes that resumed): the output folder must be one every node reads,
    a shared file system across machines."""
    resuming = bool(main_object(accelerator, found))
    if resuming and not found:
        raise FileNotFoundError(
            f"process {accelerator.process_index} does not see {what}, which the main process "
            "resumes from: put the output folder on a file system every node shares"
        )
    return resuming


def gather_objects(accelerator: Any, value: Any) -> list[Any]:
    """Every process's `value`, in process order, on every process."""
    if accelerator.num_processes == 1:
        return [value]
    from accelerate.utils import gather_object

    return list(gather_object([value]))


def threads_per_process() -> int:
    """The cores of this machine shared among the processes launched on it (at least 1)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local))
