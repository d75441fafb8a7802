"""Encoder-decoder SpecDec on tiny random Marian, BART and T5 models."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
)

from specdecode.backends.kernels import PackedTiedOutput, kernel_summary, prepack_available
from specdecode.backends.torch_eager import UnsupportedModelError
from specdecode.core.config import DecodeConfig, SamplingConfig
from specdecode.core.engine import decode
from specdecode.core.sampling import InvalidLogitsError
from specdecode.core.verification import GreedyRule, TopBetaTau, TopBetaTauRule, make_rule
from specdecode.seq2seq import api
from specdecode.seq2seq.api import AUTO_DRAFT_BATCH, TranslationPair
from specdecode.seq2seq.block_drafter import BlockDrafter, BlockDrafterConfig, init_from_verifier
from specdecode.seq2seq.cached import CachedSeq2Seq
from specdecode.seq2seq.nar_drafter import NARDrafter

V = 48
START, EOS, MASK = 0, 1, 3


def tiny_marian(seed: int = 0) -> MarianMTModel:
    torch.manual_seed(seed)
    cfg = MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=0, eos_token_id=EOS,
        decoder_start_token_id=START, forced_eos_token_id=None,
    )  # fmt: skip
    return MarianMTModel(cfg).eval()


def tiny_bart(seed: int = 0) -> BartForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=128, pad_token_id=0, eos_token_id=EOS, bos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None, forced_bos_token_id=None,
    )  # fmt: skip
    return BartForConditionalGeneration(cfg).eval()


def tiny_drafter(
    model, k: int = 5, seed: int = 1, copy: bool = True, first_from_prefix: bool = False
) -> BlockDrafter:
    torch.manual_seed(seed)
    cfg = BlockDrafterConfig(
        vocab_size=V, d_model=32, layers=2, heads=2, ffn=64, block_size=k, mask_id=MASK, pad_id=0,
        first_from_prefix=first_from_prefix,
    )  # fmt: skip
    drafter = BlockDrafter(cfg).eval()
    if copy:
        init_from_verifier(drafter, model)
    return drafter


def sources(batch: int = 3, length: int = 7, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (batch, length), generator=g)
    mask = torch.ones_like(src)
    for row in range(1, batch):  # ragged sources: later rows are shorter
        mask[row, length - row :] = 0
    return src.masked_fill(mask == 0, 0), mask


@torch.no_grad()
def encoded(model, src: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The verifier's encoder states [batch, S, d], as the drafter reads them."""
    return model.get_encoder()(input_ids=src, attention_mask=mask).last_hidden_state


def run(model, src, mask, drafter_model=None, k=1, rule=None, new=20, **cfg_kwargs):
    cached = CachedSeq2Seq(model)
    cached.encode(src, mask)
    drafter = NARDrafter(drafter_model, cached, k) if drafter_model is not None else None
    cfg = DecodeConfig(max_new_tokens=new, num_draft_tokens=k, **cfg_kwargs)
    rule = rule or make_rule(None, cfg.sampling)
    start = model.config.decoder_start_token_id
    out: list[list[int]] = [[] for _ in range(src.shape[0])]
    for event in decode(cached, drafter, rule, [[start]] * src.shape[0], cfg):
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            out[row].extend(tokens)
    return out


def reference(model, src, mask, new=20) -> list[list[int]]:
    gen = model.generate(
        input_ids=src, attention_mask=mask, do_sample=False, num_beams=1,
        max_new_tokens=new, min_new_tokens=new,
    )  # fmt: skip
    return [row[1:] for row in gen.tolist()]


@pytest.mark.parametrize("family", [tiny_marian, tiny_bart])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("first_from_prefix", [False, True])
def test_specdec_greedy_equals_generate(family, k, first_from_prefix):
    model = family()
    src, mask = sources()
    expected = reference(model, src, mask)
    drafter = tiny_drafter(
        model, k, copy=family is tiny_marian, first_from_prefix=first_from_prefix
    )
    assert run(model, src, mask, drafter, k) == expected
    # beta = 1 of the relaxed rule is the exact greedy rule
    relaxed = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=1, tau=3.0))
    assert run(model, src, mask, drafter, k, rule=relaxed) == expected


def test_plain_decoding_without_drafter_equals_generate():
    model = tiny_marian()
    src, mask = sources(batch=4)
    assert run(model, src, mask) == reference(model, src, mask)


def test_block_drafter_nan_logits_refused():
    """The drafter's draft and its logit check come from one reduction; NaN must still stop it."""
    model = tiny_marian()
    drafter = tiny_drafter(model, 3)
    with torch.no_grad():
        drafter.layers[-1].norm3.weight.fill_(float("nan"))
    src, mask = sources()
    with pytest.raises(InvalidLogitsError, match="NaN"):
        run(model, src, mask, drafter, 3)


def test_drafter_that_agrees_with_verifier_gets_whole_blocks_accepted():
    """A drafter built to propose the verifier's own greedy continuation is accepted in full."""
    model = tiny_marian()
    src, mask = sources(batch=1)
    expected = reference(model, src, mask, new=12)[0]

    class Oracle:
        def __init__(self, k):
            self.k = k

        def start(self, batch_size):
            pass

        def rests(self):
            return False

        def propose(self, sequences, seq_lens, max_tokens, rng):
            from specdecode.core.drafting.base import Draft

            done = int(seq_lens[0]) - 1  # tokens after the start token
            block = (expected[done : done + self.k] + [EOS] * self.k)[: self.k]
            lengths = max_tokens.clamp(max=self.k)
            return Draft(torch.tensor([block]), None, lengths, 1)

        def rollback(self, *args):
            pass

        def select_rows(self, rows):
            pass

    cached = CachedSeq2Seq(model)
    cached.encode(src, mask)
    cfg = DecodeConfig(max_new_tokens=12, num_draft_tokens=4)
    from specdecode.core.stats import DecodeStats, RowStats

    stats = DecodeStats([RowStats()])
    out = []
    for event in decode(cached, Oracle(4), GreedyRule(), [[START]], cfg, stats):
        out.extend(event.new_tokens[0])
    assert out == expected
    assert stats.total.target_calls == 3  # 12 tokens, 4 drafted + ... each call commits 5, 5, 2
    # every round accepted all it drafted: 4, 4, then 1 (the 12th token ends the output)
    assert stats.total.accepted_at_least() == [1.0, 2 / 3, 2 / 3, 2 / 3]


def test_accepted_at_least_from_rounds():
    from specdecode.core.stats import RowStats

    row = RowStats()
    for drafted, accepted in [(3, 0), (3, 1), (3, 3), (3, 1)]:
        row.record(drafted, accepted, accepted + 1, 1)
    assert row.accepted_at_least() == [3 / 4, 1 / 4, 1 / 4]
    assert RowStats().accepted_at_least() == []
    # plain rounds (a gated batch, a row's last token) draft nothing and do not count
    row.record(0, 0, 1, 0)
    row.record(0, 0, 1, 0)
    assert row.accepted_at_least() == [3 / 4, 1 / 4, 1 / 4] and row.target_calls == 6
    assert row.merge(row).accepted_at_least() == [3 / 4, 1 / 4, 1 / 4]


def test_relaxed_rule_accepts_more_and_is_marked_approximate():
    model = tiny_marian()
    src, mask = sources(batch=3)
    drafter = tiny_drafter(model, 6, seed=5, copy=False)  # a poor drafter: relaxing matters
    from specdecode.core.stats import DecodeStats, RowStats

    def accepted(rule):
        cached = CachedSeq2Seq(model)
        cached.encode(src, mask)
        stats = DecodeStats([RowStats() for _ in range(3)])
        cfg = DecodeConfig(max_new_tokens=20, num_draft_tokens=6)
        for _ in decode(cached, NARDrafter(drafter, cached, 6), rule, [[START]] * 3, cfg, stats):
            pass
        return stats.total.accepted

    cached = CachedSeq2Seq(model)
    cached.encode(src, mask)
    stats = DecodeStats([RowStats() for _ in range(3)])
    cfg = DecodeConfig(max_new_tokens=20, num_draft_tokens=6)
    for _ in decode(
        cached, NARDrafter(drafter, cached, 6), GreedyRule(), [[START]] * 3, cfg, stats
    ):
        pass
    # a block drafter makes one pass per round, not one per drafted token
    for row in stats.rows:
        assert row.drafter_calls <= row.target_calls < row.drafted

    loose = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=V, tau=100.0))
    assert not loose.exact and TopBetaTauRule(SamplingConfig(), TopBetaTau(1)).exact
    assert accepted(loose) > accepted(GreedyRule())


def test_batch_invariance():
    """A row's output does not depend on the other rows of its batch (ragged acceptance)."""
    model = tiny_marian()
    src, mask = sources(batch=4, seed=7)
    drafter = tiny_drafter(model, 4)
    relaxed = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=3, tau=2.0))
    for rule in (GreedyRule(), relaxed):
        together = run(model, src, mask, drafter, 4, rule=rule)
        for row in range(4):
            width = int(mask[row].sum())
            alone = run(model, src[row : row + 1, :width], mask[row : row + 1, :width], drafter, 4,
                        rule=rule)  # fmt: skip
            assert alone[0] == together[row]


def test_sampling_first_token_law_is_the_verifiers():
    """With a deterministic drafter, lossless sampling keeps the verifier's law."""
    model = tiny_marian()
    n = 3000
    src, mask = sources(batch=1, seed=3)
    src, mask = src.expand(n, -1).contiguous(), mask.expand(n, -1).contiguous()
    drafter = tiny_drafter(model, 3)
    out = run(model, src, mask, drafter, 3, new=2, sampling=SamplingConfig(temperature=1.0),
              row_seeds=tuple(range(n)))  # fmt: skip
    with torch.no_grad():
        logits = model(input_ids=src[:1], attention_mask=mask[:1],
                       decoder_input_ids=torch.tensor([[START]])).logits[0, -1]  # fmt: skip
    probs = logits.softmax(-1)
    counts = torch.bincount(torch.tensor([row[0] for row in out]), minlength=V).float() / n
    assert (counts - probs).abs().max() < 4 * (probs * (1 - probs) / n).sqrt().max() + 1e-3


def test_t5_exact_at_batch_one_and_refused_above():
    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=EOS,
    )  # fmt: skip
    model = T5ForConditionalGeneration(cfg).eval()
    src, mask = sources(batch=1)
    drafter = tiny_drafter(model, 4, copy=False)
    assert run(model, src, mask, drafter, 4) == reference(model, src, mask)
    src2, mask2 = sources(batch=2)
    with pytest.raises(UnsupportedModelError, match="batch size 1"):
        run(model, src2, mask2, drafter, 4)


def test_decoder_only_model_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="not an encoder-decoder"):
        CachedSeq2Seq(model)


# -- the top-beta/tau rule on hand-built logits -------------------------------------------------


def logits_from(logps: list[list[float]]) -> torch.Tensor:
    return torch.tensor([logps]).log()  # [1, k + 1, vocab]: log of the given probabilities


def test_top_beta_tau_accepts_within_beta_and_tau():
    # position 0: draft 1 is 2nd best, log-gap log(0.5/0.3)=0.51; position 1: draft 2 is 3rd best
    probs = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]
    draft = torch.tensor([[1, 2]])
    rule = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=2, tau=3.0))
    verdict = rule.verify(draft, None, logits_from(probs), torch.tensor([2]), None)
    # token 2 at position 1 is outside the top-2: rejected and replaced by the top-1 (token 0)
    assert verdict.num_accepted.tolist() == [1] and verdict.next_tokens.tolist() == [0]
    rule3 = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=3, tau=3.0))
    verdict = rule3.verify(draft, None, logits_from(probs), torch.tensor([2]), None)
    # both accepted: the bonus is the top-1 of the last position (token 2)
    assert verdict.num_accepted.tolist() == [2] and verdict.next_tokens.tolist() == [2]


def test_top_beta_tau_rejects_beyond_tau_and_stops_at_first_failure():
    probs = [[0.90, 0.09, 0.01], [0.5, 0.4, 0.1], [0.4, 0.3, 0.3]]
    draft = torch.tensor([[2, 1]])  # position 0 fails tau (log 90 = 4.5 > 3); position 1 would pass
    rule = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=3, tau=3.0))
    verdict = rule.verify(draft, None, logits_from(probs), torch.tensor([2]), None)
    assert verdict.num_accepted.tolist() == [0] and verdict.next_tokens.tolist() == [0]
    loose = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=3, tau=5.0))
    verdict = loose.verify(draft, None, logits_from(probs), torch.tensor([2]), None)
    assert verdict.num_accepted.tolist() == [2]


def test_top_beta_tau_respects_each_rows_draft_length():
    probs = [[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]
    logits = logits_from(probs).expand(2, -1, -1)
    draft = torch.tensor([[1, 1], [1, 1]])
    rule = TopBetaTauRule(SamplingConfig(), TopBetaTau(beta=2, tau=3.0))
    verdict = rule.verify(draft, None, logits, torch.tensor([2, 1]), None)
    assert verdict.num_accepted.tolist() == [2, 1]
    assert verdict.next_tokens.tolist() == [2, 0]  # row 1: the top-1 after its one token


def test_beta_one_is_the_greedy_rule_on_random_logits():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(4, 6, 5, generator=g)
        best = logits.argmax(-1)[:, :5]
        draft = torch.where(
            torch.rand(4, 5, generator=g) < 0.7, best, torch.randint(0, 5, (4, 5), generator=g)
        )
        lengths = torch.randint(0, 6, (4,), generator=g)
        a = TopBetaTauRule(SamplingConfig(), TopBetaTau(1, 0.0)).verify(
            draft, None, logits, lengths, None
        )
        b = GreedyRule().verify(draft, None, logits, lengths, None)
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(
            a.next_tokens, b.next_tokens
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0}, "beta"),
        ({"beta": 2.5}, "beta"),
        ({"tau": -1.0}, "tau"),
        ({"tau": float("inf")}, "tau"),
    ],
)
def test_top_beta_tau_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TopBetaTau(**kwargs)


def test_top_beta_tau_needs_greedy_and_its_own_name():
    with pytest.raises(ValueError, match="temperature 0"):
        TopBetaTauRule(SamplingConfig(temperature=0.7))
    with pytest.raises(ValueError, match="top-beta-tau"):
        make_rule("greedy", SamplingConfig(), TopBetaTau())


# -- the block drafter ------------------------------------------------------------------------


def test_block_inputs_layout():
    drafter = tiny_drafter(tiny_marian(), 3, copy=False)
    prefix = torch.tensor([[0, 9, 9, 9], [0, 5, 6, 7]])
    ids, valid, query = drafter.block_inputs(prefix, torch.tensor([1, 4]), 3)
    assert ids.tolist() == [
        [0, MASK, MASK, MASK, 0, 0, 0],  # row 0: start token, 3 queries, padding
        [0, 5, 6, 7, MASK, MASK, MASK],
    ]
    assert valid.tolist() == [[True] * 4 + [False] * 3, [True] * 7]
    assert query.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_block_drafter_shapes_and_padding_independence():
    model = tiny_marian()
    drafter = tiny_drafter(model, 4)
    src, mask = sources(batch=2)
    with torch.no_grad():
        enc = encoded(model, src, mask)
        prefix = torch.tensor([[0, 5, 0, 0], [0, 5, 6, 7]])
        lens = torch.tensor([2, 4])
        logits = drafter(prefix, lens, enc, mask, 4)
        assert logits.shape == (2, 4, V)
        other = prefix.clone()
        other[0, 2:] = 11  # what lies past a row's prefix must not matter
        assert torch.allclose(drafter(other, lens, enc, mask, 4), logits, atol=1e-6)
        # nor does the content of source padding
        src2 = src.clone()
        src2[1, int(mask[1].sum()) :] = 17
        enc2 = encoded(model, src2, mask)
        assert torch.allclose(drafter(prefix, lens, enc2, mask, 4), logits, atol=1e-5)


def test_block_drafter_initialised_from_verifier_and_layers_distinct():
    model = tiny_marian()
    drafter = tiny_drafter(model, 4)
    assert torch.equal(drafter.embed.weight, model.get_input_embeddings().weight)
    layer, theirs = drafter.layers[1], model.get_decoder().layers[1]
    assert torch.equal(layer.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
    assert torch.equal(layer.cross_attn.v_proj.bias, theirs.encoder_attn.v_proj.bias)
    assert torch.equal(layer.fc2.weight, theirs.fc2.weight)
    first, second = drafter.layers[0].fc1.weight, drafter.layers[1].fc1.weight
    assert first.data_ptr() != second.data_ptr() and not torch.equal(first, second)


@pytest.mark.parametrize("first_from_prefix", [False, True])
def test_cached_rounds_equal_full_passes(first_from_prefix):
    """Feeding committed tokens round by round through the cache gives the full pass's logits,
    for ragged rows, with holes and compaction."""
    from specdecode.seq2seq.block_drafter import DrafterState

    model = tiny_marian()
    drafter = tiny_drafter(model, 4, first_from_prefix=first_from_prefix)
    src, mask = sources(batch=3)
    enc = encoded(model, src, mask)
    g = torch.Generator().manual_seed(4)
    sequences = torch.randint(4, V, (3, 40), generator=g)
    sequences[:, 0] = START
    state = DrafterState(drafter, compact_min_holes=2)
    state.reset(3)
    lens = torch.tensor([1, 1, 1])
    for _ in range(8):
        k = int(torch.randint(1, 5, (1,), generator=g))
        got = state.propose(sequences, lens, enc, mask, k)
        with torch.no_grad():
            want = drafter(sequences[:, : int(lens.max())], lens, enc, mask, k)
        assert torch.allclose(got, want, atol=1e-4), (lens, k)
        lens = lens + torch.randint(1, 5, (3,), generator=g)  # rows commit different amounts
    assert state.physical_len >= int(state.lengths.max())


@pytest.mark.parametrize("first_from_prefix", [False, True])
def test_training_blocks_equal_separate_passes(first_from_prefix):
    """`forward_blocks` (prefix computed once, several blocks) gives each block's own logits."""
    model = tiny_marian()
    drafter = tiny_drafter(model, 3, first_from_prefix=first_from_prefix)
    src, mask = sources(batch=2)
    with torch.no_grad():
        enc = encoded(model, src, mask)
        targets = torch.tensor([[0, 5, 6, 7, 8, 1], [0, 9, 10, 1, 0, 0]])
        lens = torch.tensor([6, 4])
        starts = torch.tensor([[0, 2, 4], [1, 0, 2]])
        together = drafter.forward_blocks(targets, lens, starts, enc, mask, 3)
        assert together.shape == (2, 3, 3, V)
        for row in range(2):
            for b in range(3):
                s = int(starts[row, b])
                alone = drafter(targets[row : row + 1, : s + 1], torch.tensor([s + 1]),
                                enc[row : row + 1], mask[row : row + 1], 3)  # fmt: skip
                assert torch.allclose(together[row, b], alone[0], atol=1e-5), (row, b)


def test_first_token_from_prefix_is_the_causal_prediction():
    """Read from the last prefix slot, the first draft is that slot's next-token logits: the
    same whatever k (prefix slots never see the queries), and the same as the training pass's
    prefix logits at that slot; the queries behind it still read the whole prefix."""
    model = tiny_marian()
    drafter = tiny_drafter(model, 4, first_from_prefix=True)
    src, mask = sources(batch=2)
    with torch.no_grad():
        enc = encoded(model, src, mask)
        targets = torch.tensor([[0, 5, 6, 7, 8, 1], [0, 9, 10, 1, 0, 0]])
        lens = torch.tensor([6, 4])
        prefix_lens = torch.tensor([4, 3])
        one = drafter(targets, prefix_lens, enc, mask, 1)
        four = drafter(targets, prefix_lens, enc, mask, 4)
        assert one.shape == (2, 1, V) and four.shape == (2, 4, V)
        assert torch.allclose(one[:, 0], four[:, 0], atol=1e-5)
        starts = (prefix_lens - 1)[:, None]  # the block after targets[:, :prefix_lens]
        blocks, prefix = drafter(targets, lens, enc, mask, 4, starts=starts, prefix_logits=True)
        assert prefix.shape == (2, 6, V)
        for row in range(2):
            slot = int(prefix_lens[row]) - 1
            assert torch.allclose(prefix[row, slot], four[row, 0], atol=1e-5)
            assert torch.allclose(blocks[row, 0], four[row], atol=1e-5)
        other = targets.clone()
        other[0, 3] = 11  # the last prefix token changes the queries' drafts too
        assert not torch.allclose(drafter(other, prefix_lens, enc, mask, 4)[0, 1:], four[0, 1:])


def test_reading_first_from_prefix_keeps_the_weights():
    drafter = tiny_drafter(tiny_marian(), 3)
    switched = drafter.reading_first_from_prefix(True)
    assert switched.cfg.first_from_prefix and not drafter.cfg.first_from_prefix
    assert drafter.reading_first_from_prefix(False) is drafter
    for (name, a), (_, b) in zip(
        drafter.state_dict().items(), switched.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_queries_read_the_whole_prefix():
    """The queries see the last prefix token and the prefix length (causality of the prefix
    itself is what `test_cached_rounds_equal_full_passes` relies on and checks)."""
    model = tiny_marian()
    drafter = tiny_drafter(model, 3)
    src, mask = sources(batch=1)
    with torch.no_grad():
        enc = encoded(model, src, mask)
        a = drafter(torch.tensor([[0, 5, 6]]), torch.tensor([3]), enc, mask, 3)
        b = drafter(torch.tensor([[0, 5, 9]]), torch.tensor([3]), enc, mask, 3)
        c = drafter(torch.tensor([[0, 5]]), torch.tensor([2]), enc, mask, 3)
    assert not torch.allclose(a, b)  # queries read the last prefix token
    assert not torch.allclose(a, c)


def test_block_drafter_save_load_round_trip(tmp_path):
    drafter = tiny_drafter(tiny_marian(), 4)
    drafter.save(tmp_path / "d")
    loaded = BlockDrafter.load(tmp_path / "d")
    assert loaded.cfg == drafter.cfg
    for (name, a), (_, b) in zip(
        drafter.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "d" / "drafter_config.json").read_text())
    assert config["block_size"] == 4
    with pytest.raises(FileNotFoundError, match="no block drafter"):
        BlockDrafter.load(tmp_path)


def test_block_too_long_for_positions_is_refused():
    cfg = BlockDrafterConfig(vocab_size=V, d_model=32, layers=1, heads=2, ffn=64, max_positions=8)
    drafter = BlockDrafter(cfg)
    with pytest.raises(ValueError, match="positions"):
        drafter(torch.zeros(1, 5, dtype=torch.long), torch.tensor([5]), torch.zeros(1, 2, 32),
                torch.ones(1, 2), 4)  # fmt: skip


@torch.inference_mode()
def query_logits(drafter: BlockDrafter, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The drafter's logits for 4 mask queries per row, no prefix: [batch, 4, vocab]."""
    batch = states.shape[0]
    ids, pos = torch.full((batch, 4), MASK), torch.arange(4).expand(batch, 4)
    allowed = torch.ones(batch, 4, 4, dtype=torch.bool)
    return drafter.logits(drafter.run(ids, pos, allowed, None, states, mask)[0])


@pytest.mark.skipif(not prepack_available(), reason="no oneDNN linear kernels")
@pytest.mark.parametrize("family", [tiny_marian, tiny_bart])
def test_prepacked_pair_keeps_greedy_output_and_the_drafters_weights(family):
    """Packed kernels for multi-row products (verify passes, block queries) change no token of
    the greedy output, and the drafter's logits and state dict are those of the dense one."""
    model = family()
    src, mask = sources()
    expected = reference(model, src, mask)
    drafter = tiny_drafter(model, 3, copy=family is tiny_marian)
    dense = tiny_drafter(model, 3, copy=family is tiny_marian)
    keys = set(drafter.state_dict())
    pair = TranslationPair(model, None, drafter).prepack()
    assert kernel_summary(model)["prepacked"]
    assert isinstance(drafter.output_kernel, PackedTiedOutput)
    switch = kernel_summary(model)["packed_from_rows"]  # the verifier's, shared by the drafter
    assert {m.min_rows for m in drafter.modules() if hasattr(m, "min_rows")} == {switch}
    alone = tiny_drafter(model, 3).prepack()  # its own plans, timed per weight shape
    shapes = {"x".join(map(str, m.weight.shape)) for m in alone.modules() if hasattr(m, "packed")}
    assert set(kernel_summary(alone)["row_plans"]) == shapes
    assert set(drafter.state_dict()) == keys
    got, want = (query_logits(d, encoded(model, src, mask), mask) for d in (drafter, dense))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    with torch.inference_mode():
        assert run(pair.verifier, src, mask, drafter, 3) == expected
        assert run(pair.verifier, src, mask) == expected


def test_prepacking_refuses_a_half_precision_verifier():
    pair = TranslationPair(tiny_marian().half(), None)
    with pytest.raises(ValueError, match="fp32 models on the CPU"):
        pair.prepack()


@pytest.mark.parametrize("packed_first", [False, True])
def test_int8_drafter_keeps_greedy_output(packed_first):
    """An int8 copy of the drafter (from a dense or a packed one) drafts differently at most;
    the verifier's greedy output stays exact, and the original drafter is untouched."""
    model = tiny_marian()
    src, mask = sources()
    expected = reference(model, src, mask)
    drafter = tiny_drafter(model, 3)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    pair = TranslationPair(model, None, drafter)
    if packed_first and prepack_available():
        pair.prepack()
    int8 = drafter.int8()
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in int8.modules())
    assert isinstance(int8.output_kernel, torch.ao.nn.quantized.dynamic.Linear)
    got, want = (query_logits(d, encoded(model, src, mask), mask) for d in (int8, drafter))
    assert got.shape == want.shape and (got - want).abs().max() < 0.1 * want.abs().max()
    with torch.inference_mode():
        assert run(pair.with_drafter(int8).verifier, src, mask, int8, 3) == expected
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(ValueError, match="already int8"):
        int8.int8()


@pytest.mark.skipif(not prepack_available(), reason="no oneDNN linear kernels")
def test_another_drafter_takes_the_packed_verifiers_kernels():
    """`with_drafter` packs a dense drafter as the verifier is packed (the same one-row switch),
    leaves an int8 one as it is, and packs nothing beside a dense verifier; output stays exact."""
    from specdecode.backends.kernels import kernel_summary

    model = tiny_marian()
    src, mask = sources()
    expected = reference(model, src, mask)
    dense = TranslationPair(model, None).with_drafter(tiny_drafter(model, 3))
    assert dense.drafter.output_kernel is None and not kernel_summary(dense.drafter)["prepacked"]
    pair = TranslationPair(model, None).prepack(min_rows=1)
    other = pair.with_drafter(tiny_drafter(model, 3))
    summary = kernel_summary(other.drafter)
    assert summary["prepacked"] and summary["packed_from_rows"] == 1
    assert {plan[0] for plan in summary["row_plans"].values()} == {1}
    assert other.drafter.output_kernel.min_rows == 1
    int8 = pair.with_drafter(tiny_drafter(model, 3).int8())
    assert not kernel_summary(int8.drafter)["prepacked"]
    with torch.inference_mode():
        assert run(pair.verifier, src, mask, other.drafter, 3) == expected


def state_drafter(model, k: int = 4, seed: int = 5) -> BlockDrafter:
    """A drafter reading the verifier's states, its projection randomised (not the zero start)."""
    drafter = tiny_drafter(model, k).reading_target_states(model.config.d_model).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        drafter.feature_proj.weight.normal_(0, 0.5)
        drafter.feature_proj.bias.normal_(0, 0.5)
    return drafter


def test_reading_target_states_starts_as_the_same_drafter():
    """A projection added at zero changes no logit; removing it again gives the same weights."""
    model = tiny_marian()
    plain = tiny_drafter(model, 3)
    reading = plain.reading_target_states(32)
    assert reading.cfg.target_features == 32 and plain.cfg.target_features == 0
    src, mask = sources(batch=2)
    enc = encoded(model, src, mask)
    prefix, lens = torch.tensor([[0, 5, 6], [0, 7, 0]]), torch.tensor([3, 2])
    features = torch.randn(2, 3, 32)
    with torch.no_grad():
        assert torch.equal(reading(prefix, lens, enc, mask, 3, features=features),
                           plain(prefix, lens, enc, mask, 3))  # fmt: skip
    with pytest.raises(ValueError, match="reads the verifier's states"):
        reading(prefix, lens, enc, mask, 3)  # no features given
    back = reading.reading_target_states(0).state_dict()
    assert back.keys() == plain.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("k,max_draft_batch", [(1, None), (3, None), (6, None), (3, 2)])
def test_target_state_drafter_exact_and_fed_as_in_training(k, max_draft_batch):
    """Decoding with a drafter that reads the verifier's states stays exact, and every proposal
    equals a full pass fed the teacher-forced states of `verifier_states` (the training layout),
    for ragged rows that finish at different rounds; also when the drafter sits out the rounds
    of a larger batch (`max_draft_batch`) and must catch up on their tokens and states."""
    from specdecode.seq2seq.drafter_train import verifier_states

    model = tiny_marian()
    src, mask = sources(batch=3)
    drafter = state_drafter(model, k)
    free = run(model, src, mask)  # plain greedy, 20 tokens a row
    assert free == reference(model, src, mask)
    # rows start 0, 3 and 6 tokens into their greedy output and stop at a token all of them
    # reach later, so they finish at different rounds (this tiny model never emits EOS)
    offsets = (0, 3, 6)
    stop = next(t for t in free[0][7:] if all(t in r and r.index(t) >= 7 for r in free))
    expected = [r[o : r.index(stop) + 1] for r, o in zip(free, offsets, strict=True)]
    assert len(set(map(len, expected))) == 3
    seen = []

    class Recording(NARDrafter):
        def propose(self, sequences, seq_lens, max_tokens, rng):
            before = self.state.propose

            def record(seqs, lens, enc, enc_mask, kk, states_by_pos):
                logits = before(seqs, lens, enc, enc_mask, kk, states_by_pos)
                seen.append((seqs.clone(), lens.clone(), enc, enc_mask, kk, logits))
                return logits

            self.state.propose = record
            try:
                return super().propose(sequences, seq_lens, max_tokens, rng)
            finally:
                self.state.propose = before

    cached = CachedSeq2Seq(model)
    cached.encode(src, mask)
    cfg = DecodeConfig(max_new_tokens=20, num_draft_tokens=k, stop_token_ids=(stop,),
                       max_draft_batch=max_draft_batch)  # fmt: skip
    prompts = [[START, *r[:o]] for r, o in zip(free, offsets, strict=True)]
    out: list[list[int]] = [[] for _ in range(3)]
    rounds = decode(cached, Recording(drafter, cached, k), make_rule(None, cfg.sampling),
                    prompts, cfg)  # fmt: skip
    for event in rounds:
        for row, tokens in zip(event.rows, event.new_tokens, strict=True):
            out[row].extend(tokens)
    assert out == expected
    assert len(seen) > (3 if max_draft_batch is None else 1)
    for seqs, lens, enc, enc_mask, kk, logits in seen:
        assert max_draft_batch is None or seqs.shape[0] <= max_draft_batch
        prefix = seqs[:, : int(lens.max())]
        with torch.no_grad():
            feats = verifier_states(model, enc, enc_mask, prefix)
            want = drafter(prefix, lens, enc, enc_mask, kk, features=feats)
        assert torch.allclose(logits, want, atol=1e-4), lens


def test_target_state_drafter_refuses_another_verifier_width():
    model = tiny_marian()
    drafter = tiny_drafter(model, 3).reading_target_states(16)
    with pytest.raises(ValueError, match="width 16"):
        NARDrafter(drafter, CachedSeq2Seq(model), 3)


def test_keeping_layers_cuts_the_drafter_and_refuses_more():
    model = tiny_marian()
    drafter = tiny_drafter(model, 3)
    one = drafter.keeping_layers(1)
    assert one.cfg.layers == 1 and len(one.layers) == 1
    assert torch.equal(one.layers[0].fc1.weight, drafter.layers[0].fc1.weight)
    assert torch.equal(one.embed.weight, drafter.embed.weight)
    assert drafter.keeping_layers(2) is drafter
    with pytest.raises(ValueError, match="can keep 1 to 2 layers of this drafter, not 3"):
        drafter.keeping_layers(3)


def test_translate_drafts_only_while_few_rows_run_under_the_exact_rule(monkeypatch, word_tokenizer):
    """`translate`'s "auto": exact decoding drafts only while at most AUTO_DRAFT_BATCH rows run
    (the same output, plain steps for a full batch); relaxed decoding drafts every round, as
    an explicit None does."""
    model = tiny_marian()
    pair = TranslationPair(model, word_tokenizer(V), tiny_drafter(model, 3, copy=True))
    sources = [" ".join(f"t{4 + (7 * i + j) % 40}" for j in range(3 + i)) for i in range(6)]
    seen = []
    real = api.decode

    def spy(target, drafter, rule, prompts, cfg, stats):
        seen.append(cfg.max_draft_batch)
        return real(target, drafter, rule, prompts, cfg, stats)

    monkeypatch.setattr(api, "decode", spy)
    kw = dict(max_new_tokens=10, block_size=3, batch_size=6)
    plain = pair.translate(sources, use_drafter=False, **kw)
    auto = pair.translate(sources, **kw)
    every = pair.translate(sources, max_draft_batch=None, **kw)
    relaxed = pair.translate(sources, beta=3, **kw)
    assert seen[1:] == [AUTO_DRAFT_BATCH, None, None] and len(sources) > AUTO_DRAFT_BATCH
    assert auto.token_ids == every.token_ids == plain.token_ids
    # six rows that finish together never drop to four: no round drafted
    assert auto.stats.total.drafted == 0 < every.stats.total.drafted
    assert relaxed.stats.total.drafted > 0 and not relaxed.exact
    one = pair.translate(sources[:1], **kw)  # a lone row drafts
    assert one.stats.total.drafted > 0 and one.token_ids == plain.token_ids[:1]


def test_translate_sorts_batches_by_length_and_returns_the_input_order(word_tokenizer):
    model = tiny_marian()
    with torch.no_grad():  # a strong source signal, so that sources get different outputs
        for layer in model.model.decoder.layers:
            layer.encoder_attn.v_proj.weight.mul_(20)
            layer.encoder_attn.out_proj.weight.mul_(20)
    pair = TranslationPair(model, word_tokenizer(V), tiny_drafter(model, 3, copy=True))
    lengths = [2, 9, 4, 12, 3, 7]
    sources = [
        " ".join(f"t{4 + (5 * i + j) % 40}" for j in range(n)) for i, n in enumerate(lengths)
    ]
    kw = dict(max_new_tokens=8, block_size=3)
    alone = [pair.translate([s], **kw).token_ids[0] for s in sources]
    assert len(set(map(tuple, alone))) >= 4  # a misplaced output would show
    for batch_size in (1, 2, 4):
        for sort in (True, False):
            out = pair.translate(sources, batch_size=batch_size, sort_by_length=sort, **kw)
            assert out.token_ids == alone, (batch_size, sort)
            # per-row statistics land on their own sources
            counted = [row.new_tokens for row in out.stats.rows]
            assert all(c in (len(t), len(t) + 1) for c, t in zip(counted, alone, strict=True))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        pair.translate(sources, batch_size=0)
