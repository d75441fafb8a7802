"""Faster CPU kernels for the same weights: what makes a verify pass cost about one step.

Speculative decoding pays only if scoring k + 1 tokens costs about as much as scoring one. On
the CPUs this project is measured on, PyTorch's default fp32 `nn.Linear` (MKL) runs products of
4-8 rows about twice as slow as one row (measured on the 1.5B target: 399 ms for one token, 773
ms for four, 1160 ms for eight), which caps every speedup. Weights reordered once for oneDNN
(`torch.ops.mkldnn._reorder_linear_weight`) run 4-8 rows in about the time of one (455 ms for
five, 590 ms for eight), but a single row a little slower than MKL (465 ms).

`prepack_linears` therefore gives every `nn.Linear` both paths: products of fewer than
`min_rows` rows use the original weight, larger ones the prepacked copy. The switch is at 2 rows
at most: MKL's cost grows with every row from the second on, while the packed copy's 2-3 rows
cost what one does. Whether one row is faster on MKL or packed depends on the CPU, so by default
it is timed once at load. Measured on a 2-core AMD EPYC, on the 1.5B target's shapes (ms for
1 / 2 / 3 / 4 rows): output layer 1536 x 151936, MKL 65 / 130 / 183 / 203, packed 57 / 53 / 57 /
66; MLP 1536 x 8960, MKL 3.7 / 8.0 / 11.1 / 11.0, packed 3.5 / 3.6 / 3.0 / 3.8. With the switch
at 4 rows, as before, a verify pass of 1 or 2 drafted tokens cost 1.9 and 2.8 target steps on
that machine, against about one for 3 to 12: an adaptive length policy paid three times over
for every short round.

The packed kernel itself is not monotone in the rows either: oneDNN picks its blocking by the
row count, and on a later 2-core EPYC the output layer took 32 / 39 / 26 / 23 / 24 ms for 1-5
rows and the MLP's 8960 x 1536 1.69 / 1.85 / 1.70 / 1.52 / 1.48 ms, while the attention
products (1536 x 1536) grow with every row. Each packed weight therefore also has `pad_rows`:
a product of fewer rows is padded with zero rows up to it (each row of a product depends on
that row alone, so padding changes nothing but the kernel). Both numbers are timed once per
distinct weight shape at load (`row_plan`); on that machine a whole step of the 1.5B target
went from 252 to 208 ms and a verify pass of 2 tokens from 342 to 200 ms.

The dense weight stays the module's parameter (nothing else changes for `transformers`); the
packed copy costs one more copy of the linear weights in memory. Results agree with the default
kernels to about 1e-4 on the logits (fp32 rounding order), and `use_prepacked(model, False)`
switches a model back, so a benchmark can compare methods on the same kernels or on the
defaults.

`quantize_int8` makes an int8 dynamically quantized copy of a drafter: its drafts change a
little, never the target's output, since every token is verified by the target.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch


class _Packed(torch.nn.Module):
    """A oneDNN-prepacked copy of a weight, used for products of at least `min_rows` rows;
    products of fewer than `pad_rows` rows are padded with zero rows up to that count."""

    def __init__(self, weight: torch.Tensor, min_rows: int, pad_rows: int = 1) -> None:
        super().__init__()
        self.min_rows = min_rows
        self.pad_rows = pad_rows
        self.enabled = True
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """x @ weight.T + bias, by the packed copy when there are enough rows (inference only);
        a product of fewer than `pad_rows` rows is padded with zero rows."""
        rows = x.numel() // weight.shape[1]
        if not self.enabled or rows < self.min_rows or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, weight, bias)
        bias = None if bias is None else bias.detach()
        if rows >= self.pad_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(self.pad_rows - rows, flat.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(padded, self.packed, bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])  # [..., out_features]


class PrepackedLinear(_Packed):
    """`nn.Linear` with a oneDNN-prepacked copy of its weight for multi-row products."""

    def __init__(self, linear: torch.nn.Linear, min_rows: int, pad_rows: int = 1) -> None:
        super().__init__(linear.weight, min_rows, pad_rows)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


class PackedTiedOutput(_Packed):
    """A packed copy of a weight a model applies with `F.linear` itself (a tied output table).

    The weight and bias stay the owner's parameters, held in a tuple so that they are not
    registered twice: the owner's state dict is unchanged.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int, pad_rows: int = 1
    ) -> None:
        super().__init__(weight, min_rows, pad_rows)
        self._tied = (weight, bias)

    @property
    def weight(self) -> torch.Tensor:
        return self._tied[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, *self._tied)


def kernel_summary(model: torch.nn.Module) -> dict:
    """Which fp32 kernels a model runs: the verify cost of short rounds depends on it.

    `packed_from_rows` is the switch of the largest packed weight (the product that decides a
    step's cost); `row_plans` maps each weight shape to its (min_rows, pad_rows).
    """
    packed = [m for m in model.modules() if isinstance(m, _Packed)]
    if not packed:
        return {"prepacked": False, "packed_from_rows": None, "row_plans": {}}
    largest = max(packed, key=lambda m: m.weight.numel())
    plans = {_shape_name(m): [m.min_rows, m.pad_rows] for m in packed}
    return {"prepacked": True, "packed_from_rows": largest.min_rows, "row_plans": plans}


def _shape_name(module: _Packed) -> str:
    return "x".join(str(n) for n in module.weight.shape)


def prepack_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packable(module: torch.nn.Module) -> bool:
    return (
        type(module) is torch.nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    )


MOST_PADDED_ROWS = 8  # row counts timed for padding; larger products are never padded
PAD_TOLERANCE = 1.03  # the fewest rows within 3% of the fastest: no padding bought on noise


def row_plan(module: _Packed, repeats: int = 5, clock=time.perf_counter) -> tuple[int, int]:
    """(min_rows, pad_rows) fastest for `module`'s weight on this machine, timed on its copy.

    Which kernel is faster for one row depends on the CPU: on the 2-core Intel Xeon the
    project was first measured on, MKL (a token of the 1.5B target: 399 ms against 465 packed);
    on the 2-core AMD EPYC, the packed copy (whole decodes 1.40x faster for the 1.5B target and
    1.21x for the seq2seq verifier, `benchmarks/kernel_rows_causal.py`, `specdec_kernel_rows.py`).
    Plain decoding is the baseline of every speedup, so it gets the faster one. Small weights
    are timed over several calls a sample, so that a sample is not all timer noise.
    """
    weight = module.weight
    calls = max(1, min(200, round(2e7 / weight.numel())))
    inputs = {rows: torch.randn(rows, weight.shape[1]) for rows in range(1, MOST_PADDED_ROWS + 1)}

    def repeated(product):
        return lambda: [product() for _ in range(calls)]

    def packed(rows: int):
        return lambda: torch.ops.mkldnn._linear_pointwise(
            inputs[rows], module.packed, None, "none", [], ""
        )

    candidates = {("packed", rows): repeated(packed(rows)) for rows in inputs}
    candidates["dense", 1] = repeated(lambda: torch.nn.functional.linear(inputs[1], weight))
    with torch.inference_mode():
        return plan_from_times(best_times(candidates, repeats, clock))


def plan_from_times(times: dict[tuple[str, int], float]) -> tuple[int, int]:
    """(min_rows, pad_rows) from the best times of ("packed", rows) for 1..n rows and of
    ("dense", 1): pad to the fewest rows within `PAD_TOLERANCE` of the fastest packed product,
    and take the dense weight for one row only where it beats that."""
    packed = {rows: t for (kind, rows), t in times.items() if kind == "packed"}
    best = min(packed.values())
    pad_rows = min(rows for rows, t in packed.items() if t <= PAD_TOLERANCE * best)
    min_rows = 1 if packed[pad_rows] <= times["dense", 1] else 2
    return min_rows, pad_rows


def choose_row_plans(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Time `row_plan` once per distinct weight shape of the model's packed modules and give
    every module of that shape its plan; returns the plans by shape."""
    plans: dict[str, tuple[int, int]] = {}
    for module in model.modules():
        if isinstance(module, _Packed):
            name = _shape_name(module)
            if name not in plans:
                plans[name] = row_plan(module)
            module.min_rows, module.pad_rows = plans[name]
    return plans


def best_times(candidates: dict, repeats: int, clock=time.perf_counter) -> dict:
    """The best time of each callable: interleaved, the best of `repeats` after a warm-up."""
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(repeats + 1):  # the first round warms each up
        for key, run in candidates.items():
            start = clock()
            run()
            best[key] = min(best[key], clock() - start)
    return best


def prepack_linears(
    model: torch.nn.Module, min_rows: int | None = None, pad_rows: int | None = None
) -> torch.nn.Module:
    """Give every fp32 CPU `nn.Linear` of `model` a prepacked path, in place; returns `model`.

    The packed copy serves products of `min_rows` rows or more, and pads those of fewer than
    `pad_rows` rows with zero rows. None: timed per weight shape on this machine (`row_plan`;
    packed from 1 or 2 rows, padded up to at most `MOST_PADDED_ROWS`).
    """
    for name, value in (("min_rows", min_rows), ("pad_rows", pad_rows)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not prepack_available():
        raise RuntimeError("this torch build has no oneDNN (mkldnn) linear kernels to prepack for")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if _packable(child):
                setattr(module, name, PrepackedLinear(child, min_rows or 2, pad_rows or 1))
    set_row_plans(model, min_rows, pad_rows)
    return model


def set_row_plans(model: torch.nn.Module, min_rows: int | None, pad_rows: int | None) -> None:
    """Give the model's packed modules the given row numbers, timing those left None."""
    if min_rows is None or pad_rows is None:
        choose_row_plans(model)
    for module in model.modules():
        if isinstance(module, _Packed):
            module.min_rows = min_rows or module.min_rows
            module.pad_rows = pad_rows or module.pad_rows


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters, buffers and prepacked weight copies."""
    tensors = list(model.parameters()) + list(model.buffers())
    total = sum(t.numel() * t.element_size() for t in tensors)
    for module in model.modules():
        if isinstance(module, _Packed):
            total += module.packed.numel() * module.packed.element_size()
        elif isinstance(module, torch.ao.nn.quantized.dynamic.Linear):  # int8 weights
            bias = module.bias()
            total += module.weight().numel() + (0 if bias is None else bias.numel() * 4)
    return total


def use_prepacked(model: torch.nn.Module, enabled: bool) -> None:
    for module in model.modules():
        if isinstance(module, _Packed):
            module.enabled = enabled


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """An int8 dynamically quantized copy (Linear layers), for drafting on the CPU.

    A prepacked model is quantized from its dense weights: its `PrepackedLinear`s become int8
    like plain ones (left packed, they would silently stay fp32), and the packed copies are
    not copied on the way.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(
            unpacked_copy(model), {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )


def unpacked_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` with a plain `nn.Linear` for each `PrepackedLinear`."""
    packed = [m for m in model.modules() if isinstance(m, _Packed)]
    if any(not isinstance(m, PrepackedLinear) for m in packed):
        raise ValueError(
            "this model applies a packed copy of a weight itself (a tied output table); "
            "give it a copy method of its own, as BlockDrafter.int8 does"
        )
    clone = copy.deepcopy(model, {id(m.packed): None for m in packed})  # packed: not copied
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PrepackedLinear):
                linear = torch.nn.Linear(
                    child.in_features, child.out_features, child.bias is not None, device="meta"
                )
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
    return clone


DRAFT_PRECISIONS = ("auto", "int8", "fp32")


def cpu_fp32(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Where the CPU kernels of this module apply: packing and int8 drafting."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def int8_draft_wanted(choice: str, device: str, dtype: torch.dtype) -> bool:
    """The command lines' `--draft-precision`: "auto" drafts in int8 where it runs (fp32 models
    on the CPU), the fastest setting measured on CPU for both pairs; "int8" insists on it."""
    if choice not in DRAFT_PRECISIONS:
        raise ValueError(f"draft precision must be one of {DRAFT_PRECISIONS}, got {choice!r}")
    fits = cpu_fp32(device, dtype)
    if choice == "int8" and not fits:
        raise ValueError(
            f"an int8 drafter needs float32 models on the CPU; got {dtype} on {device}"
        )
    return choice == "int8" or (choice == "auto" and fits)
