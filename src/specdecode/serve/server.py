"""Running the app under uvicorn: models load in the background, SIGTERM drains.

uvicorn starts listening at once and the engine thread loads the models meanwhile, so `/health`
answers 503 `{"status": "loading"}` until they are ready (load balancers and the tests poll it).
On SIGTERM (or Ctrl-C) the server stops admitting (503 to new requests), lets every accepted
request finish within `drain_seconds`, ends any still running with a 503 error, and exits 0; a
second signal exits at once.

The tokenizer is made ready (its chat template loaded) as part of loading the models, before
`/health` turns 200, so that no request pays for it. A server bound to an address other clients
can reach warns when it requires no API key.
"""

from __future__ import annotations

import ipaddress
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from specdecode.serve.app import ServerState, create_app, warm_tokenizer
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.protocol import DEFAULT_MAX_BODY_MIB
from specdecode.serve.scheduler import Scheduler, ServedDecoder


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # rows decoded together
    max_queue: int = 64  # requests waiting for a row; beyond, 429
    context: int | None = None  # tokens per request (prompt + new); None: the model's
    api_key: str | None = None
    max_body_mib: float = DEFAULT_MAX_BODY_MIB  # a request body's size; beyond, 413
    drain_seconds: float = 30.0
    prefill_chunk: int = 256
    log_level: str = "info"
    # drafting settings of the engine's loop (`SpeculativeDecoder.loop`), e.g. length_policy
    loop_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        checks = {
            "--max-batch": self.max_batch >= 1,
            "--max-queue": self.max_queue >= 0,
            "--port": 0 <= self.port <= 65535,
            "--drain-seconds": self.drain_seconds >= 0,
            "--prefill-chunk": self.prefill_chunk >= 1,
            "--context": self.context is None or self.context >= 2,
            "--max-body-mib": self.max_body_mib > 0,
        }
        for flag, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"{flag} is out of range: {getattr(self, flag[2:].replace('-', '_'))}"
                )


class DrainingServer(uvicorn.Server):
    """uvicorn whose exit signal starts a drain instead of closing the listener at once.

    Once nothing accepted is left (no row queued or running, no request being tokenized), the
    listener closes and the server lingers `LINGER_S` before it exits: a client whose stream
    has just ended sends its next request down the same connection at once, and is answered
    503 `shutting_down` then, not reset by the exit's close of its connection."""

    LINGER_S = 0.5

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_seconds: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_seconds = drain_seconds
        self.deadline: float | None = None
        self.quiet_since: float | None = None  # when the drain found nothing left to finish
        self.announced = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        # not recorded as a captured signal: uvicorn would re-raise it at exit, and a drained
        # server exits 0
        if self.state.draining:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self.state.draining = True
        self.deadline = time.monotonic() + self.drain_seconds
        print(
            f"[serve] draining: no new requests; the running ones have {self.drain_seconds:g} s",
            file=sys.stderr,
        )

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:  # listening: load the models now (a port already taken has
            # ended the process before a load began, so none is cut off mid-way at exit)
            self.state.scheduler.start()

    async def on_tick(self, counter: int) -> bool:
        scheduler = self.state.scheduler
        if scheduler.state == "ready" and not self.announced:
            self.announced = True
            print(
                f"[serve] ready: model {self.state.model_name!r} at "
                f"http://{self.config.host}:{self.config.port}/v1",
                file=sys.stderr,
                flush=True,
            )
        if scheduler.state == "failed":
            self.should_exit = True
        elif self.state.draining and not self.should_exit:
            self.drain_tick(time.monotonic())
        return await super().on_tick(counter)

    def drain_tick(self, now: float) -> None:
        """One look at a drain: linger once nothing accepted is left, then exit; past the
        bound, end what still runs with an error."""
        left = self.state.scheduler.busy() + self.state.admitted
        if self.quiet_since is not None:
            self.should_exit = now - self.quiet_since >= self.LINGER_S
        elif left == 0:
            self.quiet_since = now
            for listener in self.servers:  # new connections are refused from now on
                listener.close()
        elif self.deadline is not None and now > self.deadline:
            self.state.scheduler.fail_all("the server shut down before this request finished")
            print(
                f"[serve] the drain's {self.drain_seconds:g} s ran out: {left} request(s) "
                "ended with an error",
                file=sys.stderr,
            )
            self.should_exit = True
        if self.should_exit:
            print(
                f"[serve] drained: {self.state.metrics.answered()} request(s) answered since "
                "the start; exiting",
                file=sys.stderr,
                flush=True,
            )


def loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a name other than localhost may not be)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ready_after(load: Callable[[], ServedDecoder]) -> Callable[[], ServedDecoder]:
    """`load`, then what a server does before it answers: the models settled (their move to
    2 MiB pages made now, not met halfway by requests: a server runs for long) and the
    tokenizer's chat template loaded (a first chat request would otherwise wait for it)."""

    def load_ready() -> ServedDecoder:
        decoder = load()
        decoder.settle()
        warm_tokenizer(decoder.tokenizer)
        return decoder

    return load_ready


def serve(load: Callable[[], ServedDecoder], config: ServeConfig) -> int:
    """Serve until a signal; 0 after a clean drain, 2 if the models could not be loaded."""
    if config.api_key is None and not loopback(config.host):
        print(
            f"[serve] warning: listening on {config.host}, which other machines may reach, "
            "with no API key: anyone who can connect can use the model and read /metrics; "
            "set SPECDECODE_API_KEY (or --api-key)",
            file=sys.stderr,
            flush=True,
        )

    metrics = ServerMetrics()
    scheduler = Scheduler(
        ready_after(load),
        metrics,
        config.max_batch,
        config.max_queue,
        config.prefill_chunk,
        dict(config.loop_options),
    )
    state = ServerState(
        scheduler,
        metrics,
        config.model_name,
        config.api_key,
        config.context,
        max_body_bytes=int(config.max_body_mib * 2**20),
    )
    server = DrainingServer(
        uvicorn.Config(
            create_app(state),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=5,
            # h11 whatever else is installed: httptools refuses some malformed requests (a
            # control character in a header) with uvicorn's plain-text 400, before any route
            # can answer with OpenAI's error body; what it saves a token is a tenth of uvloop's
            http="h11",
        ),
        state,
        config.drain_seconds,
    )
    try:
        server.run()
    finally:
        if scheduler.state == "loading" and scheduler.started():
            print("[serve] stopping once the models have loaded", file=sys.stderr, flush=True)
            scheduler.loaded.wait()  # the load runs in native code that cannot be cut off
        scheduler.stop()
    if scheduler.state == "failed":
        print(
            f"specdecode serve: error: loading the models failed: {scheduler.load_error}",
            file=sys.stderr,
        )
        return 2
    if not server.started:
        return 2  # uvicorn has said why (the port is taken, ...)
    return 0
