"""The server's incremental detokenizer (`serve/text.py`) against decoding the whole row: the
same text for random token sequences fed in random rounds, stop strings cut at the same place
after the same number of tokens, and a round's decoding bounded whatever the answer's length.

Tokenizers: the fake byte tokenizer of the server tests, a tiny byte-level BPE and a tiny
SentencePiece-style one with byte fallback (both built with `tokenizers`), and Qwen2.5-Coder's
where the model store holds it (read offline from its saved folder, well under a second).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_fake import EOS, ByteTokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.serve.text import MAX_UNSETTLED_TOKENS, RowText

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TEXTS = ["héllo wörld 日本語 😀 emoji €uro", "def f(x):\n    return x  # ñ", "naïve café ÿ ǅ 🙂"]


def full_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def streamed(tokenizer, ids: list[int], rounds: list[int], stops=()) -> RowText:
    """`ids` fed to a `RowText` a round at a time (round sizes cycled from `rounds`), the last
    round final."""
    row = RowText(tokenizer, stops)
    i = 0
    for size in rounds * (len(ids) + 1):
        if i >= len(ids) or row.stopped:
            break
        row.feed(ids[i : i + size], final=i + size >= len(ids))
        i += size
    if not ids:
        row.feed([], final=True)
    return row


def byte_level() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE trained on a few lines: merges within and across characters."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama's decoding: `▁` for spaces, bytes as <0xNN> tokens fused into characters, the
    first leading space stripped (so a token's text depends on what precedes it)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "é", "▁é", "日本", "▁▁", "x▁"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5-Coder's tokenizer from the model store, and the ids of its tokens that are not
    whole characters alone (a random sequence rarely holds them otherwise)."""
    from specdecode.models.cache import ModelCache
    from specdecode.models.tokenizer import SavedTokenizer

    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        directory = ModelCache.of(name).directory
        for folder in (directory / "model.tokenizer", directory):
            tokenizer = SavedTokenizer.read(folder)
            if tokenizer is not None:
                words = len(tokenizer.get_vocab())
                broken = [i for i in range(words) if "\ufffd" in tokenizer.decode([i])]
                return tokenizer, words, broken
    pytest.skip("no Qwen2.5-Coder tokenizer in the model store")


rounds = st.lists(st.integers(1, 6), min_size=1, max_size=8)


@SETTINGS
@given(ids=st.lists(st.integers(0, EOS), max_size=80), rounds=rounds)
def test_bytes_stream_to_the_whole_decode(ids, rounds):
    tokenizer = ByteTokenizer()
    assert streamed(tokenizer, ids, rounds).emitted == full_text(tokenizer, ids)


@SETTINGS
@given(data=st.data(), rounds=rounds)
def test_a_byte_level_bpe_streams_to_the_whole_decode(data, rounds):
    tokenizer = byte_level()
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=80))
    assert streamed(tokenizer, ids, rounds).emitted == full_text(tokenizer, ids)


@SETTINGS
@given(
    text=st.text(st.sampled_from("ab é日本😀x \n€"), max_size=30),
    specials=st.lists(st.tuples(st.integers(0, 60), st.sampled_from([1, 2])), max_size=3),
    rounds=rounds,
)
def test_sentencepiece_style_streams_to_the_whole_decode(text, specials, rounds):
    """Token sequences a model could write (bytes fused into whole characters; with broken
    ones the byte fallback rewrites earlier characters, which no stream can take back)."""
    tokenizer = sentencepiece_style()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    for at, special in specials:
        ids.insert(min(at, len(ids)), special)
    assert streamed(tokenizer, ids, rounds).emitted == full_text(tokenizer, ids)


@SETTINGS
@given(data=st.data(), rounds=rounds)
def test_qwen_streams_to_the_whole_decode(qwen, data, rounds):
    tokenizer, words, broken = qwen
    token = st.sampled_from(broken) | st.integers(0, words - 1)
    ids = data.draw(st.lists(token, max_size=100))
    assert streamed(tokenizer, ids, rounds).emitted == full_text(tokenizer, ids)


@SETTINGS
@given(data=st.data(), rounds=rounds)
def test_stop_strings_cut_where_the_whole_decode_would(qwen, data, rounds):
    """The text ends right before the first stop string of the whole decode, and the tokens
    used are the fewest whose text holds one."""
    tokenizer, words, broken = qwen
    text = data.draw(st.sampled_from(TEXTS)) + data.draw(st.text(max_size=20))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    ids += data.draw(st.lists(st.sampled_from(broken) | st.integers(0, words - 1), max_size=10))
    whole = full_text(tokenizer, ids)
    start = data.draw(st.integers(0, max(0, len(whole) - 1)))
    stop = whole[start : start + data.draw(st.integers(1, 5))]
    if not stop or "\ufffd" in stop:
        return
    row = streamed(tokenizer, ids, rounds, stops=(stop, "never said"))
    assert row.stopped and row.emitted == whole[: whole.find(stop)]
    assert row.tokens_used == next(
        n for n in range(1, len(ids) + 1) if stop in full_text(tokenizer, ids[:n])
    )


class Counting(ByteTokenizer):
    """The fake tokenizer, recording how many tokens each decode was given."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None) -> str:
        self.sizes.append(len(ids))
        return super().decode(ids, skip_special_tokens, clean_up_tokenization_spaces)


def test_a_round_decodes_a_bounded_window_whatever_the_answer_length():
    """4,000 tokens of text with multi-byte characters split across rounds: no decode is given
    more than the last two rounds' tokens and a broken character's (the whole row's would be
    4,000 by the end)."""
    tokenizer = Counting()
    ids = list(("".join(TEXTS) * 60).encode())[:4000]
    sizes = [1, 5, 2, 4, 3]
    row = streamed(tokenizer, ids, sizes, stops=("not in it",))
    assert max(tokenizer.sizes) <= 2 * max(sizes) + 3
    assert row.emitted == full_text(tokenizer, ids)


def test_a_row_of_broken_bytes_keeps_the_window_bounded():
    tokenizer = Counting()
    ids = [0x80] * 1000  # continuation bytes that never make a character
    row = streamed(tokenizer, ids, [3])
    assert max(tokenizer.sizes) <= 2 * (MAX_UNSETTLED_TOKENS + 3)
    assert row.emitted == full_text(tokenizer, ids)
