"""Shared test helpers, all reached as fixtures (a test module imports no other test module).

Tiny randomly initialised models and tokenizers built from configs (fp32, CPU), fake installed
distributions, drafters and acceptance heads built from a target, the sampled-law check (exact
marginals and a chi-square test), the coupled-randomness runs, a synthetic head collection and a
tiny translation corpus: what several modules share. A helper that builds things is a fixture
returning the builder (`tiny_llama(seed=1, layers=1)`).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
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

from specdecode import SpeculativeDecoder
from specdecode.acceptance.head import AcceptanceHead, HeadConfig
from specdecode.core.config import SamplingConfig
from specdecode.core.sampling import logits_to_probs
from specdecode.seq2seq.corpus import Verse

VOCAB = 96


def _make_fake_dist(root: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
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


def _tiny_llama(seed: int = 0, layers: int = 2, vocab: int = VOCAB, init: float = 0.02, **kw):
    torch.manual_seed(seed)
    config = LlamaConfig(**llama_like(vocab, layers), initializer_range=init, **kw)
    return LlamaForCausalLM(config).eval()


def _tiny_gpt2(seed: int = 0, layers: int = 2, vocab: int = VOCAB, init: float = 0.02):
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


def _tiny_qwen2(seed: int = 0, layers: int = 2, vocab: int = VOCAB):
    torch.manual_seed(seed)
    config = Qwen2Config(**llama_like(vocab, layers))
    return Qwen2ForCausalLM(config).eval()


ARCHITECTURES = {"llama": _tiny_llama, "gpt2": _tiny_gpt2, "qwen2": _tiny_qwen2}


def _word_tokenizer(vocab: int = VOCAB, prefix: str = "t") -> PreTrainedTokenizerFast:
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


@pytest.fixture(autouse=True, scope="session")
def _prices_apart(tmp_path_factory):
    """Prices timed by tests (tiny models, a busy machine) stay out of the user's cache."""
    import os

    folder = str(tmp_path_factory.mktemp("prices"))
    before, os.environ["SPECDECODE_PRICES"] = os.environ.get("SPECDECODE_PRICES"), folder
    yield
    if before is None:
        del os.environ["SPECDECODE_PRICES"]
    else:
        os.environ["SPECDECODE_PRICES"] = before


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """Saved tiny target and drafter directories (EOS t0) and a 4-prompt .jsonl file."""
    import json

    root = tmp_path_factory.mktemp("models")
    paths = []
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        model = _tiny_llama(seed, layers=layers)
        model.generation_config.eos_token_id = 0
        model.save_pretrained(root / name)
        _word_tokenizer().save_pretrained(root / name)
        paths.append(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"t{i} t{i + 1} t{i + 2}"}) + "\n" for i in range(5, 9))
    )
    return paths[0], paths[1], prompts


# --------------------------------------------------------------------------------------------
# drafters and acceptance heads built for a target


def _noisy_copy(model: torch.nn.Module, scale: float, seed: int = 7) -> torch.nn.Module:
    """A drafter close to the target: its weights plus a little noise (mixed acceptances)."""
    close = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * scale)
    return close


def _spread_head(hidden_size: int, seed: int = 3, rule: str = "greedy") -> AcceptanceHead:
    """A random head whose predictions spread over (0.5, 1): lengths then vary from row to row.

    It reads the hidden state only: the tests that use it were tuned on its predictions."""
    torch.manual_seed(seed)
    config = HeadConfig(hidden_size=hidden_size, num_layers=2, rule=rule, law_features=False)
    head = AcceptanceHead(config).eval()
    with torch.no_grad():
        head.out.weight.mul_(6.0)
        head.out.bias.fill_(1.5)
    return head


def _numbered_head(hidden_size: int, calibration=(-1.0, 1.0, -3.0)) -> AcceptanceHead:
    """`spread_head` for sampling, calibrated so that its acceptance number weighs heavily: a
    token drawn with u near 1 ends the round, one with a small u rarely does."""
    head = _spread_head(hidden_size, rule="sampling")
    numbered = AcceptanceHead(replace(head.config, number_calibration=calibration)).eval()
    numbered.load_state_dict(head.state_dict())
    return numbered


def _drawn_head(hidden_size: int) -> AcceptanceHead:
    """A sampling head that reads the drawn token's log probability only: a token drawn from
    the law's tail predicts a rejection and ends the round sooner."""
    config = HeadConfig(hidden_size=hidden_size, num_layers=1, rule="sampling", drawn_token=True)
    head = AcceptanceHead(config).eval()
    with torch.no_grad():
        head.law.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 1.5]]))
        head.law.bias.fill_(3.0)
    return head


# --------------------------------------------------------------------------------------------
# the sampled-law check: a small vocabulary, exact marginals, chi-square


@dataclass(frozen=True)
class SampledLaw:
    """The first three generated tokens of many seeded rows against the target's exact law."""

    vocab: int = 12
    prompt: tuple[int, ...] = (3, 7, 1, 9)
    sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(temperature=0.8, top_k=10, top_p=0.95)
    )

    @staticmethod
    def chi2_critical(df: int, z: float = 3.09) -> float:
        """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3

    @staticmethod
    def chi2(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
        expected = law * counts.sum()
        big = expected >= 5  # pool the small cells so the statistic stays chi-square
        obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
        exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
        keep = exp > 0
        stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        return stat, int(keep.sum()) - 1

    def exact_marginals(self, model, prompt=None) -> list[torch.Tensor]:
        """The target's exact laws of the first three generated tokens after `prompt`."""
        vocab = self.vocab
        with torch.no_grad():

            def law(prefixes: torch.Tensor) -> torch.Tensor:
                return logits_to_probs(model(prefixes).logits[:, -1], self.sampling)

            base = torch.tensor([list(self.prompt if prompt is None else prompt)])
            p1 = law(base)[0]  # [vocab]
            one = torch.cat([base.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
            p2 = law(one)  # [t1, vocab]
            two = torch.cat(
                [one.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1
            )
            p3 = law(two).view(vocab, vocab, vocab)  # [t1, t2, vocab]
        joint12 = p1[:, None] * p2
        return [p1, joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))]

    def assert_follows(self, tokens: torch.Tensor, marginals: list[torch.Tensor]) -> None:
        """tokens [rows, >= 3]: each of the first three positions passes the chi-square test."""
        for position, law in enumerate(marginals):
            counts = torch.bincount(tokens[:, position], minlength=self.vocab).float()
            stat, df = self.chi2(counts, law)
            assert stat < self.chi2_critical(df), f"position {position}: chi2 {stat:.1f} on {df} df"

    def assert_decoder_follows_target(self, decoder, target, prompt, rows, new_tokens, **kwargs):
        """`decoder` samples `rows` seeded rows after `prompt` (`sampling`), and their first three
        tokens follow `target`'s exact law (chi-square); returns the run's total statistics."""
        out = decoder.generate(
            [list(prompt)] * rows,
            max_new_tokens=new_tokens,
            temperature=self.sampling.temperature,
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
            row_seeds=range(rows),
            stop_token_ids=[],
            **kwargs,
        )
        self.assert_follows(torch.tensor(out.new_tokens), self.exact_marginals(target, prompt))
        return out.stats.total


# --------------------------------------------------------------------------------------------
# coupled randomness: seeded rows whose text no length policy may change


@dataclass(frozen=True)
class CoupledRuns:
    """The policies, prompts and seeds of the coupled-randomness tests, on the CPU or a GPU."""

    policies: dict = field(
        default_factory=lambda: {
            "k=1": dict(drafting="model", num_draft_tokens=1),
            "k=3": dict(drafting="model", num_draft_tokens=3),
            "k=7": dict(drafting="model", num_draft_tokens=7),
            "heuristic": dict(
                drafting="model", length_policy="heuristic", num_draft_tokens=2, bound=(1, 6)
            ),
            "confidence": dict(
                drafting="model", length_policy="confidence", stop_threshold=0.6, bound=(1, 6)
            ),
            "head": dict(drafting="model", length_policy="head", stop_threshold=0.5, bound=(1, 6)),
        }
    )
    prompts: tuple = ((5, 6, 7, 8, 9, 10, 11), (3, 4), (20, 21, 22, 23, 24), (40,), (7,) * 6)
    seeds: tuple[int, ...] = (11, 22, 33, 44, 55)

    def generate(self, decoder: SpeculativeDecoder, coupled: bool, seeds=None, **policy):
        return decoder.generate(
            [list(p) for p in self.prompts],
            max_new_tokens=24,
            temperature=0.9,
            top_k=40,
            top_p=0.95,
            row_seeds=list(self.seeds if seeds is None else seeds),
            stop_token_ids=[],
            coupled=coupled,
            **policy,
        )

    def assert_sampled_law_is_targets(self, policy: str, device: str = "cpu") -> None:
        """The first three tokens of thousands of seeded rows follow the target's exact law."""
        law = SampledLaw()
        target = _tiny_llama(seed=0, vocab=law.vocab, init=0.4)
        drafter = _tiny_llama(seed=9, vocab=law.vocab, init=0.4, layers=1)
        decoder = SpeculativeDecoder(
            copy.deepcopy(target).to(device),
            drafter=drafter.to(device),
            acceptance_head=_drawn_head(32).to(device),
        )
        total = law.assert_decoder_follows_target(
            decoder, target, law.prompt, 2000, 4, coupled=True, **self.policies[policy]
        )
        assert total.bonus > 0 and total.recovered > 0


# --------------------------------------------------------------------------------------------
# synthetic data: a head collection (no models) and a tiny translation corpus


@dataclass(frozen=True)
class SyntheticHeadData:
    """`prompts` x `per_prompt` collected examples of a drafter with `hidden`-wide states."""

    hidden: int = 16
    prompts: int = 12
    per_prompt: int = 100

    @property
    def meta(self) -> dict:
        return {
            "drafter": {"name": "tiny-drafter", "fingerprint": "d0d0d0d0d0d0d0d0"},
            "target": {"name": "tiny-target", "fingerprint": "7a7a7a7a7a7a7a7a"},
            "temperature": 0.7,
            "mixing_ratio": 0.5,
            "prompts": "synthetic",
            "num_prompts": self.prompts,
            "max_new_tokens": self.per_prompt,
            "seconds": 0.0,
        }

    def write(
        self,
        directory: Path,
        shuffle_labels: bool = False,
        seed: int = 0,
        signal_in_law: bool = False,
    ) -> Path:
        """A collection whose label is [hidden @ w > 0], 10% flipped.

        With `signal_in_law` the label follows the first law feature instead, and the hidden
        state is noise.
        """
        g = torch.Generator().manual_seed(seed)
        n = self.prompts * self.per_prompt
        hidden = torch.randn(n, self.hidden, generator=g)  # [N, H]
        law = torch.randn(n, 3, generator=g)  # [N, 3]
        drawn = torch.randn(n, generator=g)  # [N] how likely the drawn token was, in some units
        w = torch.randn(self.hidden, generator=g)  # [H]
        score = law[:, 0] if signal_in_law else hidden @ w / w.norm()  # [N] ~ N(0, 1)
        flip = torch.rand(n, generator=g) < 0.1
        greedy = ((score > 0) ^ flip).float()  # [N]
        sampling = torch.sigmoid(2 * score)  # [N]
        if shuffle_labels:
            perm = torch.randperm(n, generator=g)
            greedy, sampling = greedy[perm], sampling[perm]
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            "hidden": hidden.half(),
            "label_greedy": greedy,
            "label_sampling": sampling,
            "prompt_index": torch.arange(self.prompts).repeat_interleave(self.per_prompt),
            "position": torch.arange(self.per_prompt).repeat(self.prompts),
            "law_greedy": law,
            "law_sampling": law.clone(),
            # the drawn token's acceptance follows its log probability (a monotone function of it)
            "label_drawn": torch.sigmoid(2 * drawn),
            "drawn_log_prob": -torch.exp(-drawn),
        }
        save_file(tensors, directory / "examples.safetensors")
        (directory / "meta.json").write_text(json.dumps(self.meta))
        return directory


SUBJECTS = [("el hombre", "the man"), ("la mujer", "the woman"), ("el rey", "the king")]
VERBS = [("come", "eats"), ("ve", "sees"), ("tiene", "has")]
OBJECTS = [("pan", "bread"), ("agua", "water"), ("la casa", "the house"), ("el campo", "the field")]


def _tiny_corpus() -> dict[str, list[Verse]]:
    """36 made-up verses (subject, verb, object), split 30 / 3 / 3."""
    rows = [
        Verse(f"Book {i}:1", f"{s} {v} {o}.", f"{se} {ve} {oe}.", f"{se} {ve} {oe}.")
        for i, ((s, se), (v, ve), (o, oe)) in enumerate(itertools.product(SUBJECTS, VERBS, OBJECTS))
    ]
    return {"train": rows[:30], "valid": rows[30:33], "test": rows[33:]}


# --------------------------------------------------------------------------------------------
# fixtures: each helper above, reached by name from a test's arguments


@pytest.fixture(scope="session")
def tiny_llama():
    """tiny_llama(seed=0, layers=2, vocab=96, init=0.02, **config): a random LlamaForCausalLM."""
    return _tiny_llama


@pytest.fixture(scope="session")
def tiny_gpt2():
    """tiny_gpt2(seed=0, layers=2, vocab=96, init=0.02): a random GPT2LMHeadModel."""
    return _tiny_gpt2


@pytest.fixture(params=sorted(ARCHITECTURES))
def tiny_architecture(request):
    """Each tiny architecture's builder in turn (llama, gpt2, qwen2: the same arguments)."""
    return ARCHITECTURES[request.param]


@pytest.fixture(scope="session")
def word_tokenizer():
    """word_tokenizer(vocab=96, prefix="t"): whitespace words t0 .. t95, t0 EOS and padding."""
    return _word_tokenizer


@pytest.fixture(scope="session")
def make_fake_dist():
    """make_fake_dist(root, name, version, files): an installed distribution's dist-info."""
    return _make_fake_dist


@pytest.fixture(scope="session")
def noisy_copy():
    """noisy_copy(model, scale, seed=7): a drafter close to the target."""
    return _noisy_copy


@pytest.fixture(scope="session")
def spread_head():
    """spread_head(hidden_size, seed=3, rule="greedy"): predictions spread over (0.5, 1)."""
    return _spread_head


@pytest.fixture(scope="session")
def numbered_head():
    """numbered_head(hidden_size, calibration): `spread_head` for sampling, number-weighted."""
    return _numbered_head


@pytest.fixture(scope="session")
def drawn_head():
    """drawn_head(hidden_size): a sampling head reading the drawn token's log probability."""
    return _drawn_head


@pytest.fixture(scope="session")
def sampled_law() -> SampledLaw:
    return SampledLaw()


@pytest.fixture(scope="session")
def coupled_runs() -> CoupledRuns:
    return CoupledRuns()


@pytest.fixture(scope="session")
def head_data() -> SyntheticHeadData:
    """head_data.write(directory, shuffle_labels, seed, signal_in_law): a synthetic collection;
    head_data.hidden, .prompts, .per_prompt, .meta: what it holds."""
    return SyntheticHeadData()


@pytest.fixture(scope="session")
def tiny_corpus():
    """tiny_corpus(): {"train", "valid", "test"} lists of made-up Spanish-English verses."""
    return _tiny_corpus


# ---------------------------------------------------------------- servers in their own process


class LiveServer:
    """A server process on a free port of 127.0.0.1, ready once `/health` answers 200.

    `command(port)` gives its command line. Its stderr goes to a file, not a pipe that nobody
    reads while it runs (a full pipe would stall it); a server that exits before it is ready
    fails the test with that file's text."""

    def __init__(self, command, ready_s: float = 300.0) -> None:
        import os
        import socket
        import subprocess
        import sys
        import tempfile
        import time

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkdtemp()) / "server.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command(self.port), env=env, stderr=log)
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited: {self.log.read_text()}")
            assert time.monotonic() < deadline, f"the server was not ready in {ready_s:g} s"
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def metric(self, name: str, labels: str = "") -> float:
        """A counter or gauge of `/metrics` (0 where it is not listed yet)."""
        import httpx

        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(f"specdecode:{name}{labels} "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def live_server():
    """`live_server(command, ready_s=300)`: a `LiveServer`, stopped at the end of the session
    at the latest (a module's fixture stops its own first)."""
    started: list[LiveServer] = []

    def start(command, ready_s: float = 300.0) -> LiveServer:
        started.append(LiveServer(command, ready_s))
        return started[-1]

    yield start
    for server in started:
        server.stop()
