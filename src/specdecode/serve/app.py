"""The OpenAI-compatible routes over the scheduler: completions, chat, models, health, metrics.

A request is checked before any work is done for it, cheapest first: its key, its content type
and its body's size (before the body is read), then the body parsed, its prompts counted and
their characters bounded by the context, and only then tokenized. Parsing, rendering the chat
template and tokenizing run in one worker thread, off the event loop, so a long prompt delays
no other client's stream. A failure the server did not foresee answers 500 with a request id
only; its detail goes to the log under that id, never to the client.

A client that disconnects is noticed when it happens (its disconnect message is awaited, not
polled), streamed or not: its rows are cancelled at once, so one still queued leaves the queue
before it takes a row and is prefilled, and one whose client left while it was tokenized is
never queued. Rows reuse cached prompt prefixes only of requests with the same API key and
`cache_salt` (`scheduler.cache_partition`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.core.config import UNNAMED_CONTEXT  # the row length of such a model's loop
from specdecode.models.tokenizer import render_chat
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.output import RowResult, spec_metrics, usage
from specdecode.serve.protocol import (
    DEFAULT_MAX_BODY_MIB,
    ChatRequest,
    CompletionRequest,
    RequestError,
    Sampling,
    error_body,
    parse_chat,
    parse_completion,
    parse_json,
)
from specdecode.serve.scheduler import RowStream, Scheduler, cache_partition

# a prompt's characters per token of the context beyond which it cannot fit, refused before it
# is tokenized: generous (English runs about 4, code about 3, long runs of spaces more)
PROMPT_CHARS_PER_TOKEN = 32
TEMPLATE_MESSAGE_CHARS = 300  # of a chat template's own error message, repeated to the client

log = logging.getLogger("specdecode.serve")


class InternalError(RequestError):
    """A 500 as the client sees it: "internal error" and the request id its detail is logged
    under."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"internal error (request id {request_id})", status=500, type="server_error"
        )
        self.request_id = request_id


def internal_error(detail: str, exc_info: BaseException | None = None) -> InternalError:
    """Log `detail` (and the traceback of `exc_info`) under a new request id; the error to
    answer with, which says no more than that id."""
    request_id = f"req-{uuid.uuid4().hex[:24]}"
    log.error("internal error (request id %s): %s", request_id, detail, exc_info=exc_info)
    return InternalError(request_id)


def public(error: RequestError) -> RequestError:
    """The error as the client may see it: a 500's message (the engine's words about what
    failed, which may name another request's state) goes to the log only."""
    if error.status == 500 and not isinstance(error, InternalError):
        return internal_error(error.message)
    return error


class InternalErrors:
    """ASGI middleware answering any exception no handler took with `internal_error`'s 500.

    Starlette's own last-resort handler answers and then re-raises, so that uvicorn logs the
    traceback a second time without the id; here it is logged once, with the id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            error = internal_error(f"{scope['method']} {scope['path']} failed", exc)
            if not started:  # else the response is under way: uvicorn closes the connection
                await JSONResponse(error.body(), status_code=500)(scope, receive, send)


class CloseWhileDraining:
    """ASGI middleware asking every response of a draining server to close its connection
    (`Connection: close`), so that no client sends its next request down a connection the
    server is about to close: a request that meets the closing unread is reset, and its client
    cannot tell whether it was taken."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.state.draining:
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)


def _template_error(error: Exception) -> bool:
    """Whether `error` is a chat template's own: jinja's `TemplateError` (a template's
    `raise_exception`, an undefined name, a syntax error). jinja2 is loaded if one was raised."""
    jinja2 = sys.modules.get("jinja2")
    return jinja2 is not None and isinstance(error, jinja2.TemplateError)


def warm_tokenizer(tokenizer: Any) -> None:
    """Load at start-up what the first request would otherwise load: the tokenizer's chat half
    (`transformers` and the compiled chat template, which a `SavedTokenizer` loads at its first
    chat rendering, a second or more) and whatever its first encoding builds."""
    tokenizer("start", add_special_tokens=False)
    if getattr(tokenizer, "chat_template", None):
        try:
            render_chat(tokenizer, [{"role": "user", "content": "start"}])
        except Exception as error:  # a template may refuse this conversation: it is loaded
            log.debug("the start-up chat rendering failed: %s", error)


@dataclass
class ServerState:
    scheduler: Scheduler
    metrics: ServerMetrics
    model_name: str
    api_key: str | None = None
    context: int | None = None  # tokens per row the server admits (None: the model's)
    draining: bool = False
    # requests admitted whose handler has not returned: being parsed and tokenized, not yet
    # queued, or waiting for a whole answer; a drain waits for them as for queued rows
    admitted: int = 0
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MIB * 2**20)
    # parsing, chat templates and tokenizing, one request at a time, off the event loop (one
    # thread: the tokenizer is not used from several at once)
    worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="specdecode-requests")
    )

    def row_context(self) -> int:
        # a model that names no context length: as long as the engine's rows are made
        model = int(self.scheduler.context_length or UNNAMED_CONTEXT)
        return min(model, self.context) if self.context else model

    def max_prompts(self) -> int:
        """Prompts one request may hold: each takes a row, and more than the batch and the
        queue hold together would always be refused as a full queue."""
        return self.scheduler.max_rows + self.scheduler.max_queue


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected. The server's disconnect message is awaited
    (as Starlette's own stream does), so a client that leaves is noticed at once rather than
    at the next poll, in which a queued row could have been admitted and prefilled."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# one encoder for every event: `json.dumps` with any option set builds a new one each call, a
# cost paid at every streamed token; compact, as OpenAI's own stream is
_encode = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":")).encode


def _sse(payload: Any) -> bytes:
    return b"data: " + _encode(payload).encode() + b"\n\n"


class Rows:
    """The rows of one request (a choice each), submitted together and cancelled together."""

    def __init__(
        self,
        state: ServerState,
        prompts: list[list[int]],
        sampling: Sampling,
        partition: str = "",
    ) -> None:
        """`partition`: the prefix-cache partition of the request's key and salt."""
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
        self.partition = partition
        self.streams: list[RowStream] = []
        # every row's updates, tagged with its index, read by the request's own task
        self.inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    def submit(self, arrival: float) -> None:
        """All rows join the queue, or none (a full queue refuses the whole request)."""
        try:
            for i, (prompt, max_tokens) in enumerate(self.rows):
                stream = RowStream(
                    self.state.scheduler,
                    prompt,
                    max_tokens,
                    self.sampling,
                    arrival,
                    self.inbox,
                    i,
                    self.partition,
                )
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
        async for _ in self.merged(request):
            pass
        return self.results

    async def merged(self, request: Request) -> AsyncIterator[tuple[int, str | None]]:
        """(choice, piece) as rows produce text; (choice, None) when a row ends. A failed row
        raises its `RequestError`, and a client that goes away a 499, whether or not the server
        tells the response (a server of ASGI spec 2.4 tells it only when a send fails); either
        way every row still running is cancelled."""

        async def watch() -> None:
            await client_gone(request)
            self.inbox.put_nowait((-1, RequestError("the client went away", status=499)))

        watcher = asyncio.create_task(watch())
        try:
            remaining = len(self.streams)
            while remaining:
                i, item = await self.inbox.get()
                if isinstance(item, RequestError):
                    raise item
                stream = self.streams[i]
                if stream.done:  # delivered before the row's cancel reached the engine
                    continue
                piece = stream.take(item)
                if piece:
                    yield i, piece
                if stream.done:
                    remaining -= 1
                    yield i, None
        finally:
            watcher.cancel()
            self.cancel()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    scheduler, metrics = state.scheduler, state.metrics

    app.add_middleware(InternalErrors)
    app.add_middleware(CloseWhileDraining, state=state)  # outermost: over InternalErrors' 500

    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError) -> JSONResponse:
        error = public(error)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code)

    def authorize(request: Request) -> str | None:
        """The key presented, checked against `--api-key`; None where the server has none."""
        if state.api_key is None:
            return None
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
        return key.strip()

    @contextmanager
    def admitted() -> Iterator[None]:
        """The request counted in `state.admitted` while inside, after it is refused if the
        server cannot take work now: still loading, or shutting down."""
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
        state.admitted += 1
        try:
            yield
        finally:
            state.admitted -= 1

    def check_content_type(request: Request) -> None:
        """JSON, or no content type said (taken as JSON)."""
        declared = request.headers.get("content-type")
        if declared is None:
            return
        media = declared.partition(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise RequestError(
                f"the request body must be JSON, sent with Content-Type: application/json "
                f"(got {media[:60]!r})",
                status=415,
                code="unsupported_media_type",
            )

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 past `max_body_bytes` before it is parsed: at once by its
        declared length, else as soon as what arrives exceeds it."""
        limit = state.max_body_bytes
        too_large = RequestError(
            f"the request body is over the server's limit of {limit / 2**20:g} MiB "
            "(--max-body-mib)",
            status=413,
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # no one to answer; not a failure of the server's
            raise RequestError("the client went away before sending its body", status=499) from None
        return b"".join(chunks)

    def check_model(model: str) -> None:
        if model != state.model_name:
            shown = model if len(model) <= 80 else model[:77] + "..."
            raise RequestError(
                f"the model {shown!r} does not exist; this server serves {state.model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )

    def check_length(size: int, unit: str, where: str, param: str = "prompt") -> None:
        """Refuse a prompt that cannot fit the context, before it is tokenized: more tokens
        than the context, or more characters than `PROMPT_CHARS_PER_TOKEN` times it."""
        context = state.row_context()
        limit = context if unit == "tokens" else context * PROMPT_CHARS_PER_TOKEN
        if size > limit:
            per = "" if unit == "tokens" else f" ({PROMPT_CHARS_PER_TOKEN} per token)"
            raise RequestError(
                f"this request{where} has {size} prompt {unit}, over the {limit}{per} that the "
                f"context of {context} tokens per request can take; shorten the prompt",
                param,
                code="context_length_exceeded",
            )

    def encode_text(text: str, where: str = "", add_special_tokens: bool = True) -> list[int]:
        check_length(len(text), "characters", where)
        return list(scheduler.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def check_ids(ids: tuple[int, ...], where: str = "") -> list[int]:
        check_length(len(ids), "tokens", where)
        vocab = scheduler.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})",
                "prompt",
            )
        return list(ids)

    def render(messages: tuple[dict[str, str], ...]) -> str:
        """The conversation in the model's chat template; a template's refusal is a 400."""
        tokenizer = scheduler.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions", "messages"
            )
        check_length(sum(len(m["content"]) for m in messages), "characters", "", "messages")
        try:
            return render_chat(tokenizer, list(messages), "messages")
        except Exception as error:
            if not _template_error(error):
                raise
            said = str(error)[:TEMPLATE_MESSAGE_CHARS]
            raise RequestError(
                f"the model's chat template refused these messages: {said}", "messages"
            ) from None

    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, list[list[int]]]:
        """The request parsed and its prompts tokenized (in the worker thread)."""
        req = parse_completion(parse_json(raw))
        check_model(req.model)
        count, most = len(req.prompts), state.max_prompts()
        if count > most:
            raise RequestError(
                f"prompt holds {count} prompts; this server takes at most {most} per request "
                f"(the {scheduler.max_rows} rows of --max-batch and the {scheduler.max_queue} "
                "waiting of --max-queue)",
                "prompt",
            )
        prompts = []
        for i, p in enumerate(req.prompts):
            where = f" (prompt {i})" if count > 1 else ""
            prompts.append(encode_text(p, where) if isinstance(p, str) else check_ids(p, where))
        return req, prompts

    def prepare_chat(raw: bytes) -> tuple[ChatRequest, list[list[int]]]:
        """The request parsed, rendered and tokenized (in the worker thread)."""
        req = parse_chat(parse_json(raw))
        check_model(req.model)
        return req, [encode_text(render(req.messages), add_special_tokens=False)]

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if scheduler.state == "ready":
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": scheduler.state}, status_code=503)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        authorize(request)
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

    async def handle(request: Request, prepare: Callable[[bytes], Any], chat: bool) -> Response:
        """A generation request, checked: authorized, JSON of an allowed size, admitted (not
        loading nor draining); then `prepare`d (parsed, its model ours, tokenized) in the
        worker thread, and answered."""
        arrival = time.monotonic()
        key = authorize(request)
        check_content_type(request)
        raw = await read_body(request)
        with admitted():
            req, prompts = await asyncio.get_running_loop().run_in_executor(
                state.worker, prepare, raw
            )
            return await answer(request, arrival, key, prompts, req, chat)

    async def answer(
        request: Request,
        arrival: float,
        key: str | None,
        prompts: list[list[int]],
        req: Any,
        chat: bool,
    ) -> Response:
        """Run the rows; a stream of chunks, or one response once every row has ended. A client
        that left while its request waited for the worker is not queued at all."""
        rows = Rows(state, prompts, req.sampling, cache_partition(key, req.cache_salt))
        if await request.is_disconnected():  # answers no one: no row is taken for it
            raise RequestError("the client went away before its request was queued", status=499)
        rows.submit(arrival)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
        }
        if req.stream:
            return _stream(request, rows, head, req.include_usage, chat=chat)
        results = await rows.collect(request)
        choices = [
            {"index": i, "logprobs": None, "finish_reason": r.finish_reason}
            | ({"message": {"role": "assistant", "content": r.text}} if chat else {"text": r.text})
            for i, r in enumerate(results)
        ]
        return JSONResponse(
            {**head, "choices": choices, "usage": usage(results), "metrics": spec_metrics(results)}
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, prepare_completion, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, prepare_chat, chat=True)

    return app


def _stream(
    request: Request, rows: Rows, head: dict[str, Any], include_usage: bool, chat: bool
) -> Response:
    """Server-sent events: a chunk per piece of text, a last chunk per choice with its
    finish_reason, the usage chunk if asked, then `[DONE]`. A client that goes away ends this
    generator (`Rows.merged`, or the server closing it), which cancels its rows."""
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
            async for i, piece in rows.merged(request):
                if piece is None:
                    yield _sse(chunk(i, None, rows.results[i].finish_reason))
                else:
                    yield _sse(chunk(i, piece, None))
            if include_usage:
                results = rows.results
                yield _sse(
                    {
                        **head,
                        "choices": [],
                        "usage": usage(results),
                        "metrics": spec_metrics(results),
                    }
                )
        except RequestError as error:
            yield _sse(public(error).body())
        except Exception as exc:
            yield _sse(internal_error("a stream failed", exc).body())
        finally:
            rows.cancel()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
