"""`specdecode serve` with the interpreter's switch interval at 0.1 ms (CPython's default: 5 ms),
so a thread waiting for the lock asks for it back after 0.1 ms: the engine thread, waiting after
it wakes the event loop, takes it back sooner. Started beside the plain server and llama-server
for server_ab.txt's last A/B:

    python benchmarks/studies/plain-path/serve_switch.py serve --port 8185 --max-batch 8 \
        --context 2048 --threads 2 --no-draft
"""

import sys

sys.setswitchinterval(1e-4)
from specdecode.cli.main import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
