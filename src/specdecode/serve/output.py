"""A row's output as its client sees it: the text of its committed tokens, given out as it
becomes safe to show, its finish reason, its usage and speculative counts, and the server's
per-request metrics.

The engine thread only hands a row's updates over (`serve.scheduler`); they become output here,
on the event loop's side, as the request reads them, so no round of the engine waits on a
tokenizer or a stop string. The text itself, held back at split characters and possible stop
strings, is `serve.text`'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from specdecode.core.engine import RowUpdate
from specdecode.serve.metrics import RequestSpec, ServerMetrics
from specdecode.serve.protocol import RequestError
from specdecode.serve.text import RowText

log = logging.getLogger("specdecode.serve")


@dataclass
class RowResult:
    """What the asyncio side knows of a row once it has ended."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: RequestSpec = field(default_factory=RequestSpec)


class RowOutput:
    """One row's updates turned into the pieces of text to send, and counted.

    `add` takes each update in turn and returns the text it makes safe to show; once `ended`
    (the row finished, or a stop string appeared while it still runs) `result` is complete,
    and `finish` counts the request in the server's metrics. A request that fails or whose
    client leaves is not counted: `finish` is called only for a row that ended.
    """

    def __init__(
        self,
        tokenizer: Any,
        stops: tuple[str, ...],
        stop_ids: tuple[int, ...],
        prompt_tokens: int,
        arrival: float,
        metrics: ServerMetrics,
    ) -> None:
        """`stop_ids`: the ids that end the row, whose text is not part of the answer;
        `arrival`: when the request came (`time.monotonic`), for its latencies."""
        self.text = RowText(tokenizer, stops, stop_ids)
        self.stop_ids = stop_ids
        self.arrival = arrival
        self.metrics = metrics
        self.result = RowResult(prompt_tokens=prompt_tokens)
        self.first: float | None = None  # when the first token came
        self.ended = False

    def add(self, update: RowUpdate) -> str:
        """The text that `update` makes safe to show ("" while none is); the round's counts go
        to the request's and the server's."""
        metrics, result = self.metrics, self.result
        if update.reused:
            metrics.prefix_reused_tokens.inc(update.reused)
        result.spec.add(update.drafted, update.accepted)
        metrics.add_round(update.drafted, update.accepted)
        if update.tokens and self.first is None:
            self.first = time.monotonic()
            metrics.ttft.observe(self.first - self.arrival)
        piece = self._text(update.tokens, update.finished)
        if self.text.stopped or update.finished:
            self.ended = True
            result.text = self.text.emitted
            last = update.tokens[-1] if update.tokens else None
            stop = self.text.stopped or last in self.stop_ids
            result.finish_reason = "stop" if stop else "length"
            result.completion_tokens = self.text.tokens_used
        return piece

    def _text(self, tokens: list[int], finished: bool) -> str:
        """`RowText.feed`, where a tokenizer that cannot decode the row's tokens, or a stop
        string that cannot be matched, fails this request alone, with an OpenAI error rather
        than a broken response."""
        try:
            return self.text.feed(tokens, final=finished)
        except Exception as error:
            log.exception("turning a row's tokens into text failed; that request fails")
            raise RequestError(
                f"the server could not turn this request's tokens into text: "
                f"{type(error).__name__}: {error}",
                status=500,
                type="server_error",
            ) from None

    def finish(self) -> None:
        """The ended request in the server's latencies, token counts and finish reasons."""
        metrics, result = self.metrics, self.result
        done = time.monotonic()
        metrics.e2e.observe(done - self.arrival)
        if self.first is not None and result.completion_tokens > 1:
            metrics.tpot.observe((done - self.first) / (result.completion_tokens - 1))
        metrics.prompt_tokens.inc(result.prompt_tokens)
        metrics.generation_tokens.inc(result.completion_tokens)
        metrics.requests_success.labels(finished_reason=result.finish_reason).inc()


def usage(results: list[RowResult]) -> dict[str, int]:
    """A response's `usage`: the tokens of all its rows (a request with several prompts)."""
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def spec_metrics(results: list[RowResult]) -> dict[str, Any]:
    """A response's `metrics`: what speculation did for all its rows, as vLLM reports it."""
    return {"speculative_decoding": RequestSpec.total([r.spec for r in results]).as_dict()}
