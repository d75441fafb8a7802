"""`python tests/serve_fake_worker.py PORT [STEP_DELAY]`: the real server process (signals,
drain, exit code) over the fake engine, for the SIGTERM test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve_fake import FakeDecoder

from specdecode.serve.server import ServeConfig, serve

if __name__ == "__main__":
    port, delay = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
    config = ServeConfig(model_name="fake", port=port, drain_seconds=20, log_level="warning")
    sys.exit(serve(lambda: FakeDecoder(step_delay=delay), config))
