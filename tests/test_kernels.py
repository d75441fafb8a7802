"""The prepacked linear: same results as `nn.Linear`, and which kernel serves which row count."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import PrepackedLinear, prepack_available, prepack_linears, use_prepacked

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
    model = prepack_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)))
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


def test_min_rows_below_one_is_refused():
    with pytest.raises(ValueError, match="min_rows must be >= 1"):
        prepack_linears(_model(), min_rows=0)
