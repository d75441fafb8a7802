"""Prompt lookup drafting: n-gram matches in the text itself, verified like any draft.

The lookup is checked against a brute-force reading of its rule; decoding with it must equal
plain greedy decoding token for token and, under sampling, follow the target's exact law (the
draft is a point mass, so a rejected token is resampled from the target's law without it).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import SpeculativeDecoder
from specdecode.cli.main import main
from specdecode.core.config import PromptLookup
from specdecode.core.drafting.lookup import lookup_continuation
from specdecode.core.sampling import logits_to_probs


def brute_force(text: list[int], limit: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The rule in words: the longest n-gram (max_ngram down to min_ngram) ending the text that
    occurs earlier, its latest earlier occurrence, and what followed it, at most `limit`."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(text):
            continue
        pattern = text[-n:]
        starts = [i for i in range(len(text) - n) if text[i : i + n] == pattern]
        if starts:
            follow = starts[-1] + n
            return text[follow : follow + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.integers(0, 3), min_size=0, max_size=30),
    limit=st.integers(1, 6),
    ngrams=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_lookup_follows_its_rule(text: list[int], limit: int, ngrams: tuple[int, int]) -> None:
    low, extra = ngrams
    lookup = PromptLookup(max_ngram=low + extra, min_ngram=low)
    got = lookup_continuation(torch.tensor(text, dtype=torch.long), limit, lookup).tolist()
    assert got == brute_force(text, limit, low + extra, low)


def test_lookup_on_hand_built_texts() -> None:
    def look(text, limit=8, **kw):
        return lookup_continuation(torch.tensor(text), limit, PromptLookup(**kw)).tolist()

    assert look([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]
    assert look([1, 2, 3, 9, 1, 2, 3], limit=2) == [9, 1]
    assert look([5, 1, 7, 5, 1, 8, 5, 1]) == [8, 5, 1]  # the latest occurrence, not the first
    assert look([4, 2, 3, 7, 9, 3, 6, 2, 3]) == [7, 9, 3, 6, 2, 3]  # [2, 3] before [3]
    assert look([1, 2, 3]) == []
    assert look([4, 5, 6, 5], min_ngram=2) == []  # only a 1-gram recurs
    assert look([4]) == [] and look([]) == []


@pytest.mark.parametrize("bad", [dict(min_ngram=0), dict(max_ngram=1, min_ngram=2)])
def test_bad_lookup_settings_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(**bad)


@pytest.fixture(scope="module")
def decoder(tiny_llama) -> SpeculativeDecoder:
    return SpeculativeDecoder(tiny_llama(seed=0, init=0.3), drafter=PromptLookup())


PROMPTS = [[5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [4, 11, 2], [1, 2, 3, 4, 5, 6, 7, 1, 2]]


@pytest.mark.parametrize(
    "policy",
    [
        dict(drafting="lookup", num_draft_tokens=1),
        dict(drafting="lookup", num_draft_tokens=4),
        dict(drafting="lookup", length_policy="heuristic"),
        dict(drafting="auto"),  # priced lookup alone: drafts only where it pays (or not at all)
    ],
)
def test_greedy_output_equals_plain_decoding(decoder: SpeculativeDecoder, policy) -> None:
    kwargs = dict(max_new_tokens=40, stop_token_ids=[])
    plain = decoder.generate(PROMPTS, use_drafter=False, **kwargs)
    for batch in (PROMPTS, PROMPTS[2:3]):  # a batch of rows drafting ragged lengths, and alone
        out = decoder.generate(batch, **kwargs, **policy)
        want = plain.new_tokens if batch is PROMPTS else plain.new_tokens[2:3]
        assert out.new_tokens == want
    total = decoder.generate(PROMPTS, **kwargs, **policy).stats
    assert total.drafter_passes == 0
    if policy["drafting"] == "lookup":  # the timed prices decide whether auto drafts here
        assert total.total.drafted > 0 and 0 < total.total.accepted < total.total.drafted


def repeating_prompt(target, sampling) -> list[int]:
    """[3, 7, x, 9, 3, 7]: lookup drafts x first, x the token the target likes most there, so
    that drafts are both kept and refused."""
    vocab = target.config.vocab_size
    candidates = torch.tensor([[3, 7, x, 9, 3, 7] for x in range(vocab)])  # [vocab, 6]
    with torch.no_grad():
        law = logits_to_probs(target(candidates).logits[:, -1], sampling)  # [vocab, vocab]
    x = int(law.diagonal().argmax())
    return candidates[x].tolist()


def test_sampled_law_equals_target(tiny_llama, sampled_law) -> None:
    """The first three tokens of thousands of seeded rows follow the target's exact law."""
    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    prompt = repeating_prompt(target, sampled_law.sampling)
    decoder = SpeculativeDecoder(target, drafter=PromptLookup())
    total = sampled_law.assert_decoder_follows_target(
        decoder, target, prompt, 3000, 3, num_draft_tokens=3, drafting="lookup"
    )
    assert total.accepted > 0 and total.recovered > 0  # drafts kept and drafts resampled


def coupled_run(decoder: SpeculativeDecoder, k: int, **kwargs):
    """Seeded sampling with coupled randomness: one text per seed, whatever k drafts."""
    return decoder.generate(
        PROMPTS,
        max_new_tokens=24,
        temperature=0.9,
        row_seeds=[1, 2, 3, 4],
        stop_token_ids=[],
        coupled=True,
        num_draft_tokens=k,
        **kwargs,
    )


def test_coupled_lookup_commits_one_text_for_every_k(decoder: SpeculativeDecoder) -> None:
    one, five = (coupled_run(decoder, k, drafting="lookup") for k in (1, 5))
    assert one.new_tokens == five.new_tokens
    assert one.stats.total.drafted != five.stats.total.drafted


@pytest.mark.parametrize("policy", ["confidence", "head"])
def test_policies_that_read_a_drafter_model_are_refused(decoder, policy) -> None:
    with pytest.raises(ValueError, match="prompt lookup drafts without a model"):
        decoder.generate(
            PROMPTS, max_new_tokens=4, drafting="lookup", length_policy=policy, bound=(1, 4)
        )


def test_cli_generates_with_prompt_lookup(tiny_pair, capsys) -> None:
    target, _, _ = tiny_pair
    args = ["generate", "--target", str(target), "--prompt", "t5 t6 t7 t5 t6"]
    common = [*args, "--max-new-tokens", "12", "--json"]
    assert main([*common, "--draft", "prompt-lookup", "--drafting", "lookup"]) == 0
    lookup = json.loads(capsys.readouterr().out)[0]
    assert main([*common, "--drafting", "lookup"]) == 0  # no drafter model loaded for it
    lookup_too = json.loads(capsys.readouterr().out)[0]
    assert main([*common, "--draft", "prompt-lookup"]) == 0  # auto: lookup priced, no model
    auto = json.loads(capsys.readouterr().out)[0]
    assert main([*common, "--no-draft"]) == 0
    plain = json.loads(capsys.readouterr().out)[0]
    assert len(plain["tokens"]) > 0
    assert lookup["tokens"] == lookup_too["tokens"] == auto["tokens"] == plain["tokens"]
    assert lookup["batch_stats"]["total"]["drafted"] > 0
    assert lookup_too["batch_stats"]["total"]["drafter_calls"] == 0
    assert plain["batch_stats"]["total"]["drafted"] == 0  # --no-draft: plain decoding


# --- prompt lookup before a drafter model (LookupFirstDrafter) ---------------------------------

LOOKUP_2 = PromptLookup(max_ngram=3, min_ngram=2)


@pytest.fixture(scope="module")
def paired(tiny_llama, noisy_copy) -> SpeculativeDecoder:
    target = tiny_llama(seed=0, init=0.3)
    return SpeculativeDecoder(target, drafter=noisy_copy(target, 0.3))


@pytest.mark.parametrize(
    "policy",
    [
        dict(num_draft_tokens=4),
        dict(length_policy="heuristic", num_draft_tokens=2, bound=(1, 6)),
        dict(length_policy="confidence", stop_threshold=0.6, bound=(1, 6)),
    ],
)
def test_lookup_first_greedy_equals_plain_decoding(paired: SpeculativeDecoder, policy) -> None:
    kwargs = dict(max_new_tokens=40, stop_token_ids=[])
    plain = paired.generate(PROMPTS, use_drafter=False, **kwargs)
    first = dict(drafting="lookup-first", lookup=LOOKUP_2)
    out = paired.generate(PROMPTS, **first, **kwargs, **policy)
    assert out.new_tokens == plain.new_tokens
    total = out.stats.total
    # both kinds of round: some drafted by the model (passes), some by lookup (no pass)
    assert 0 < total.drafter_calls < total.drafted, total
    alone = paired.generate(PROMPTS, drafting="model", **kwargs, **policy).stats.total
    assert alone.drafter_calls == alone.drafted  # the control: the model drafts every token


def test_lookup_first_keeps_the_sampled_law(tiny_llama, sampled_law) -> None:
    target = tiny_llama(seed=0, vocab=sampled_law.vocab, init=0.4)
    drafter = tiny_llama(seed=9, vocab=sampled_law.vocab, init=0.4, layers=1)
    prompt = repeating_prompt(target, sampled_law.sampling)
    decoder = SpeculativeDecoder(target, drafter=drafter)
    total = sampled_law.assert_decoder_follows_target(
        decoder,
        target,
        prompt,
        3000,
        3,
        num_draft_tokens=2,
        drafting="lookup-first",
        lookup=LOOKUP_2,
    )
    assert total.accepted > 0 and total.recovered > 0
    assert 0 < total.drafter_calls < total.drafted  # lookup and model drafts both verified


def test_coupled_lookup_first_commits_one_text_for_every_k(paired) -> None:
    one = coupled_run(paired, 1, drafting="lookup-first", lookup=LOOKUP_2)
    five = coupled_run(paired, 5, drafting="lookup-first", lookup=LOOKUP_2)
    assert one.new_tokens == five.new_tokens
    assert one.stats.total.drafted != five.stats.total.drafted


def test_lookup_first_needs_a_drafter_model(decoder) -> None:
    with pytest.raises(ValueError, match="drafting 'lookup-first' drafts with a drafter model"):
        decoder.generate(PROMPTS, max_new_tokens=4, drafting="lookup-first", lookup=LOOKUP_2)
