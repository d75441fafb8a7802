"""The prepacked linear: same results as `nn.Linear`, and which kernel serves which row count."""

from __future__ import annotations

import pytest
import torch

from specdecode.backends.kernels import (
    PackedTiedOutput,
    PrepackedLinear,
    kernel_summary,
    prepack_available,
    prepack_linears,
    quantize_int8,
    use_prepacked,
)
from specdecode.loading import int8_draft_wanted

pytestmark = pytest.mark.skipif(not prepack_available(), reason="no oneDNN linear kernels")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_prepacked_model_matches_the_dense_one(rows):
    dense = _model()
    packed = prepack_linears(_model())
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        assert torch.allclose(packed(x), dense(x), atol=1e-5, rtol=1e-5)


def test_rows_from_min_rows_up_take_the_packed_copy():
    """The packed copy is swapped for zeros: a row count it serves then gives the bias alone."""
    model = prepack_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)), min_rows=2, pad_rows=1)
    layer = model[0]
    assert isinstance(layer, PrepackedLinear) and layer.min_rows == 2
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 16))
    with torch.inference_mode():
        for rows in (1, 2, 3, 5):
            out = model(torch.randn(rows, 16) + 1.0)  # [rows, 8]
            served_packed = torch.allclose(out, layer.bias.expand(rows, 8))
            assert served_packed == (rows >= 2), rows
        use_prepacked(model, False)  # switched off: every row count takes the dense weight
        assert not torch.allclose(model(torch.randn(3, 16) + 1.0), layer.bias.expand(3, 8))


def test_row_numbers_below_one_are_refused():
    with pytest.raises(ValueError, match="min_rows must be >= 1"):
        prepack_linears(_model(), min_rows=0)
    with pytest.raises(ValueError, match="pad_rows must be >= 1, got 0"):
        prepack_linears(_model(), pad_rows=0)
    layer = prepack_linears(_model(), min_rows=1, pad_rows=1)[0]
    with pytest.raises(
        ValueError, match=r"pad each row count up, not down: \(rows, to\) \[\(3, 2\)\]"
    ):
        layer.pad_to = (4, 4, 2)
    layer.pad_to = [4, 4, 4, 4, 5]  # trailing counts equal to their own rows are dropped
    assert layer.pad_to == (4, 4, 4)


def test_tied_output_is_packed_without_a_second_parameter():
    """A weight applied with `F.linear` by its owner (a tied table) gets a packed copy whose
    results match, whose rows switch as a linear's do, and which adds nothing to the owner's
    state dict (saved drafters stay loadable)."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(50, 16)
    bias = torch.nn.Parameter(torch.randn(50))
    owner = torch.nn.Module()
    owner.table, owner.bias = table, bias
    keys = set(owner.state_dict())
    owner.out = PackedTiedOutput(table.weight, bias, min_rows=2)
    assert set(owner.state_dict()) == keys
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(1, rows, 16)
            dense = torch.nn.functional.linear(x, table.weight, bias)
            assert torch.allclose(owner.out(x), dense, atol=1e-5, rtol=1e-5)
        owner.out.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(50, 16))
        x = torch.randn(3, 16) + 1.0
        assert torch.allclose(owner.out(x), bias.expand(3, 50))  # 3 rows: the packed copy
        assert not torch.allclose(owner.out(x[:1]), bias.expand(1, 50))  # 1 row: dense
        use_prepacked(owner, False)
        assert not torch.allclose(owner.out(x), bias.expand(3, 50))
    with torch.enable_grad():  # training takes the dense weight, which has gradients
        owner.out.enabled = True
        owner.out(torch.randn(4, 16)).sum().backward()
    assert table.weight.grad is not None and bias.grad is not None


def test_draft_precision_choice():
    """auto drafts in int8 exactly where an int8 drafter runs (fp32 on the CPU)."""
    assert int8_draft_wanted("auto", "cpu", torch.float32)
    assert not int8_draft_wanted("auto", "cuda", torch.float32)
    assert not int8_draft_wanted("auto", "cpu", torch.bfloat16)
    assert not int8_draft_wanted("fp32", "cpu", torch.float32)
    assert int8_draft_wanted("int8", "cpu", torch.float32)
    with pytest.raises(ValueError, match="int8 drafter needs float32 models on the CPU"):
        int8_draft_wanted("int8", "cuda", torch.float32)
    with pytest.raises(ValueError, match="draft precision must be one of"):
        int8_draft_wanted("fp16", "cpu", torch.float32)


def test_median_times_find_the_typically_cheaper_callable_on_a_clock():
    from specdecode.backends.kernels import median_times

    now = [0.0]
    costs = {1: 5.0, 2: 3.0}

    def spend(key):
        return lambda: now.__setitem__(0, now[0] + costs[key])

    candidates = {key: spend(key) for key in costs}

    def fastest():
        typical = median_times(candidates, 3, clock=lambda: now[0])
        return min(typical, key=typical.get)

    assert fastest() == 2
    costs[1] = 1.0
    assert fastest() == 1
    # an occasional fast run does not make a callable the cheaper one: the median decides
    runs = iter([0.5, 0.5, 9.0, 9.0])  # callable 1: warm-up, then 0.5, 9, 9
    candidates[1] = lambda: now.__setitem__(0, now[0] + next(runs))
    costs[2] = 3.0
    assert fastest() == 2


def test_row_plans_are_timed_once_per_weight_shape(monkeypatch):
    """The timing runs once for each distinct weight shape, on a module's own packed copy, and
    every module of that shape gets the plan; explicit numbers override the timed ones."""
    from specdecode.backends import kernels

    min_rows, pad_to = kernels.row_plan(prepack_linears(_model(), 2, 1)[0])
    assert min_rows in (1, 2) and len(pad_to) < kernels.MOST_PADDED_ROWS
    assert all(rows <= n <= kernels.MOST_PADDED_ROWS for rows, n in enumerate(pad_to, 1))
    seen = []
    plans = {(96, 64): (1, (4, 4, 4)), (32, 96): (2, ())}

    def fake_plan(module):
        seen.append(module)
        return plans[tuple(module.weight.shape)]

    monkeypatch.setattr(kernels, "row_plan", fake_plan)
    model = torch.nn.Sequential(_model(), _model())  # two linears of each shape
    kernels.prepack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    assert [(m.min_rows, m.pad_to) for m in layers] == [(1, (4, 4, 4)), (2, ())] * 2
    assert sorted(tuple(m.weight.shape) for m in seen) == sorted(plans)
    assert all(isinstance(m, PrepackedLinear) for m in seen)
    assert kernel_summary(model) == {
        "prepacked": True,
        "packed_from_rows": 1,  # the largest weight's (96 x 64)
        "row_plans": {"96x64": [1, [4, 4, 4]], "32x96": [2, []]},
    }
    seen.clear()
    fixed = kernels.prepack_linears(_model(), min_rows=2)  # padding still timed
    assert [(m.min_rows, m.pad_to) for m in fixed if isinstance(m, PrepackedLinear)] == [
        (2, (4, 4, 4)),
        (2, ()),
    ]
    kernels.prepack_linears(_model(), min_rows=1, pad_rows=3)
    assert len(seen) == 2  # nothing timed when both are given


@pytest.mark.parametrize(
    ("packed", "dense", "plan"),
    [
        ([5.0, 5.0, 5.0, 5.0], 4.0, (2, ())),  # flat packed curve, dense one row faster
        ([5.0, 6.0, 4.0, 3.0], 4.0, (1, (4, 4, 4))),  # the EPYC's output layer: pad to 4
        ([5.0, 6.0, 3.05, 3.0], 9.0, (1, (3, 3))),  # 3 rows within tolerance of 4: fewer rows
        ([1.0, 1.1, 1.2, 1.4], 2.0, (1, ())),  # growing with rows: no padding
        ([5.0, 6.0, 4.0, 3.0], 2.9, (2, (4, 4, 4))),  # dense one row beats every packed one
        # the EPYC's MLP weight (medians, ms): 1-3 rows padded to 4; 8 rows within 3% of 9
        ([1.36, 1.49, 1.38, 1.24, 1.21, 1.25, 1.58, 1.71, 1.69], 1.5, (1, (4, 4, 4))),
        # one row as fast as four: it stays alone, but two and three rows are padded to four
        # (one count for all short products would have padded none, the slowest included)
        ([1.2, 1.5, 1.3, 1.2, 1.3], 9.0, (1, (1, 4, 4))),
        # each row count to the cheapest at or above it, not one count for all
        ([5.0, 3.0, 6.0, 4.0, 7.0], 9.0, (1, (2, 2, 4))),
    ],
)
def test_plan_from_times(packed, dense, plan):
    from specdecode.backends.kernels import plan_from_times

    times = {("packed", rows): t for rows, t in enumerate(packed, 1)} | {("dense", 1): dense}
    assert plan_from_times(times) == plan


@pytest.mark.parametrize("pad_to", [(2,), (5, 5, 5, 5), (3, 3, 5, 5)])
def test_padded_products_match_and_are_served_by_the_packed_copy(pad_to):
    """A short product is padded with zero rows: the same values, the same shape (2-D and
    3-D), computed by the packed copy."""
    dense = _model()
    packed = prepack_linears(_model(), min_rows=1, pad_rows=1)
    for module in packed:
        if isinstance(module, PrepackedLinear):
            module.pad_to = pad_to
    with torch.inference_mode():
        for shape in [(1, 64), (3, 64), (1, 2, 64), (1, 7, 64)]:
            x = torch.randn(shape)
            got = packed(x)
            assert got.shape == dense(x).shape
            assert torch.allclose(got, dense(x), atol=1e-5, rtol=1e-5), shape
        layer = packed[0]
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(96, 64))
        assert torch.allclose(layer(torch.randn(1, 64) + 1.0), layer.bias.expand(1, 96))


def test_int8_copy_of_a_packed_model_is_int8_and_leaves_the_model_alone():
    """A packed model quantizes like its dense self: left packed, its layers would have stayed
    fp32 without a word. The packed original keeps its packed layers and its results."""
    dense, packed = _model(), prepack_linears(_model())
    int8 = quantize_int8(packed)
    layers = [m for m in int8.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert len(layers) == 2 and not any(isinstance(m, PrepackedLinear) for m in int8.modules())
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(int8(x), quantize_int8(dense)(x))
        assert isinstance(packed[0], PrepackedLinear)
        assert torch.allclose(packed(x), dense(x), atol=1e-5, rtol=1e-5)


def test_int8_copy_refuses_a_packed_tied_table():
    owner = torch.nn.Module()
    table = torch.nn.Embedding(50, 16)
    owner.table, owner.out = table, PackedTiedOutput(table.weight, None, 1)
    with pytest.raises(ValueError, match="tied output table"):
        quantize_int8(owner)
