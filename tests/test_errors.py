"""Bad input gets an error that names what is wrong, before any decoding."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MistralConfig, MistralForCausalLM

from specdecode import DecodeConfig, SamplingConfig, SpeculativeDecoder
from specdecode.backends.torch_eager import UnsupportedModelError
from specdecode.core.checks import IncompatibleModelsError
from specdecode.core.sampling import InvalidLogitsError, bad_rows


@pytest.fixture(scope="module")
def decoder(tiny_llama, word_tokenizer):
    return SpeculativeDecoder(tiny_llama(0), word_tokenizer(), drafter=tiny_llama(1, layers=1))


def test_different_tokenizers_refused(tiny_llama, word_tokenizer):
    with pytest.raises(IncompatibleModelsError, match="tokenizers differ"):
        SpeculativeDecoder(
            tiny_llama(0), word_tokenizer(), tiny_llama(1), word_tokenizer(prefix="w")
        )


def test_same_size_different_vocabulary_refused(tiny_llama, word_tokenizer):
    other = word_tokenizer()
    other.add_tokens(["extra"])  # same embedding size would not reveal this
    with pytest.raises(IncompatibleModelsError, match="only in the drafter"):
        SpeculativeDecoder(
            tiny_llama(0, vocab=100), word_tokenizer(), tiny_llama(1, vocab=100), other
        )


def test_drafter_on_another_device_refused(tiny_llama):
    with torch.device("meta"):
        drafter = tiny_llama(1)
    with pytest.raises(IncompatibleModelsError, match="target is on cpu but drafter is on meta"):
        SpeculativeDecoder(tiny_llama(0), drafter=drafter)


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([[]], "prompt 0 is empty"),
        ([""], "prompt 0 is empty"),
        ([[1] * 300], "longer than the target's context of 256"),
        ([[1] * 250], "exceeds the target's context"),
        ([], "no prompts"),
    ],
)
def test_bad_prompts(decoder, prompts, match):
    with pytest.raises(ValueError, match=match):
        decoder.generate(prompts, max_new_tokens=10)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens must be >= 1"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"row_seeds": [1, 2]}, "row_seeds has 2 seeds for 1 prompts"),
        ({"length_policy": "adaptive"}, "unknown length policy 'adaptive'"),
        ({"drafting": "model", "bound": (1, 4)}, r"bound \(MIN, MAX\) applies to the adaptive"),
        ({"length_policy": "heuristic", "bound": (3, 2)}, "1 <= MIN <= MAX, got 3 2"),
        ({"length_policy": "confidence", "stop_threshold": 1.0}, r"stop_threshold must be in"),
        ({"max_draft_batch": 0}, r"max_draft_batch must be an integer >= 1 \(None: always"),
        ({"max_draft_batch": 2.5}, "max_draft_batch must be an integer >= 1"),
    ],
)
def test_bad_settings(decoder, kwargs, match):
    kwargs.setdefault("temperature", 0.7)
    with pytest.raises(ValueError, match=match):
        decoder.generate([[1, 2, 3]], **kwargs)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([0.0, -2.5, 7.0, float("nan"), float("inf"), float("-inf")]),
                 min_size=3, max_size=3),
        min_size=1, max_size=4,
    )
)  # fmt: skip
def test_bad_rows_matches_its_definition(rows):
    """The one-reduction check flags exactly NaN, +inf, or a position with every logit -inf,
    per row."""
    logits = torch.tensor(rows)  # [positions, vocab]
    each = [
        any(v != v or v == float("inf") for v in row) or all(v == float("-inf") for v in row)
        for row in rows
    ]
    expected = any(each)
    assert bad_rows(logits).tolist() == each  # a row a position
    assert bool(bad_rows(logits).any()) == expected
    assert bool(bad_rows(logits[None]).any()) == expected  # one row of every position


@pytest.mark.parametrize("poison", ["target", "drafter"])
def test_nan_logits_refused(poison, tiny_llama):
    target, drafter = tiny_llama(0), tiny_llama(1, layers=1)
    with torch.no_grad():
        (target if poison == "target" else drafter).model.norm.weight.fill_(float("nan"))
    decoder = SpeculativeDecoder(target, drafter=drafter)
    with pytest.raises(InvalidLogitsError, match="NaN"):
        decoder.generate([[1, 2, 3]], max_new_tokens=4, drafting="model")


def test_sliding_window_model_refused():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    with pytest.raises(UnsupportedModelError, match="cannot be rolled back"):
        SpeculativeDecoder(MistralForCausalLM(config))


def test_encoder_decoder_refused_by_causal_engine():
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
    )
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        SpeculativeDecoder(BartForConditionalGeneration(config))


def test_config_objects_validate_once():
    with pytest.raises(ValueError, match="stop_token_ids"):
        DecodeConfig(stop_token_ids=(-1,))
    assert SamplingConfig().greedy and not SamplingConfig(temperature=1.0).greedy


def test_text_prompts_and_chat_template(decoder):
    out = decoder.generate(["t5 t6 t7"], max_new_tokens=3)
    assert out.sequences[0][:3] == [5, 6, 7] and isinstance(out.texts[0], str)
    assert decoder.encode(["t5"], chat=True) == [[2, 5, 3]]
    with pytest.raises(ValueError, match="mix of text and token-id prompts"):
        decoder.encode(["t5", [5]])


# --------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def cli_inputs(tiny_pair, tmp_path_factory, tiny_llama, word_tokenizer):
    """The tiny pair's folders, a drafter with another vocabulary and bad prompt files."""
    target, draft, _ = tiny_pair
    root = tmp_path_factory.mktemp("cli_inputs")
    tiny_llama(1, layers=1).save_pretrained(root / "other")
    word_tokenizer(prefix="w").save_pretrained(root / "other")
    (root / "bad.jsonl").write_text('{"prompt": "t5 t6"}\n{oops\n')
    (root / "empty.jsonl").write_text("")
    (root / "utf16.jsonl").write_bytes('{"prompt": "t5"}\n'.encode("utf-16"))
    (root / "one.jsonl").write_text('{"prompt": "t5 t6"}\n')
    return {"target": str(target), "draft": str(draft), "root": root}


PROMPT = ["--prompt", "t5 t6 t7"]
SAMPLED = ["--temperature", "0.7"]

# each bad input of the report: the arguments after the tiny pair, and what the error must say
BAD_INPUTS = {
    "unknown-model": (["--target", "gpt-17-ultra", *PROMPT], "'gpt-17-ultra' is neither a known"),
    "drafter-other-vocabulary": (["--draft", "{root}/other", *PROMPT], "tokenizers differ"),
    "empty-prompt": (["--prompt", ""], "prompt 0 is empty"),
    "bad-json-line": (["--prompts", "{root}/bad.jsonl"], r"bad\.jsonl, line 2: not valid JSON"),
    "empty-prompts-file": (["--prompts", "{root}/empty.jsonl"], r"empty\.jsonl: no prompts in"),
    "prompts-not-utf8": (
        ["--prompts", "{root}/utf16.jsonl"],
        r"utf16\.jsonl, line 1: not UTF-8 text \(byte 0xff at column 1\)",
    ),
    "max-new-tokens-0": ([*PROMPT, "--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    "max-new-tokens--1": ([*PROMPT, "--max-new-tokens", "-1"], "max_new_tokens must be >= 1"),
    "temperature--1": ([*PROMPT, "--temperature", "-1"], "temperature must be a finite number"),
    "top-p-2": ([*PROMPT, *SAMPLED, "--top-p", "2"], r"top_p must be in \(0, 1\], got 2.0"),
    "top-k--5": ([*PROMPT, *SAMPLED, "--top-k", "-5"], "top_k must be an integer >= 0"),
    "k-0": ([*PROMPT, "--num-draft-tokens", "0"], "num_draft_tokens must be >= 1, got 0"),
    "batch-size-0": ([*PROMPT, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "prompt-longer-than-context": (
        ["--prompt", " ".join(["t5"] * 300)],
        "prompt 0 has 300 tokens, longer than the target's context of 256",
    ),
    "missing-head": (
        [*PROMPT, "--length-policy", "head", "--head", "{root}/no-head"],
        "no acceptance head at",
    ),
    "bound-5-2": (
        [*PROMPT, "--length-policy", "heuristic", "--bound", "5", "2"],
        r"1 <= MIN <= MAX, got 5 2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_cli_bad_input_is_one_named_error_exit_2(cli_inputs, capsys, case):
    from specdecode.cli.main import main

    extra, match = BAD_INPUTS[case]
    extra = [a.format(root=cli_inputs["root"]) for a in extra]
    argv = ["generate", "--target", cli_inputs["target"], "--draft", cli_inputs["draft"]]
    argv += ["--no-prepack", "--max-new-tokens", "4", *extra]  # no kernel timing: seconds
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]  # above it, at most the loading progress bars
    assert last.startswith("specdecode generate: error: ")
    assert re.search(match, last), last
    assert "Traceback" not in captured.err and captured.out == ""


def test_cli_prompt_slice_left_empty_is_an_error(cli_inputs, capsys):
    from specdecode.cli.main import main

    argv = ["generate", "--target", cli_inputs["target"], "--draft", cli_inputs["draft"]]
    argv += ["--no-prepack", "--prompts", str(cli_inputs["root"] / "one.jsonl"), "--limit", "0"]
    assert main(argv) == 2


# --------------------------------------------------------------- checked before any model loads


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every way a command reads weights fails the test: a setting that gets past its check
    to a model load is caught, whatever the time it would have taken."""
    from specdecode.api import SpeculativeDecoder as Decoder
    from specdecode.backends import llamacpp
    from specdecode.models import store

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad setting was refused")

    monkeypatch.setattr(Decoder, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(store, "load_causal_lm", refuse)
    monkeypatch.setattr(llamacpp.LlamaCppModel, "__init__", refuse)


# each bad setting of `generate` on the tiny pair: the arguments and what the error must say;
# all but the last group need no model at all, the last the tokenizer and context only
EARLY_BAD_INPUTS = {
    "temperature-nan": (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    "temperature--1": (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    "top-p-0": ([*SAMPLED, "--top-p", "0"], r"top_p must be in \(0, 1\], got 0.0"),
    "top-p-1.5": ([*SAMPLED, "--top-p", "1.5"], r"top_p must be in \(0, 1\], got 1.5"),
    "top-k--1": ([*SAMPLED, "--top-k", "-1"], r"top_k must be an integer >= 0"),
    "max-new-tokens-0": (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    "batch-size-0": (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "bound-3-2": (["--length-policy", "heuristic", "--bound", "3", "2"], "1 <= MIN <= MAX"),
    "bound-with-constant": (
        ["--drafting", "model", "--length-policy", "constant", "--bound", "1", "4"],
        "adaptive",
    ),
    "k-0": (["--num-draft-tokens", "0"], "num_draft_tokens must be >= 1"),
    "threshold-1": (["--length-policy", "head", "--stop-threshold", "1"], "stop_threshold"),
    "threads-0": (["--threads", "0"], "--threads must be >= 1"),
    "seed-too-large": (["--seed", str(2**64)], "--seed must be a 64-bit integer"),
    "coupled-greedy": (["--coupled"], "coupled randomness pairs sampled text"),
    "priced-not-head": (["--priced"], "--priced prices the head policies' rounds"),
    "lookup-first-no-model": (["--no-draft", "--lookup-first"], "lookup-first looks up"),
    "compile-not-static": (["--compile"], "--compile is an option of the torch-static"),
    "head-on-llama": (["--backend", "llama.cpp", "--length-policy", "head"], "PyTorch backends"),
    "llama-dtype": (["--backend", "llama.cpp", "--dtype", "float16"], "options of the torch"),
    "missing-head": (["--length-policy", "head", "--head", "{root}/no-head"], "no acceptance head"),
    "missing-corpus": (["--corpus", "{root}/no-corpus"], "no corpus .*no-corpus"),
    "corpus-not-auto": (["--drafting", "model", "--corpus", "stdlib"], "--corpus drafts under"),
    "empty-prompt": (["--prompt", ""], "prompt 0 is empty"),
    "missing-prompt-file": (["--prompts", "{root}/missing.jsonl"], "nor an existing .jsonl"),
    "empty-prompt-file": (["--prompts", "{root}/empty.jsonl"], r"empty\.jsonl: no prompts in"),
    "limit-0": (["--prompts", "{root}/one.jsonl", "--limit", "0"], "--limit takes the first N"),
    # past the tokenizer, before the weights
    "max-new-tokens-100000": (["--max-new-tokens", "100000"], "exceeds the target's context of"),
    "prompt-over-context": (["--prompt", " ".join(["t5"] * 300)], "longer than the target's"),
}


@pytest.mark.parametrize("case", sorted(EARLY_BAD_INPUTS))
def test_cli_bad_setting_refused_before_any_model_loads(cli_inputs, capsys, no_model_loads, case):
    from specdecode.cli.main import main

    extra, match = EARLY_BAD_INPUTS[case]
    extra = [a.format(root=cli_inputs["root"]) for a in extra]
    if "--prompt" not in extra and "--prompts" not in extra:
        extra = [*PROMPT, *extra]
    argv = ["generate", "--target", cli_inputs["target"], "--draft", cli_inputs["draft"], *extra]
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("specdecode generate: error: ")
    assert re.search(match, last), last
    assert "Traceback" not in captured.err and captured.out == ""


def test_cli_context_read_from_the_gguf_before_its_weights(
    tmp_path, capsys, monkeypatch, no_model_loads, word_tokenizer
):
    """On llama.cpp the context comes from the GGUF's metadata and the tokenizer from its
    cached copy: a prompt and budget that cannot fit fail with no llama.cpp model built."""
    gguf = pytest.importorskip("gguf")
    from specdecode.cli.main import main
    from specdecode.models import tokenizer as tokenizers

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(500)])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_context_length(128)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    monkeypatch.setattr(tokenizers, "gguf_tokenizer", lambda p: word_tokenizer())
    argv = ["generate", "--target", str(path), "--draft", "prompt-lookup", *PROMPT]
    assert main([*argv, "--max-new-tokens", "126"]) == 2
    err = capsys.readouterr().err
    assert "3 tokens and max_new_tokens is 126: 129 exceeds the target's context of 128" in err


def _write_gguf(path, gguf, context: int | None, arch: str = "qwen2") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_array("tokenizer.ggml.merges", ["a b", "c d"] * 100)
    writer.add_uint32("some.count", 7)
    if context is not None:
        writer.add_context_length(context)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize("trained,expected", [(128, 128), (32768, 4096), (None, 4096)])
def test_gguf_context_from_metadata_alone(tmp_path, trained, expected):
    """What `LlamaCppModel` will allow per row: the trained context, capped at the backend's
    default, read past strings and arrays of other keys (written by the gguf package)."""
    gguf = pytest.importorskip("gguf")
    from specdecode.backends.llamacpp import DEFAULT_CONTEXT, gguf_context
    from specdecode.backends.llamacpp_lib import LlamaCppLoadError

    path = tmp_path / "m.gguf"
    _write_gguf(path, gguf, trained)
    assert DEFAULT_CONTEXT == 4096
    assert gguf_context(path) == expected
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(LlamaCppLoadError, match="not a GGUF file"):
        gguf_context(tmp_path / "not.gguf")


BENCH_BAD_INPUTS = {
    "temperature-nan": (["--temperature", "nan"], "temperature must be a finite number"),
    "batch-sizes-0": (["--batch-sizes", "1", "0"], "--batch-sizes must all be >= 1"),
    "limit-0": (["--limit", "0"], "--limit takes the first N >= 1"),
    "repeats-0": (["--repeats", "0"], "--repeats must be >= 1"),
    "k-0": (["--num-draft-tokens", "4", "0"], "num_draft_tokens must be >= 1, got 0"),
    "bound-5-2": (["--length-policy", "heuristic", "--bound", "1", "4", "5", "2"], "got 5 2"),
    "odd-bound": (["--length-policy", "heuristic", "--bound", "1", "4", "5"], "MIN MAX pairs"),
    "head-u-greedy": (["--length-policy", "head-u"], "only sampling draws"),
    "confidence-1.5": (["--confidence-threshold", "1.5"], r"must be in \(0, 1\), got 1.5"),
    "max-new-tokens-0": (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
}


@pytest.mark.parametrize("case", sorted(BENCH_BAD_INPUTS))
def test_cli_bench_bad_setting_refused_before_any_model_loads(
    cli_inputs, capsys, no_model_loads, case
):
    from specdecode.cli.main import main

    extra, match = BENCH_BAD_INPUTS[case]
    argv = ["bench", "--target", cli_inputs["target"], "--draft", cli_inputs["draft"]]
    argv += ["--prompts", str(cli_inputs["root"] / "one.jsonl"), *extra]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("specdecode bench: error: ") and re.search(match, last), last


def test_cli_refuses_a_bad_setting_without_importing_torch():
    """The checks that need no model run before anything imports torch or transformers (in a
    fresh process: this one has imported both)."""
    import subprocess
    import sys

    code = (
        "import sys; from specdecode.cli.main import main; "
        "rc = main(['generate', '--prompt', 'x', '--temperature', 'nan']); "
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["2", "False", "False"], run.stderr
    assert "temperature must be a finite number" in run.stderr


def test_cli_light_copies_agree_with_their_sources():
    """The command line lists draft precisions and picks the default backend without importing
    torch; these are the kernels' and the API's own."""
    from specdecode import loading
    from specdecode.cli import common

    assert common.DRAFT_PRECISIONS == loading.DRAFT_PRECISIONS
    for target in ("qwen2.5-coder-1.5b", "./m.gguf", "./model-dir"):
        for device in ("cpu", "cuda"):
            assert common.decoding_backend(target, device, None) == loading.default_backend(
                target, device
            )
    assert common.decoding_backend("qwen2.5-coder-1.5b", "cpu", "torch") == "torch"
