"""The one price model: interpolation by rows and tokens, the cache, the watch, the timer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import SpeculativeDecoder
from specdecode import pricebook as pricing
from specdecode.backends.torch_eager import CachedModel
from specdecode.core.prices import Prices, monotone
from specdecode.models import atomic

# one, two and four rows holding 1..4 tokens each (even passes). A drafter step: 0.5, 0.6, 0.8
# steps. Padded (the default layout): a ragged pass costs the even pass of its longest row.
ONE = (1.0, 1.2, 1.5, 2.0)
TWO = (1.3, 1.8, 2.4, 3.2)
FOUR = (1.8, 2.9, 4.0, 5.5)
TABLE = Prices((1, 2, 4), (ONE, TWO, FOUR), (0.5, 0.6, 0.8), step_seconds=0.05)


def test_exact_at_the_measured_points() -> None:
    for rows, curve in zip(TABLE.rows, TABLE.passes, strict=True):
        for longest, cost in enumerate(curve, 1):
            assert TABLE.pass_cost(rows, rows - 1 + longest) == pytest.approx(cost)
    assert [TABLE.draft_cost(r) for r in (1, 2, 4)] == pytest.approx([0.5, 0.6, 0.8])


def test_interpolated_between_rows_and_tokens() -> None:
    # 3 rows, one holding 2: halfway between 2 rows (1.8) and 4 rows (2.9) with one holding 2
    assert TABLE.pass_cost(3, 4) == pytest.approx((1.8 + 2.9) / 2)
    # the tokens beyond one a row priced as if one row held them all: 2 rows holding 4 in all
    assert TABLE.pass_cost(2, 4) == pytest.approx(2.4)
    assert TABLE.draft_cost(3) == pytest.approx(0.7)
    # beyond the largest row count: as many passes of 4 rows as it takes, no gain assumed
    assert TABLE.pass_cost(8, 9) == pytest.approx(2 * 2.9)
    assert TABLE.draft_cost(8) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="at least one row and one token"):
        TABLE.pass_cost(0, 3)


@given(rows=st.integers(1, 12), tokens=st.integers(1, 60))
@settings(max_examples=80, deadline=None)
def test_monotone_in_tokens(rows: int, tokens: int) -> None:
    """A measured table (non-decreasing curves) prices one more token never below the pass
    without it, within and beyond the measured tokens and rows."""
    assert TABLE.pass_cost(rows, tokens + 1) >= TABLE.pass_cost(rows, tokens) - 1e-12


def test_extrapolated_tokens_never_sell_below_the_measured_growth() -> None:
    """Beyond the timed tokens a pass grows at least as fast as it did on average."""
    mean_growth = (ONE[-1] - ONE[0]) / (len(ONE) - 1)
    assert TABLE.pass_cost(1, 10) >= ONE[-1] + 6 * mean_growth - 1e-12


def test_monotone_pools_violations() -> None:
    assert monotone([1.0, 1.5, 1.3, 2.0]) == pytest.approx([1.0, 1.4, 1.4, 2.0])
    rising = [1.0, 1.1, 1.3]
    assert monotone(rising) == rising


def test_stated_prices_as_a_round_view() -> None:
    """What the replay's options state: a verify pass by drafted count, a line past it."""
    rounds = Prices.stated(0.1, 0.05, (0.9, 1.0)).rounds(1)
    assert [rounds.round_cost(m) for m in (1, 2, 4)] == pytest.approx([1.0, 1.2, 1.5])
    assert rounds.added_cost(0, 1) == pytest.approx(1.0)  # a round's start: its verify pass
    assert rounds.added_cost(2, 2) == pytest.approx(0.2 + 0.1)
    at_two = TABLE.rounds(2)  # a row drafting m at 2 rows: it holds m + 1, the other one
    assert at_two.verify(1) == pytest.approx(1.8) and at_two.draft == pytest.approx(0.6)


def test_a_ragged_pass_by_layout() -> None:
    """Padded: as wide as its longest row. Levels (llama.cpp, a cache stream per row): a pass
    per level of the counts, so half the rows drafting costs more than all of them."""
    levels = Prices(TABLE.rows, TABLE.passes, TABLE.drafts, TABLE.step_seconds, "levels")
    assert TABLE.shape_cost([2, 1, 1, 1]) == pytest.approx(2.9)
    assert TABLE.shape_cost([2, 2, 2, 2]) == pytest.approx(2.9)
    assert levels.shape_cost([2, 2, 2, 2]) == pytest.approx(2.9)
    assert levels.shape_cost([1, 2, 1, 2]) == pytest.approx(1.8 + 1.3)  # 4 rows x 1, 2 x 1
    assert levels.shape_cost([3, 1]) == pytest.approx(1.3 + 1.2)  # 2 rows x 1, 1 row x 2
    assert levels.shape_cost([1, 1, 1, 1]) == TABLE.shape_cost([1] * 4) == pytest.approx(1.8)
    assert levels.pass_cost(4, 5) == pytest.approx(1.8 + 1.0)  # one row drafting one
    assert levels.shape_cost([2, 2, 1, 1]) > levels.shape_cost([2, 2, 2, 2])
    assert Prices.from_json(levels.to_json()) == levels
    with pytest.raises(ValueError, match="pass layout"):
        Prices((1,), (ONE,), layout="diagonal")
    with pytest.raises(ValueError, match="at least one row and one token"):
        levels.shape_cost([2, 0])


@given(
    counts=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    layout=st.sampled_from(["padded", "levels"]),
)
@settings(max_examples=80, deadline=None)
def test_a_ragged_pass_lies_between_its_even_bounds(counts: list[int], layout: str) -> None:
    """No layout prices a pass below the even pass of its shortest row or above that of its
    longest row taken once a level; one more token in a row never makes it cheaper under
    padding."""
    prices = Prices(TABLE.rows, TABLE.passes, TABLE.drafts, TABLE.step_seconds, layout)
    cost = prices.shape_cost(counts)
    assert cost >= prices.even_cost(len(counts), min(counts)) - 1e-9
    if layout == "padded":
        assert cost == pytest.approx(prices.even_cost(len(counts), max(counts)))
        assert prices.shape_cost([counts[0] + 1, *counts[1:]]) >= cost - 1e-9


def test_refusals_name_what_is_wrong() -> None:
    for kwargs, message in [
        (dict(rows=(2, 4), passes=(ONE, ONE)), "row counts rising from 1"),
        (dict(rows=(1, 2), passes=(ONE,)), "one pass curve per row count"),
        (dict(rows=(1,), passes=((1.0, float("nan")),)), "finite numbers > 0"),
        (dict(rows=(1,), passes=(ONE,), drafts=(0.5, 0.6)), "one per row count"),
    ]:
        with pytest.raises(ValueError, match=message):
            Prices(**kwargs)


# ---- the cache ----


@pytest.fixture
def saved_pair(tiny_pair):
    """The tiny saved pair as a decoder whose models have files to key prices by."""
    target_dir, drafter_dir, _ = tiny_pair
    return SpeculativeDecoder.from_pretrained(str(target_dir), str(drafter_dir), prepack=False)


def counting(monkeypatch) -> list[int]:
    """Counts the timings (rows asked for) while they still run."""
    calls: list[int] = []
    real = pricing.measure_prices

    def measure(*args, **kwargs):
        calls.append(kwargs.get("rows", 1))
        return real(*args, **kwargs, reps=1)

    monkeypatch.setattr(pricing, "measure_prices", measure)
    return calls


def test_cache_round_trip_and_keying(saved_pair, tiny_pair, tmp_path, monkeypatch) -> None:
    calls = counting(monkeypatch)
    timed = saved_pair.prices(cache_dir=tmp_path)
    assert calls == [1]
    (entry,) = (tmp_path / pricing.PRICES_DIR).glob("*.json")
    assert Prices.from_json(json.loads(entry.read_text())["prices"]) == timed
    assert not list(entry.parent.glob("*.tmp"))  # written atomically: no leftover

    target_dir, drafter_dir, _ = tiny_pair
    fresh = SpeculativeDecoder.from_pretrained(str(target_dir), str(drafter_dir), prepack=False)
    assert fresh.prices(cache_dir=tmp_path) == timed and calls == [1]  # read, not timed
    fresh.prices(rows=2, cache_dir=tmp_path)  # the entry covers 1 row: 2 are timed
    assert calls == [1, 2]
    assert fresh.prices(cache_dir=tmp_path).rows == (1, 2)

    key = pricing.price_key(fresh.target_backend, fresh.drafter_backend)
    assert key is not None and key["machine"] == pricing.cpu_name()
    assert key["target"]["threads"] == torch.get_num_threads()
    weights = next(target_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the model changed
    try:
        changed = pricing.price_key(fresh.target_backend, fresh.drafter_backend)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert changed is not None and changed != key
    assert pricing.load_prices(changed, entry.parent) is None  # a changed key times afresh
    assert pricing.load_prices(key, entry.parent) is not None


def test_a_corrupt_entry_is_timed_afresh(saved_pair, tmp_path, monkeypatch) -> None:
    calls = counting(monkeypatch)
    saved_pair.prices(cache_dir=tmp_path)
    (entry,) = (tmp_path / pricing.PRICES_DIR).glob("*.json")
    entry.write_text('{"key": {"half a file"')
    saved_pair.price_book.known = None  # as a new decoder would
    again = saved_pair.prices(cache_dir=tmp_path)
    assert calls == [1, 1]
    key = pricing.price_key(saved_pair.target_backend, saved_pair.drafter_backend)
    assert pricing.load_prices(key, entry.parent) == again  # and the entry written anew
    saved_pair.prices(retime=True, cache_dir=tmp_path)
    assert calls == [1, 1, 1]


def test_models_built_in_memory_are_not_cached(tiny_llama, tmp_path) -> None:
    decoder = SpeculativeDecoder(tiny_llama(seed=0), drafter=tiny_llama(seed=1))
    assert pricing.price_key(decoder.target_backend, decoder.drafter_backend) is None
    decoder.prices(cache_dir=tmp_path)
    assert not (tmp_path / pricing.PRICES_DIR).exists()


# ---- what drafting was worth, beside the prices ----


def test_the_worth_is_stored_beside_the_prices_outside_the_rounds(
    saved_pair, tmp_path, monkeypatch, caplog
) -> None:
    """A correction of what drafting is worth holds in memory at once; no file is written or
    dropped by a round, the entry is adjusted when the decoder stores it (between rounds), and
    the next decoder of the pair starts from it."""
    monkeypatch.setenv(pricing.PRICES_ENV, str(tmp_path))
    counting(monkeypatch)
    known = saved_pair.prices(1)
    (entry,) = tmp_path.glob("*.json")
    written = entry.stat().st_mtime_ns
    judge = saved_pair.outcomes
    plain = known.step_seconds
    for _ in range(40):  # plain rounds, then drafting rounds at half the gain predicted
        saved_pair.observe_round([1], 1, plain)
    with caplog.at_level("WARNING", logger="specdecode"):
        for _ in range(60):
            if judge.worth(1) == 0.0:  # a plain round where the judge asks for one
                saved_pair.observe_round([1], 1, plain)
                continue
            judge.predicted(1, 3.0, 2.0, 1.0)
            saved_pair.observe_round([3], 1, 2 * plain)
    assert judge.snapshot()[1] < 0.6 and judge.changed
    assert entry.stat().st_mtime_ns == written and entry.exists()  # nothing inside a round
    (said,) = {r.getMessage() for r in caplog.records if "delivers" in r.getMessage()}
    assert "1 row(s)" in said
    saved_pair.store_outcomes()
    key = saved_pair.price_book.entry[0]
    assert pricing.load_worth(key, tmp_path) == judge.snapshot()
    assert pricing.load_prices(key, tmp_path) == known  # the prices stand; the worth moved
    assert not judge.changed
    saved_pair.prices(2)  # timed for more rows: what the rounds showed is kept
    assert saved_pair.outcomes is judge and judge.snapshot()[1] < 0.6


def test_an_unwritable_cache_is_said_once_and_decoding_goes_on(
    saved_pair, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv(pricing.PRICES_ENV, str(tmp_path / "prices"))
    counting(monkeypatch)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied (read-only file system)", str(dst))

    monkeypatch.setattr(atomic, "_said", set())  # said once per process: this test's first
    monkeypatch.setattr(os, "replace", refuse)
    with caplog.at_level("WARNING", logger="specdecode"):
        prices = saved_pair.prices(1)  # timed, not stored
        saved_pair.outcomes.changed = True
        saved_pair.store_outcomes()
        saved_pair.outcomes.changed = True
        saved_pair.store_outcomes()
    said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(said) == 1 and "read-only" in said[0]
    assert saved_pair.known_prices == prices


# ---- the timer ----


def test_timer_through_the_backend_gives_steps(tiny_llama) -> None:
    target, drafter = CachedModel(tiny_llama(seed=0)), CachedModel(tiny_llama(seed=1, layers=1))
    vocab = target.vocab_size
    prices = pricing.measure_prices(target, drafter, vocab, None, rows=3, max_tokens=4, reps=1)
    assert prices.rows == (1, 2, 3)
    assert all(len(curve) == 4 for curve in prices.passes)
    assert prices.passes[0][0] == pytest.approx(1.0)  # the unit: one row, one token
    assert prices.step_seconds is not None and prices.step_seconds > 0
    assert prices.drafts is not None and len(prices.drafts) == 3
    for curve in prices.passes:
        assert list(curve) == sorted(curve)  # made non-decreasing
    assert target.lengths.numel() == 0 and drafter.lengths.numel() == 0  # left empty
    assert prices.layout == "padded"  # a PyTorch block: as wide as its longest row
    target.pass_layout = "levels"  # what a backend that splits ragged passes says
    alone = pricing.measure_prices(target, None, vocab, None, max_tokens=2, reps=1)
    assert alone.drafts is None and alone.draft_cost(1) is None and alone.layout == "levels"
    with pytest.raises(ValueError, match="do not fit the context"):
        pricing.measure_prices(target, None, vocab, 5, max_tokens=12, reps=1)


def test_timed_rows_follow_the_batch() -> None:
    assert pricing.timed_rows(1) == (1,)
    assert pricing.timed_rows(3) == (1, 2, 3)
    assert pricing.timed_rows(8) == (1, 2, 4, 8)
    assert pricing.timed_rows(32) == (1, 2, 4, 8)


def test_timer_rolls_each_pass_back(tiny_llama) -> None:
    """Every pass sees the same cache: the timed passes leave it as the prefill did."""
    backend = CachedModel(tiny_llama(seed=0))
    seen: list[list[int]] = []
    real = backend.forward

    valid: list[torch.Tensor] = []

    def forward(tokens, mask, **kwargs):
        seen.append(backend.lengths.tolist())
        valid.append(mask.clone())
        return real(tokens, mask, **kwargs)

    backend.forward = forward
    (seconds,) = pricing.pass_seconds([(backend, [1, 3])], list(range(5, 25)), reps=2, rows=2)
    assert set(seconds) == {1, 3} and all(s > 0 for s in seconds.values())
    assert seen[0] == [0, 0] and all(lengths == [20, 20] for lengths in seen[1:])
    assert all(v.all() for v in valid[1:])  # even passes: every row holds every token
    assert torch.is_tensor(backend.lengths)
