"""What `tests/test_distributed.py` runs under `accelerate launch`: jobs from a JSON file.

    accelerate launch --multi_gpu --num_processes 2 ... tests/distributed_worker.py JOBS.json

Each job calls one trainer or collector in this process; every process writes, per job,
`<records>/<job name>-<process>.json`: the steps it took (`StepRecord`s) and every file write,
rename or removal it made under the job's output (seen by an audit hook), so the test can check
that the processes shared the data and that only the main process wrote.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

WRITE_EVENTS = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.unlink",
                "safetensors.save_file")  # fmt: skip


class WriteAudit:
    """Paths this process opened for writing, renamed, made or removed under `root`."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.writes: list[str] = []

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.root is None or not args:
            return
        path = args[0]
        if event == "open":
            mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if not writing:
                return
        elif event not in WRITE_EVENTS:
            return
        if isinstance(path, str | bytes | os.PathLike):
            text = os.fsdecode(path)
            if text.startswith(self.root):
                self.writes.append(f"{event} {text}")


def watch_safetensors(audit: WriteAudit) -> None:
    """Report `safetensors.torch.save_file`'s writes too: it writes from Rust, unseen by the
    audit hook. Done before the trainers import it, so that their name for it is this one."""
    import safetensors.torch

    original = safetensors.torch.save_file

    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> None:
        audit("safetensors.save_file", (filename,))
        original(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save_file


def run_job(job: dict[str, Any], on_step) -> Any:
    """Call the job's function with the step callback; its result, JSON-ready."""
    kind = job["kind"]
    if kind == "verifier":
        from specdecode.seq2seq.training import LoopConfig
        from specdecode.seq2seq.verifier_train import (
            TrainVerifierConfig,
            VerifierConfig,
            train_verifier,
        )

        cfg = TrainVerifierConfig(
            out=Path(job["out"]),
            model=VerifierConfig(**job["model"]),
            loop=LoopConfig(**job["loop"]),
            valid_limit=job.get("valid_limit", 0),
        )
        return train_verifier(cfg, progress=False, on_step=on_step)
    if kind == "drafter":
        from specdecode.seq2seq.drafter_train import TrainDrafterConfig, train_drafter
        from specdecode.seq2seq.training import LoopConfig

        fields = {k: v for k, v in job["config"].items() if k != "loop"}
        cfg = TrainDrafterConfig(
            **{k: Path(v) if k in ("verifier", "train_file") else v for k, v in fields.items()},
            out=Path(job["out"]),
            loop=LoopConfig(**job["config"]["loop"]),
        )
        return train_drafter(cfg, progress=False, on_step=on_step)
    if kind == "head":
        from specdecode.acceptance.train import TrainConfig, train_head

        config = TrainConfig(**job["config"])
        result = train_head(
            job["data"], job["out"], config, progress=False, max_steps=job.get("max_steps", 0),
            on_step=on_step,
        )  # fmt: skip
        return {k: result[k] for k in ("step", "stopped", "steps", "best_epoch") if k in result}
    if kind == "distill":
        from specdecode.seq2seq.distill import distill

        return str(distill(job["verifier"], job["out"], progress=False, **job.get("options", {})))
    if kind == "cli":
        from specdecode.cli.main import main

        return main(job["argv"])
    raise ValueError(f"unknown job kind {kind!r}")


def main() -> int:
    started = time.perf_counter()
    audit = WriteAudit()
    sys.addaudithook(audit)
    watch_safetensors(audit)  # before specdecode imports transformers, which binds the name
    import torch

    from specdecode.training.distributed import process_state

    torch.set_num_threads(1)  # as the single-process runs the test compares with
    jobs = json.loads(Path(sys.argv[1]).read_text())
    state = process_state()
    print(f"process {state.process_index}: started in {time.perf_counter() - started:.1f} s")
    for job in jobs:
        steps: list[dict[str, Any]] = []
        audit.root, audit.writes = job["watch"], []
        started = time.perf_counter()
        result = run_job(job, lambda record, steps=steps: steps.append(asdict(record)))
        seconds = time.perf_counter() - started
        audit.root = None
        record = {
            "process": state.process_index,
            "num_processes": state.num_processes,
            "steps": steps,
            "writes": audit.writes,
            "result": result,
            "seconds": seconds,
        }
        out = Path(job["records"]) / f"{job['name']}-{state.process_index}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
