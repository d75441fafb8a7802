"""The GGUF tokenizer read with `tokenizers` alone (`SavedTokenizer`) against `transformers`'
tokenizer of the same saved folder: the same ids, text, special tokens, vocabulary and chat
rendering, so the llama.cpp backend decodes the same tokens whichever of the two it was given."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specdecode.models.tokenizer import SavedTokenizer, render_chat, saved_tokenizer

TEXTS = [
    "def f(x):",
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "naïve café 日本語 🙂 \u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>after an end",
    "x = [1, 2 ,3] ; y = {'a':1}  # comment",
]


def corpus() -> list[str]:
    """The texts above and pieces of this repository's source, cut at random places."""
    source = Path(__file__).read_text()
    rng = random.Random(0)
    cuts = [rng.randrange(len(source)) for _ in range(60)]
    return TEXTS + [source[i : i + rng.randrange(1, 200)] for i in cuts]


@pytest.fixture(scope="module")
def smol_pair():
    """SmolLM2's GGUF tokenizer both ways (real weights' package, as the llama.cpp tests)."""
    pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from specdecode.models.store import gguf_file
    from specdecode.models.tokenizer import gguf_tokenizer

    light = gguf_tokenizer(gguf_file("smollm2-135m", progress=False))
    full = AutoTokenizer.from_pretrained(light.name_or_path, local_files_only=True)
    return light, full


@pytest.mark.slow
def test_gguf_tokenizer_reads_tokenizers_alone_and_agrees(smol_pair):
    light, full = smol_pair
    assert isinstance(light, SavedTokenizer)
    for text in corpus():
        for special in (True, False):
            ids = full(text, add_special_tokens=special).input_ids
            assert light(text, add_special_tokens=special).input_ids == ids, text
        ids = full(text).input_ids + [full.eos_token_id, full.pad_token_id or 0]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip
            ), text
            assert light.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            ) == full.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert light(TEXTS[:3])["input_ids"] == full(TEXTS[:3])["input_ids"]
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(light, name) == getattr(full, name), name
    assert len(light) == len(full) and light.get_vocab() == full.get_vocab()
    assert light.chat_template == full.chat_template


@pytest.mark.slow
def test_chat_rendering_and_other_reads_come_from_transformers(smol_pair):
    light, full = smol_pair
    if not full.chat_template:
        pytest.skip("this tokenizer has no chat template")
    for text in ("hi", "", "<|im_end|> inside a turn"):
        assert render_chat(light, text) == render_chat(full, text)
    assert light.all_special_ids == full.all_special_ids  # not its own: read from transformers


def test_a_tokenizer_that_is_not_bpe_loads_with_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path)
    assert SavedTokenizer.read(tmp_path) is None
    tokenizer = saved_tokenizer(tmp_path)
    assert not isinstance(tokenizer, SavedTokenizer)
    assert tokenizer("a b c").input_ids == [1, 2, 0]


def test_a_bpe_tokenizer_reads_its_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    bpe.add_special_tokens(["<end>"])
    saved = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<end>", pad_token="<end>")
    saved.save_pretrained(tmp_path)
    light = saved_tokenizer(tmp_path)
    assert isinstance(light, SavedTokenizer)
    assert light.eos_token_id == light.pad_token_id == 3 and light.bos_token_id is None
    assert light("abba").input_ids == saved("abba").input_ids == [2, 1, 0]
    assert light.decode([2, 3], skip_special_tokens=True) == saved.decode(
        [2, 3], skip_special_tokens=True
    )
    assert light.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(light, "hi")
