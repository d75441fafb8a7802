"""A run prints its text and its statistics, and no warning: not a Python warning (a deprecated
argument of a dependency, say), not a library's logged one, not the source line a warning quotes.

`specdecode generate` runs on the tiny saved pair (the warnings came from the engine's calls into
transformers, the same for any model); `specdecode translate` on the shipped Bible pair.
"""

from __future__ import annotations

import warnings

import pytest
from transformers.utils import logging as hf_logging

from specdecode.backends.torch_eager import CachedModel
from specdecode.cli.main import main
from specdecode.core.prices import pass_seconds


def run_quietly(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Run the CLI with every warning recorded (none filtered away, none deduplicated) and the
    process's stdout and stderr captured at the file descriptors; returns (stdout, stderr)."""
    hf_logging.warning_once.cache_clear()  # a message logged once earlier in the session counts
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)
    out, err = capfd.readouterr()
    assert code == 0, err
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
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
