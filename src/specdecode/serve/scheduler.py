"""The scheduler: one thread owns the engine's `DecodeLoop`, admits rows between rounds, steps it,
and hands each row's updates to the asyncio side.

The loop is synchronous and CPU-bound, so it runs in one dedicated thread and only that thread
calls `add`, `cancel` and `step`; the event loop only queues admissions and cancellations under a
lock and wakes the thread. A row's updates go to its request through `call_soon_threadsafe`
into the request's inbox, one asyncio queue for all its rows. Requests beyond the batch wait in
a bounded queue (`max_queue`); past it the server answers 429 at once instead of letting
latency grow without bound. A row that fails inside the engine (`RowFailed`: its logits or law
unusable) fails alone, as does one whose tokens cannot be turned into text (`serve.output`),
and the other rows go on; any other error of a round fails every running row and resets the
loop and both models, so the next requests start from a clean state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from specdecode.core.config import SamplingConfig
from specdecode.core.engine import RowFailed, RowRequest, RowUpdate
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.output import RowOutput, RowResult
from specdecode.serve.protocol import RequestError, Sampling

log = logging.getLogger("specdecode.serve")


class EngineLoop(Protocol):
    """What the engine thread asks of the engine's loop: `DecodeLoop`, or the fast tests'
    stand-in, which is why this is a protocol rather than the class."""

    def __len__(self) -> int: ...

    def add(self, request: RowRequest) -> int: ...

    def cancel(self, key: int) -> None: ...

    def reset(self) -> None: ...

    def step(self) -> list[RowUpdate]: ...


class ServedDecoder(Protocol):
    """What the server asks of the decoder it serves: `SpeculativeDecoder`'s public interface,
    or the fast tests' stand-in."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def context(self) -> int | None: ...

    def default_stop_ids(self) -> tuple[int, ...]: ...

    def store_outcomes(self) -> None: ...

    def settle(self) -> None: ...

    def loop(
        self, *, max_rows: int = ..., prefill_chunk: int | None = ..., **drafting: Any
    ) -> EngineLoop: ...


@dataclass(frozen=True)
class Failure:
    """The engine could not finish a row: the request is answered with `status`."""

    message: str
    status: int = 500


@dataclass(eq=False)
class Job:
    """One row's request on its way through the scheduler."""

    request: RowRequest
    # thread-safe: puts an update or a Failure in the row's queue
    deliver: Callable[[RowUpdate | Failure], None]
    key: int | None = None


class Scheduler:
    """The engine thread, its admissions and its rows. What the routes need of the served model
    (its tokenizer, vocabulary, context) they ask here, so the decoder stays the engine
    thread's, read by no route, and a stand-in decoder need only meet `ServedDecoder`."""

    def __init__(
        self,
        load: Callable[[], ServedDecoder],
        metrics: ServerMetrics,
        max_rows: int = 8,
        max_queue: int = 64,
        prefill_chunk: int = 256,
        loop_options: dict[str, Any] | None = None,
    ) -> None:
        self._load = load
        self.loop_options = loop_options or {}  # drafting settings for `decoder.loop`
        self.metrics = metrics
        self.max_rows = max_rows
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self._decoder: ServedDecoder | None = None
        self.state = "loading"  # then "ready", or "failed" with load_error
        self.load_error: str | None = None
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancels: list[Job] = []
        self._running: dict[int, Job] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        self.loaded = threading.Event()  # set once state leaves "loading"

    # ------------------------------------------------------------ the served model

    def _served(self) -> ServedDecoder:
        if self._decoder is None:  # the routes admit requests only once the models are ready
            raise RuntimeError("the models have not loaded yet")
        return self._decoder

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer, for the routes to tokenize prompts and render chats."""
        return self._served().tokenizer

    @property
    def vocab_size(self) -> int:
        """The token ids a prompt may hold are 0 to `vocab_size - 1`."""
        return int(self._served().vocab_size)

    @property
    def context_length(self) -> int | None:
        """The served model's tokens per row; None for a model that names none."""
        return self._served().context

    def default_stop_ids(self) -> tuple[int, ...]:
        """The ids that end a row unless its request ignores the end of sequence."""
        return tuple(self._served().default_stop_ids())

    # ------------------------------------------------------------ event loop side

    def start(self) -> None:
        self._thread.start()

    def started(self) -> bool:
        return self._thread.ident is not None

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self.started():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._lock:
            # rows free now are taken at the next round: requests for them do not queue
            free = self.max_rows - len(self._running)
            if len(self._waiting) >= self.max_queue + max(0, free):
                raise RequestError(
                    f"the server is at capacity ({self.max_rows} requests running, "
                    f"{self.max_queue} waiting); retry shortly",
                    status=429,
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.waiting.set(len(self._waiting))
            else:
                self._cancels.append(job)
                self._lock.notify()

    def busy(self) -> int:
        """Requests accepted and not yet ended (waiting or running)."""
        with self._lock:
            return len(self._waiting) + len(self._running) + len(self._cancels)

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every accepted request with an error (the drain's bound ran out)."""
        with self._lock:
            jobs = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._cancels.extend(self._running.values())
            self._lock.notify()
        for job in jobs:
            job.deliver(Failure(message, status))

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._decoder = decoder = self._load()
            loop = decoder.loop(
                max_rows=self.max_rows, prefill_chunk=self.prefill_chunk, **self.loop_options
            )
        except Exception as error:  # reported by the server, which then exits
            log.debug("loading failed", exc_info=True)
            self.load_error = str(error) or type(error).__name__
            self.state = "failed"
            self.loaded.set()
            return
        self.state = "ready"
        self.loaded.set()
        while True:
            if not len(loop) or self._stopping:
                self._store(decoder)
            with self._lock:
                while not (self._stopping or self._cancels or self._waiting or len(loop)):
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self._admit(loop)
                if len(loop):
                    self._round(loop)
            except Exception as error:  # the loop's state is not to be trusted: start clean
                self._fail_running(loop, error)

    def _store(self, decoder: ServedDecoder) -> None:
        """What drafting was worth, stored beside the prices while no round runs (idle, or
        stopping); a store that fails is logged and serving goes on."""
        try:
            decoder.store_outcomes()
        except Exception:
            log.exception("storing what drafting was worth failed; it is kept in memory")

    def _admit(self, loop: EngineLoop) -> None:
        """Cancelled rows leave and waiting requests take the free rows, before the round."""
        with self._lock:
            for job in self._cancels:
                if job.key is not None and self._running.pop(job.key, None) is not None:
                    loop.cancel(job.key)
            self._cancels.clear()
            while self._waiting and len(self._running) < self.max_rows:
                job = self._waiting.popleft()
                try:
                    job.key = loop.add(job.request)
                except ValueError as error:  # a request the engine refuses: that row alone
                    job.deliver(Failure(str(error), 400))
                    continue
                self._running[job.key] = job
            self.metrics.waiting.set(len(self._waiting))
            self.metrics.running.set(len(self._running))

    def _fail_running(self, loop: EngineLoop, error: Exception) -> None:
        log.exception("a decoding round failed; every running request fails with it")
        with self._lock:
            jobs = list(self._running.values())
            self._running.clear()
            self.metrics.running.set(0)
        try:
            loop.reset()
        except Exception:  # the next rounds will fail their requests alike, none hangs
            log.exception("resetting the loop failed")
        for job in jobs:
            job.deliver(Failure(f"the engine failed during a decoding round: {error}"))

    def _round(self, loop: EngineLoop) -> None:
        try:
            updates = loop.step()
        except RowFailed as failed:  # those rows have left the loop; the others' updates stand
            for key, reason in failed.reasons.items():
                with self._lock:
                    job = self._running.pop(key, None)
                if job is not None:
                    job.deliver(Failure(f"the engine failed on this request: {reason}"))
            updates = failed.updates
        with self._lock:
            for update in updates:
                job = self._running.get(update.key)
                if job is None:  # cancelled while the round ran
                    continue
                if update.finished:
                    del self._running[update.key]
                job.deliver(update)
            self.metrics.running.set(len(self._running))


def cache_partition(key: str | None, salt: str | None) -> str:
    """The prefix-cache partition of a request: "" (shared) with neither an API key nor a
    `cache_salt`, else a hash of both. Rows reuse cached prefixes only within a partition, so a
    client cannot learn, from a prefix reused faster or counted in /metrics, what a client of
    another key or salt sent. The key is hashed, never kept, as the partition names the cells."""
    if key is None and salt is None:
        return ""
    return hashlib.sha256(json.dumps([key, salt]).encode()).hexdigest()


def row_request(
    prompt: list[int],
    max_tokens: int,
    sampling: Sampling,
    stop_ids: tuple[int, ...],
    partition: str = "",
) -> RowRequest:
    return RowRequest(
        prompt=list(prompt),
        max_new_tokens=max_tokens,
        sampling=SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p),
        seed=sampling.seed,
        stop_token_ids=tuple(stop_ids),
        cache_partition=partition,
    )


class RowStream:
    """One row of a request: `submit` it (a full queue refuses at once, before any response
    starts); the engine thread then delivers its updates, tagged with the row's `index`, to the
    request's `inbox`, one asyncio queue for all its rows, and `take` turns each into the text it
    makes safe to show (a `RowOutput`), filling in `result`.

    One queue a request, read by the request's own task, is one wake of the event loop a round,
    with no task between the engine and the response. The row leaves the engine whenever its
    output ends before the engine says so (a stop string) or its request stops reading (a client
    that disconnects, another row failing): whoever reads the inbox then calls `cancel`, so its
    cache is freed before the next round.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        arrival: float,
        inbox: asyncio.Queue[tuple[int, Any]],
        index: int,
        partition: str = "",
    ) -> None:
        """`partition`: the request's prefix-cache partition (`cache_partition`)."""
        self.scheduler = scheduler
        self.aloop = asyncio.get_running_loop()
        self.inbox = inbox
        self.index = index
        stop_ids = () if sampling.ignore_eos else scheduler.default_stop_ids()
        try:
            request = row_request(prompt, max_tokens, sampling, stop_ids, partition)
        except ValueError as error:  # what the engine's own checks refuse
            raise RequestError(str(error)) from None
        self.job = Job(request, self._deliver)
        self.output = RowOutput(
            scheduler.tokenizer, sampling.stop, stop_ids, len(prompt), arrival, scheduler.metrics
        )
        self.ended = True  # out of the engine: nothing to cancel until submitted

    @property
    def done(self) -> bool:
        """Whether the row's output has ended: deliveries still on their way are stale."""
        return self.output.ended

    @property
    def result(self) -> RowResult:
        return self.output.result

    def _deliver(self, item: RowUpdate | Failure) -> None:  # engine thread
        with contextlib.suppress(RuntimeError):  # the event loop has closed (shutdown)
            self.aloop.call_soon_threadsafe(self.inbox.put_nowait, (self.index, item))

    def submit(self) -> None:
        self.scheduler.submit(self.job)
        self.ended = False

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.scheduler.cancel(self.job)

    def take(self, item: RowUpdate | Failure) -> str:
        """The text `item` makes safe to show ("" while none is); a `Failure` raises the
        request's error. Once the row's output has ended it is `done`: out of the engine
        (cancelled if a stop string ended it while it still ran) and counted in the metrics."""
        if isinstance(item, Failure):
            self.ended = True
            kind = "invalid_request_error" if item.status < 500 else "server_error"
            raise RequestError(item.message, status=item.status, type=kind)
        piece = self.output.add(item)
        if self.output.ended:
            self.ended = item.finished
            self.cancel()
            self.output.finish()
        return piece
