"""The OpenAI-compatible routes over the scheduler: completions, chat, models, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.models.tokenizer import render_chat
from specdecode.serve.metrics import RequestSpec, ServerMetrics
from specdecode.serve.protocol import (
    RequestError,
    Sampling,
    error_body,
    parse_chat,
    parse_completion,
    parse_json,
)
from specdecode.serve.scheduler import RowResult, RowStream, Scheduler

DISCONNECT_POLL_SECONDS = 0.5
UNNAMED_CONTEXT = 1 << 16  # the row length `SpeculativeDecoder.loop` makes for such a model


class ClientGone(Exception):
    """The client of a non-streamed request disconnected before its answer."""


@dataclass
class ServerState:
    scheduler: Scheduler
    metrics: ServerMetrics
    model_name: str
    api_key: str | None = None
    context: int | None = None  # tokens per row the server admits (None: the model's)
    draining: bool = False

    def row_context(self) -> int:
        # a model that names no context length: as long as the engine's rows are made
        model = int(self.scheduler.decoder.context or UNNAMED_CONTEXT)
        return min(model, self.context) if self.context else model


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _usage(results: list[RowResult]) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _spec(results: list[RowResult]) -> dict[str, Any]:
    return {"speculative_decoding": RequestSpec.total([r.spec for r in results]).as_dict()}


class Rows:
    """The rows of one request (a choice each), submitted together and cancelled together."""

    def __init__(self, state: ServerState, prompts: list[list[int]], sampling: Sampling) -> None:
        context = state.row_context()
        self.rows = []
        for i, prompt in enumerate(prompts):
            room = context - len(prompt)
            max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
            if len(prompt) + max_tokens > context or max_tokens < 1:
                where = f" (prompt {i})" if len(prompts) > 1 else ""
                raise RequestError(
                    f"this request{where} takes {len(prompt)} prompt tokens + {max_tokens} new "
                    f"tokens, over the context of {context} tokens per request; shorten the "
                    "prompt or lower max_tokens",
                    "max_tokens" if sampling.max_tokens is not None else "prompt",
                    code="context_length_exceeded",
                )
            self.rows.append((prompt, max_tokens))
        self.state = state
        self.sampling = sampling
        self.streams: list[RowStream] = []

    def submit(self, arrival: float) -> None:
        """All rows join the queue, or none (a full queue refuses the whole request)."""
        try:
            for prompt, max_tokens in self.rows:
                stream = RowStream(self.state.scheduler, prompt, max_tokens, self.sampling, arrival)
                self.streams.append(stream)
                stream.submit()
        except RequestError:
            self.cancel()
            raise

    def cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

    @property
    def results(self) -> list[RowResult]:
        return [s.result for s in self.streams]

    async def collect(self, request: Request) -> list[RowResult]:
        """Every row to its end (a failed row fails the request and cancels the others). A
        client that goes away before the answer cancels the rows too, rather than leaving them
        to decode for nobody."""

        async def one(stream: RowStream) -> None:
            async with contextlib.aclosing(stream.pieces()) as pieces:
                async for _ in pieces:
                    pass

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            raise ClientGone

        try:
            async with asyncio.TaskGroup() as group:
                rows = [group.create_task(one(stream)) for stream in self.streams]
                watcher = group.create_task(watch())
                await asyncio.wait(rows)
                watcher.cancel()
        except* RequestError as errors:
            raise errors.exceptions[0] from None
        except* ClientGone:
            raise RequestError("the client went away", status=499) from None
        finally:
            self.cancel()
        return self.results

    async def merged(self) -> AsyncIterator[tuple[int, str | None]]:
        """(choice, piece) as rows produce text; (choice, None) when a row ends."""
        out: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RowStream) -> None:
            try:
                async with contextlib.aclosing(stream.pieces()) as pieces:
                    async for piece in pieces:
                        out.put_nowait((i, piece))
                out.put_nowait((i, None))
            except RequestError as error:
                out.put_nowait((i, error))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await out.get()
                if isinstance(item, RequestError):
                    raise item
                if item is None:
                    remaining -= 1
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    scheduler, metrics = state.scheduler, state.metrics

    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, error: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"internal error: {type(error).__name__}: {error}", "server_error"),
            status_code=500,
        )

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), state.api_key.encode()
        ):
            raise RequestError(
                "a valid API key is required: send the header Authorization: Bearer <key>",
                status=401,
                code="invalid_api_key",
            )

    def admit() -> None:
        """Refuse work the server cannot take now: still loading, or shutting down."""
        if state.draining:
            raise RequestError(
                "the server is shutting down and takes no new requests",
                status=503,
                type="server_error",
                code="shutting_down",
            )
        if scheduler.state != "ready":
            raise RequestError(
                "the model is still loading; retry when GET /health answers 200",
                status=503,
                type="server_error",
                code="model_loading",
                headers={"Retry-After": "5"},
            )

    def check_model(model: str) -> None:
        if model != state.model_name:
            raise RequestError(
                f"unknown model {model!r}; this server serves {state.model_name!r}",
                "model",
                code="model_not_found",
            )

    def encode_text(text: str, add_special_tokens: bool = True) -> list[int]:
        return list(
            scheduler.decoder.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        )

    def check_ids(ids: tuple[int, ...]) -> list[int]:
        vocab = int(scheduler.decoder.vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})",
                "prompt",
            )
        return list(ids)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if scheduler.state == "ready":
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": scheduler.state}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {
            "object": "list",
            "data": [
                {"id": state.model_name, "object": "model", "created": 0, "owned_by": "specdecode"}
            ],
        }

    async def read(request: Request, parse: Callable[[Any], Any]) -> Any:
        """The request, checked: authorized, admitted (not draining), parsed, its model ours."""
        authorize(request)
        raw = await request.body()
        admit()
        req = parse(parse_json(raw))
        check_model(req.model)
        return req

    async def answer(
        request: Request, arrival: float, prompts: list[list[int]], req: Any, chat: bool
    ) -> Response:
        """Run the rows; a stream of chunks, or one response once every row has ended."""
        rows = Rows(state, prompts, req.sampling)
        rows.submit(arrival)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
        }
        if req.stream:
            return _stream(rows, head, req.include_usage, chat=chat)
        results = await rows.collect(request)
        choices = [
            {"index": i, "logprobs": None, "finish_reason": r.finish_reason}
            | ({"message": {"role": "assistant", "content": r.text}} if chat else {"text": r.text})
            for i, r in enumerate(results)
        ]
        return JSONResponse(
            {**head, "choices": choices, "usage": _usage(results), "metrics": _spec(results)}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await read(request, parse_completion)
        prompts = [encode_text(p) if isinstance(p, str) else check_ids(p) for p in req.prompts]
        return await answer(request, arrival, prompts, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.monotonic()
        req = await read(request, parse_chat)
        try:
            text = render_chat(scheduler.decoder.tokenizer, list(req.messages), "messages")
        except ValueError:
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions", "messages"
            ) from None
        prompt = encode_text(text, add_special_tokens=False)
        return await answer(request, arrival, [prompt], req, chat=True)

    return app


def _stream(rows: Rows, head: dict[str, Any], include_usage: bool, chat: bool) -> Response:
    """Server-sent events: a chunk per piece of text, a last chunk per choice with its
    finish_reason, the usage chunk if asked, then `[DONE]`. A client that goes away closes this
    generator, which cancels its rows."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, piece: str | None, finish: str | None) -> dict[str, Any]:
        if chat:
            delta = {} if piece is None else {"content": piece}
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [choice], **extra}

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                for i in range(len(rows.streams)):
                    role = {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _sse({**head, "choices": [role], **extra})
            async for i, piece in rows.merged():
                if piece is None:
                    yield _sse(chunk(i, None, rows.results[i].finish_reason))
                else:
                    yield _sse(chunk(i, piece, None))
            if include_usage:
                results = rows.results
                yield _sse(
                    {**head, "choices": [], "usage": _usage(results), "metrics": _spec(results)}
                )
        except RequestError as error:
            yield _sse(error.body())
        finally:
            rows.cancel()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
