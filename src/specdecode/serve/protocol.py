"""OpenAI request bodies read into frozen requests, and OpenAI error bodies.

Every field is checked by hand rather than by a schema library so that each refusal names the
field (`param`) and says what would be accepted. Fields that would change the output and are not
implemented are refused by name, never ignored: a client that asks for a penalty and silently
gets none would be misled. Their neutral values (what a client library may send by default, such
as `n: 1` or `presence_penalty: 0`) are accepted.

Whatever the body holds, parsing it ends in a request or a `RequestError`, never another
exception: JSON nested deeper than the parser recurses, numbers of more digits than Python
converts, `NaN`, and strings holding a lone UTF-16 surrogate (which JSON's `\\ud800` escape can
write but no text encodes, so the tokenizer and the response would fail on it) are refused with
400. An error message never repeats more than a short piece of what was sent.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_STOPS = 4
# a stop string's characters: far more than any stop sequence needs, and the held-back text a
# row checks against it each round stays short
MAX_STOP_CHARS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# a request body's size (--max-body-mib): token ids of the whole batch's prompts take far less
DEFAULT_MAX_BODY_MIB = 4.0
# a temperature below this runs greedy, as in vLLM: dividing the logits by less overflows them
# and the row's law becomes NaN
GREEDY_BELOW = 1e-5
SHOWN_CHARS = 40  # of a value repeated in an error message
# a `cache_salt`'s characters: a salt needs far fewer (vLLM's examples are base64 of 32 bytes)
MAX_SALT_CHARS = 256
MAX_INT = 2**63 - 1  # an integer field's bound, as the int64 of OpenAI's and vLLM's schemas
# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): the only way a body can carry a lone one
# (the raw bytes are not UTF-8, refused before parsing)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body. Its texts are made encodable (a lone surrogate written as `\\ud800`)
    so that whatever an error repeats, the response can be sent."""
    error = {"message": _encodable(message), "type": type, "param": _encodable(param)}
    return {"error": error | {"code": code}}


def _encodable(text: str | None) -> str | None:
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _show(v: Any) -> str:
    """A value in an error message: short scalars as JSON writes them, long ones cut, and
    containers by their type (a body may hold megabytes, or nesting too deep to print)."""
    if isinstance(v, dict | list):
        return "an object" if isinstance(v, dict) else "an array"
    text = json.dumps(v)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _name(name: str) -> str:
    """A field name as a `param`: cut short (a body may have a key of a megabyte)."""
    return name if len(name) <= SHOWN_CHARS else name[: SHOWN_CHARS - 3] + "..."


def _neutral_none(v: Any) -> bool:
    return v is None


# field -> test of the values that ask for nothing beyond what the server does
UNSUPPORTED: dict[str, Any] = {
    "n": lambda v: v is None or (v == 1 and not isinstance(v, bool)),
    "best_of": lambda v: v is None or (v == 1 and not isinstance(v, bool)),
    "presence_penalty": lambda v: v is None or (v == 0 and not isinstance(v, bool)),
    "frequency_penalty": lambda v: v is None or (v == 0 and not isinstance(v, bool)),
    "repetition_penalty": lambda v: v is None or (v == 1 and not isinstance(v, bool)),
    "min_p": lambda v: v is None or (v == 0 and not isinstance(v, bool)),
    "min_tokens": lambda v: v is None or (v == 0 and not isinstance(v, bool)),
    "logit_bias": lambda v: v is None or v == {},
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or (v == 0 and not isinstance(v, bool)),
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "parallel_tool_calls": _neutral_none,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "stop_token_ids": lambda v: v is None or v == [],
    "include_stop_str_in_output": lambda v: v is None or v is False,
    "prediction": _neutral_none,
    "audio": _neutral_none,
    "modalities": lambda v: v is None or v == ["text"],
    "reasoning_effort": _neutral_none,
}
# fields that change nothing in the output
HARMLESS = {"user", "metadata", "store", "service_tier", "stream_options"}
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "ignore_eos",
    "cache_salt",
}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
CHAT_ROLES = ("system", "developer", "user", "assistant")
MESSAGE_FIELDS = {"role", "content"}


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: as many as the context leaves (chat)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    # vLLM's and llama-server's extension: the end-of-text tokens do not end the row, so a
    # request runs to max_tokens (equal work for every server a benchmark compares)
    ignore_eos: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # one choice each, in order
    sampling: Sampling
    stream: bool
    include_usage: bool
    # vLLM's extension: the request reuses cached prompt prefixes only of requests with the
    # same salt (and key), so no other client learns whether it sent a guessed prompt
    cache_salt: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, str], ...]  # {"role", "content"} as the chat template reads them
    sampling: Sampling
    stream: bool
    include_usage: bool
    cache_salt: str | None = None  # as `CompletionRequest.cache_salt`


def _no_constant(name: str) -> Any:
    raise RequestError(f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; anything else is a 400 naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(
            f"the request body is not valid UTF-8 (byte {error.start}); JSON is sent as UTF-8"
        ) from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(
            "the request body is not accepted: its JSON is nested too deeply"
        ) from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise RequestError(
            "the request body is not accepted: a number has too many digits"
        ) from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):
        _refuse_surrogates(body)
    return body


def _refuse_surrogates(body: dict[str, Any]) -> None:
    """A 400 naming the first field found whose string (or key) holds a lone surrogate, if any.

    Walked without recursion, as the body may nest as deep as the parser allowed."""

    def bad(text: str) -> bool:
        return not text.isascii() and _SURROGATE.search(text) is not None

    def refuse(path: str) -> None:
        param = _encodable(_name(path))
        raise RequestError(
            f"{param} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not text; send each character whole",
            param,
        )

    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str) and bad(v):
            refuse(path)
        elif isinstance(v, dict):
            for k, x in v.items():
                field = f"{path}.{k}" if path else k
                if bad(k):
                    refuse(field)
                stack.append((field, x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v) if not _scalar(x))


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float)


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _int(body: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, got {_type_name(v)}", name)
    if low is not None and v < low:
        raise RequestError(f"{name} must be >= {low}, got {_show(v)}", name)
    if v > MAX_INT:
        raise RequestError(f"{name} must be < 2**63, got {_show(v)}", name)
    return v


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, got {_show(v)}", name)
    return float(v)


def _bool(body: dict, name: str, where: str = "") -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(
            f"{where}{name} must be true or false, got {_type_name(v)}", where + name
        )
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or name in HARMLESS:
            continue
        if name in UNSUPPORTED:
            if not UNSUPPORTED[name](value):
                raise RequestError(
                    f"{name} is not supported by this server (it would change the output); "
                    f"leave it out",
                    name,
                    code="unsupported_parameter",
                )
            continue
        raise RequestError(
            f"unknown field {_show(name)}; this endpoint takes {', '.join(sorted(allowed))}",
            _name(name),
            code="unknown_parameter",
        )


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(v) > MAX_STOPS:
        raise RequestError(f"stop takes at most {MAX_STOPS} strings, got {len(v)}", "stop")
    if any(s == "" for s in v):
        raise RequestError("stop strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise RequestError(f"a stop string takes at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(v)


def _sampling(body: dict, max_tokens: int | None) -> Sampling:
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(
            f"temperature must be >= 0 (0 is greedy), got {_show(temperature)}", "temperature"
        )
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {_show(top_p)}", "top_p")
    top_k = _int(body, "top_k", 0, low=-1)
    seed = _int(body, "seed", None, low=0)
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(0, top_k),  # -1 (vLLM's "off") is 0 here
        seed=seed,
        stop=_stops(body),
        ignore_eos=_bool(body, "ignore_eos"),
    )


def _common(body: dict) -> tuple[str, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required: a string, the id from GET /v1/models", "model")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(
                'stream_options takes only {"include_usage": true|false}', "stream_options"
            )
        include_usage = _bool(options, "include_usage", "stream_options.")
    return model, stream, include_usage


def _cache_salt(body: dict) -> str | None:
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_SALT_CHARS:
        raise RequestError(
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters",
            "cache_salt",
        )
    return v


def _prompts(v: Any) -> tuple[str | tuple[int, ...], ...]:
    def ids(x: Any) -> tuple[int, ...] | None:
        if (
            isinstance(x, list)
            and x
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        ):
            return tuple(x)
        return None

    if isinstance(v, str):
        prompts: list = [v]
    elif ids(v) is not None:
        prompts = [ids(v)]
    elif isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
        prompts = [p if isinstance(p, str) else ids(p) for p in v]
    else:
        raise RequestError(
            "prompt is required: a string, a list of token ids, or a non-empty list of either",
            "prompt",
        )
    if any(p == "" for p in prompts):
        raise RequestError("prompt must not be empty", "prompt")
    return tuple(prompts)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    _check_fields(body, COMPLETION_FIELDS)
    model, stream, include_usage = _common(body)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompts = _prompts(body["prompt"])
    max_tokens = _int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, low=1)
    return CompletionRequest(
        model, prompts, _sampling(body, max_tokens), stream, include_usage, _cache_salt(body)
    )


def _content(message: dict, where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = _show(part.get("type")) if isinstance(part, dict) else _type_name(part)
                raise RequestError(
                    f"{where}.content: only text parts are supported, got {kind}", where
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content: a text part needs a string text", where)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", where)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    _check_fields(body, CHAT_FIELDS)
    model, stream, include_usage = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is required: a non-empty list of messages", "messages")
    rendered = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}", where)
        for name, value in m.items():
            # a null or empty field asks for nothing (clients echo an answer's `refusal: null`);
            # any other is refused: `name`, say, is not rendered by the chat templates, so
            # taking it would ignore it silently
            if name not in MESSAGE_FIELDS and value is not None and value != []:
                field = f"{where}.{_name(name)}"
                raise RequestError(
                    f"{field} is not supported by this server (the chat template would not "
                    "render it); leave it out",
                    field,
                    code="unsupported_parameter",
                )
        # "developer" is the newer name of "system"; chat templates know "system"
        rendered.append(
            {"role": "system" if role == "developer" else role, "content": _content(m, where)}
        )
    max_tokens = _int(body, "max_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", None, low=1)
    return ChatRequest(
        model,
        tuple(rendered),
        _sampling(body, max_tokens),
        stream,
        include_usage,
        _cache_salt(body),
    )
