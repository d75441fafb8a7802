"""A stand-in for the engine's `DecodeLoop` and decoder (the scheduler's `EngineLoop` and
`ServedDecoder`), for the server's fast tests.

Tokens are bytes (a multi-byte character spans tokens, as with real byte-level tokenizers), so
text holding-back is exercised. A row echoes its prompt's bytes cyclically, a few tokens a round
(the count varies by round and row, as ragged acceptance does); a `#` in the echo is the end id
instead. A prompt containing FAIL fails its row alone (`RowFailed`); CRASH fails the round.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

from specdecode.core.engine import RowFailed, RowUpdate

EOS = 256


class Encoding:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = ids


class ByteTokenizer:
    eos_token_id = EOS
    chat_template = "role-tagged"

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(list(text.encode()))

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None) -> str:
        kept = bytes(t for t in ids if t < 256)
        text = kept.decode("utf-8", errors="replace")
        return text if skip_special_tokens or EOS not in ids else text + "<eos>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        text = "".join(f"[{m['role']}]{m['content']}\n" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")


@dataclass
class FakeRow:
    request: object
    produced: int = 0
    rounds: int = 0


@dataclass
class FakeLoop:
    max_rows: int
    step_delay: float = 0.0
    rows: dict[int, FakeRow] = field(default_factory=dict)
    cancelled: list[int] = field(default_factory=list)
    resets: int = 0
    next_key: int = 0
    thread: threading.Thread | None = None

    def _same_thread(self) -> None:
        current = threading.current_thread()
        if self.thread is None:
            self.thread = current
        assert current is self.thread, "the loop is used from two threads"

    def add(self, request) -> int:
        self._same_thread()
        assert len(self.rows) < self.max_rows, "more rows added than max_rows"
        key = self.next_key
        self.next_key += 1
        self.rows[key] = FakeRow(request)
        return key

    def cancel(self, key: int) -> None:
        self._same_thread()
        del self.rows[key]
        self.cancelled.append(key)

    def reset(self) -> None:
        self._same_thread()
        self.rows.clear()
        self.resets += 1

    def __len__(self) -> int:
        return len(self.rows)

    def step(self) -> list[RowUpdate]:
        self._same_thread()
        if self.step_delay:
            time.sleep(self.step_delay)
        prompts = {k: bytes(t for t in r.request.prompt if t < 256) for k, r in self.rows.items()}
        # failures come before any row's tokens, so a failed round commits nothing
        if any(b"CRASH" in p for p in prompts.values()):
            raise RuntimeError("the fake engine crashed")
        for key, prompt in prompts.items():
            if b"FAIL" in prompt and self.rows[key].rounds >= 1:
                del self.rows[key]
                raise RowFailed({key: RuntimeError("the fake engine could not decode this row")})
        updates = []
        for key, row in list(self.rows.items()):
            prompt = prompts[key]
            row.rounds += 1
            if row.rounds == 1:  # the prompt's prefill
                updates.append(RowUpdate(key, [], False, 0, 0, 0))
                continue
            want = 1 + (row.rounds + key) % 3
            tokens: list[int] = []
            finished = False
            while len(tokens) < want:
                byte = prompt[row.produced % len(prompt)]
                row.produced += 1
                tokens.append(EOS if byte == ord("#") else byte)
                ends = tokens[-1] in row.request.stop_token_ids
                if ends or row.produced >= row.request.max_new_tokens:
                    finished = True
                    break
            if finished:
                del self.rows[key]
            drafted = 3 if row.rounds % 2 else 0  # every other round a plain step
            accepted = min(drafted, len(tokens) - 1)
            updates.append(RowUpdate(key, tokens, finished, drafted, accepted, 0))
        return updates


class FakeDecoder:
    vocab_size = 258
    context = 512

    def __init__(self, step_delay: float = 0.0) -> None:
        self.tokenizer = ByteTokenizer()
        self.step_delay = step_delay
        self.loops: list[FakeLoop] = []

    def default_stop_ids(self) -> tuple[int, ...]:
        return (EOS,)

    def settle(self) -> None:
        """What the server calls once loaded, before it answers; counted."""
        self.settled = getattr(self, "settled", 0) + 1

    def store_outcomes(self) -> None:
        """What the scheduler calls between rounds; counted, so a test can see when."""
        self.stores = getattr(self, "stores", 0) + 1

    def loop(self, max_rows: int = 8, prefill_chunk: int = 256, **drafting) -> FakeLoop:
        loop = FakeLoop(max_rows, self.step_delay)
        self.loops.append(loop)
        return loop


def expected_text(prompt: str, max_tokens: int) -> tuple[str, str]:
    """What a row of the fake engine returns for `prompt` alone: (text, finish_reason)."""
    data = prompt.encode()
    out = bytearray()
    for i in range(max_tokens):
        byte = data[i % len(data)]
        if byte == ord("#"):
            return out.decode("utf-8", errors="replace"), "stop"
        out.append(byte)
    return out.decode("utf-8", errors="replace"), "length"


# ---------------------------------------------------------------- the app, served in a thread

MODEL = "fake"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """The app under uvicorn in a thread, over a fake decoder (the serve extra needed)."""

    def __init__(
        self,
        decoder=None,
        load=None,
        api_key=None,
        max_batch=4,
        max_queue=64,
        context=None,
        max_body_bytes=4 << 20,
    ) -> None:
        import uvicorn

        from specdecode.serve.app import ServerState, create_app
        from specdecode.serve.metrics import ServerMetrics
        from specdecode.serve.scheduler import Scheduler

        self.decoder = decoder or FakeDecoder(step_delay=0.002)
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(
            load or (lambda: self.decoder), self.metrics, max_batch, max_queue
        )
        self.api_key = api_key
        self.state = ServerState(
            self.scheduler, self.metrics, MODEL, api_key, context, max_body_bytes=max_body_bytes
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(self.state), port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Live:
        self.scheduler.start()
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.scheduler.stop()

    @property
    def loop(self):
        return self.decoder.loops[-1]

    def client(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw
        )

    def post(self, path: str, body, **kw):
        import httpx

        content = json.dumps(body) if isinstance(body, dict | list) else body
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=30, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        import httpx

        key = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=key).text
        for line in text.splitlines():
            if line.startswith(f"specdecode:{name}{labels} ") or (
                not labels and line.startswith(f"specdecode:{name} ")
            ):
                return float(line.split()[-1])
        return 0.0
