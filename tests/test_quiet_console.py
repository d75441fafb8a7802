"""A run prints its text and its statistics, and no warning: not a Python warning (a deprecated
argument of a dependency, say), not a library's logged one, not the source line a warning quotes.

`specdecode generate` runs on the tiny saved pair (the warnings came from the engine's calls into
transformers, the same for any model); `specdecode translate` on the shipped Bible pair.
"""

from __future__ import annotations

import logging
import warnings

import pytest
from transformers.utils import logging as hf_logging

from specdecode.backends.torch_eager import CachedModel
from specdecode.cli.main import main
from specdecode.pricebook import pass_seconds


class Recorder(logging.Handler):
    """Keeps every record a library logs. transformers' own handler writes to the `sys.stderr`
    of the moment it was made, which under pytest is not the descriptor `capfd` reads."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_quietly(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Run the CLI with every warning recorded (none filtered away, none deduplicated), every
    warning transformers logs recorded, and the process's stdout and stderr captured at the
    file descriptors; returns (stdout, stderr)."""
    hf_logging.warning_once.cache_clear()  # a message logged once earlier in the session counts
    capfd.readouterr()
    logged = Recorder()
    library = logging.getLogger("transformers")  # the root of transformers' loggers
    library.addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(argv)
    finally:
        library.removeHandler(logged)
    out, err = capfd.readouterr()
    assert code == 0, err
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert [f"{r.name}: {r.getMessage()}" for r in logged.records] == []
    lines = [line for line in err.splitlines() if "Warning" in line or "deprecat" in line]
    assert lines == [], err
    assert "output = func(self" not in err and "forward_call(" not in err
    return out, err


def test_generate_prints_no_warning(tiny_pair, capfd) -> None:
    target, _, _ = tiny_pair
    args = ["generate", "--target", str(target), "--draft", "prompt-lookup"]
    _, err = run_quietly([*args, "--prompt", "t5 t6 t7 t5 t6", "--max-new-tokens", "8"], capfd)
    assert "[stats]" in err


def test_generate_with_a_drafter_model_prints_no_warning(tiny_pair, capfd) -> None:
    target, draft, _ = tiny_pair
    args = ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "t5 t6 t7"]
    # the default drafting (auto), its pass prices timed, then a constant k: the model drafts
    _, err = run_quietly([*args, "--max-new-tokens", "8"], capfd)
    assert "[stats]" in err
    constant = ["--drafting", "model", "--length-policy", "constant", "--num-draft-tokens", "3"]
    _, err = run_quietly([*args, *constant, "--max-new-tokens", "8"], capfd)
    assert "drafter calls 0" not in err


def test_round_timing_warns_nothing(tiny_llama) -> None:
    """The pass timer calls the model through its backend (`core.prices`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = CachedModel(tiny_llama(seed=0))
        (seconds,) = pass_seconds([(backend, [1, 3])], list(range(5, 30)), reps=2, rows=2)
    assert set(seconds) == {1, 3}
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def test_translate_prints_no_warning(capfd) -> None:
    out, _ = run_quietly(["translate", "Y dijo Dios: Sea la luz."], capfd)
    assert "God" in out


def test_bench_with_transformers_assisted_generation_prints_no_warning(
    tiny_pair, tmp_path, capfd
) -> None:
    """`bench` runs transformers' own loops beside the engine: plain `generate` and assisted
    generation with the drafter, whose candidate generator calls `generate` on the drafter."""
    target, draft, prompts = tiny_pair
    args = ["bench", "--backend", "torch", "--target", str(target), "--draft", str(draft)]
    args += ["--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "8", "--quiet"]
    args += ["--methods", "ar", "hf", "hf-assisted", "hf-assisted-k", "hf-lookup", "sd"]
    out, _ = run_quietly([*args, "--out", str(tmp_path), "--no-plots"], capfd)
    assert "| hf-assisted |" in out and "| hf-assisted-k[k=4] |" in out
