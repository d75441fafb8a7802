"""`python tests/serve_fake_worker.py PORT [STEP_DELAY [TOKENIZE_DELAY]]`: the real server
process (signals, drain, exit code) over the fake engine, for the SIGTERM tests. A prompt that
begins with "slow" takes TOKENIZE_DELAY seconds to tokenize (a request the drain must wait for
before it is queued), said on stderr as it begins."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve_fake import ByteTokenizer, FakeDecoder

from specdecode.serve.server import ServeConfig, serve


class SlowTokenizer(ByteTokenizer):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, text: str, add_special_tokens: bool = True):
        if text.startswith("slow"):
            print("[fake] tokenizing a slow prompt", file=sys.stderr, flush=True)
            time.sleep(self.delay)
        return super().__call__(text, add_special_tokens)


def load(step_delay: float, tokenize_delay: float) -> FakeDecoder:
    decoder = FakeDecoder(step_delay=step_delay)
    decoder.tokenizer = SlowTokenizer(tokenize_delay)
    return decoder


if __name__ == "__main__":
    port = int(sys.argv[1])
    step, tokenize = (float(a) for a in (sys.argv[2:] + ["0.01", "0"])[:2])
    config = ServeConfig(model_name="fake", port=port, drain_seconds=20, log_level="warning")
    sys.exit(serve(lambda: load(step, tokenize), config))
