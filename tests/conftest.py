"""Tiny randomly initialised models and tokenizers, built from configs, fp32, CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96


def make_fake_dist(root: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal installed distribution: ``<name>-<version>.dist-info`` plus its data files."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = [f"{rel},," for rel in files] + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return info


def llama_like(vocab: int, layers: int) -> dict:
    """Sizes shared by the Llama-style tiny configs (Llama, Qwen2)."""
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = VOCAB, init: float = 0.02, **kw):
    torch.manual_seed(seed)
    config = LlamaConfig(**llama_like(vocab, layers), initializer_range=init, **kw)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0, layers: int = 2, vocab: int = VOCAB, init: float = 0.02):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=256,
        initializer_range=init,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_qwen2(seed: int = 0, layers: int = 2, vocab: int = VOCAB):
    torch.manual_seed(seed)
    config = Qwen2Config(**llama_like(vocab, layers))
    return Qwen2ForCausalLM(config).eval()


ARCHITECTURES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": tiny_qwen2}


def word_tokenizer(vocab: int = VOCAB, prefix: str = "t") -> PreTrainedTokenizerFast:
    """Whitespace tokenizer over the words t0 .. t{vocab-1}; t0 is EOS and padding."""
    words = {f"{prefix}{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token=f"{prefix}1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=f"{prefix}0",
        pad_token=f"{prefix}0",
        unk_token=f"{prefix}1",
    )
    tok.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"
    return tok


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Saved tiny target and drafter directories (EOS t0) and a 4-prompt .jsonl file."""
    import json

    root = tmp_path_factory.mktemp("models")
    paths = []
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        model = tiny_llama(seed, layers=layers)
        model.generation_config.eos_token_id = 0
        model.save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
        paths.append(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"t{i} t{i + 1} t{i + 2}"}) + "\n" for i in range(5, 9))
    )
    return paths[0], paths[1], prompts
