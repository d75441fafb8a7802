"""Passes captured by hand as CUDA graphs: one per shape, at its first use, replayed after.

Why: uncaptured, every pass on a GPU is bound by kernel launches, so a drafter of 28 small
layers costs nearly a step of a target of 36 large ones, and speculation cannot pay. Captured,
a pass is one launch. `torch.compile`'s "reduce-overhead" mode captures too, but it first
compiles one inductor graph per shape (rows x width x capacity), tens of seconds each: minutes
before a first token. A pass of fixed shapes over buffers that never move needs no compiler:
the model's own kernels, recorded once (a fraction of a second) and replayed.

What a replay needs, and who provides it:
* its inputs at the addresses it captured: the caller's tensors are copied into static
  buffers held here, one set per shape;
* the KV cache at its addresses: the backend keeps its buffers for their life and says when
  they move (`clear`), which voids every graph captured over them;
* its outputs read before the same graph replays again: they are the graph's own memory, so
  the caller copies what it keeps.

Capture needs a warm-up run (lazy initialisations, library handles) outside the graph; it runs
with no valid token (`valid` all false), which the static cache writes to its scratch slot only,
so a warm-up changes no row's cache.

A pass that cannot be captured (an operation of some architecture that syncs with the host or
allocates outside the graph's pool) is not a reason to stop decoding: the passes run
uncaptured from then on, with one warning that says why (`failed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

Pass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[Any, ...]]
# capture(run, warm) -> (replay, outputs): `warm()` once outside the graph, `run()` recorded;
# replay() reruns what was recorded, writing into `outputs`
Capture = Callable[[Callable[[], Any], Callable[[], Any]], tuple[Callable[[], None], Any]]


def cuda_capture(run: Callable[[], Any], warm: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """A CUDA graph of `run()`, after `warm()` on a side stream (as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread-local: a server's other threads (tokenizing, timing) may touch CUDA meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = run()
    return graph.replay, outputs


@dataclass(frozen=True)
class Captured:
    """One shape's graph: its static inputs, its replay and its outputs."""

    tokens: torch.Tensor  # [rows, width]
    valid: torch.Tensor  # [rows, width]
    lengths: torch.Tensor  # [rows]
    replay: Callable[[], None]
    outputs: tuple[Any, ...]


@dataclass(frozen=True)
class CaptureTime:
    """What one capture took, warm-up included: what a user waits for at a shape's first use."""

    rows: int
    width: int
    hidden: bool
    seconds: float


class CapturedPasses:
    """`run(tokens, valid, lengths, want_hidden)` by graphs captured per (rows, width, hidden)."""

    def __init__(self, run: Pass, capture: Capture = cuda_capture, synchronize=None) -> None:
        self.run = run
        self.capture = capture
        self.synchronize = synchronize or torch.cuda.synchronize
        self.graphs: dict[tuple[int, int, bool], Captured] = {}
        self.times: list[CaptureTime] = []  # every capture, in order
        self.failed: str | None = None  # why the passes run uncaptured, once one failed

    def clear(self) -> None:
        """The cache's buffers moved: graphs recorded over the old ones would write there."""
        self.graphs.clear()

    def __call__(self, tokens, valid, lengths, want_hidden: bool) -> tuple[Any, ...]:
        """tokens, valid: [rows, width]; lengths: [rows]. Outputs are the graph's memory."""
        if self.failed is not None:
            return self.run(tokens, valid, lengths, want_hidden)
        key = (tokens.shape[0], tokens.shape[1], want_hidden)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(tokens, valid, lengths, want_hidden)
            except RuntimeError as error:  # CUDA's capture errors are RuntimeErrors
                self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
                self.graphs.clear()
                logger.warning("a pass could not be captured as a CUDA graph, so passes run "
                               "uncaptured (slower on a GPU): %s", self.failed)  # fmt: skip
                return self.run(tokens, valid, lengths, want_hidden)
            self.graphs[key] = graph
        graph.tokens.copy_(tokens)
        graph.valid.copy_(valid)
        graph.lengths.copy_(lengths)
        graph.replay()
        return graph.outputs

    def _capture(self, tokens, valid, lengths, want_hidden: bool) -> Captured:
        started = time.perf_counter()
        with torch.inference_mode(False):  # inputs for life: written in and out of it
            static = tokens.clone(), valid.clone(), lengths.clone()
            holes = torch.zeros_like(valid)  # the warm-up writes the scratch slot alone

        def run() -> tuple[Any, ...]:
            return self.run(*static, want_hidden)

        def warm() -> None:
            self.run(static[0], holes, static[2], want_hidden)

        replay, outputs = self.capture(run, warm)
        self.synchronize()
        rows, width = tokens.shape
        self.times.append(CaptureTime(rows, width, want_hidden, time.perf_counter() - started))
        return Captured(*static, replay=replay, outputs=outputs)
