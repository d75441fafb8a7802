"""Faster CPU kernels for the same weights: what makes a verify pass cost about one step.

Speculative decoding pays only if scoring k + 1 tokens costs about as much as scoring one. On
the CPUs this project is measured on, PyTorch's default fp32 `nn.Linear` (MKL) runs products of
a few rows at two to four times the cost of one row, which caps every speedup. Weights
reordered once for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`) run several rows in about
the time of one, but a single row is faster on one kernel or the other depending on the CPU.

`prepack_linears` therefore gives every `nn.Linear` both paths: products of fewer than
`min_rows` rows use the original weight, larger ones the prepacked copy. The switch is at 2 rows
at most: MKL's cost grows with every row from the second on, while the packed copy's 2-3 rows
cost what one does; where the one-row winner lies is timed once at load. A switch at 4 rows
made a verify pass of 1 or 2 drafted tokens cost two or three target steps, and an adaptive
length policy paid three times over for every short round.

The packed kernel itself is not monotone in the rows either: oneDNN picks its blocking by the
row count, while the attention products grow with every row. Each packed weight therefore also
has `pad_to`: the row count each short product is padded to with zero rows, the cheapest count
at or above its own (each row of a product depends on that row alone, so padding changes
nothing but the kernel). Both are timed once per distinct weight shape at load (`row_plan`),
read off median times, not the best of a few: a best time now and then shows a one-row product
as fast as five rows, and plans read off best times left it unpadded. The figures are in
docs/findings.md ("On a CPU a verify pass costs one decoding step only on the right kernels",
"Pad each short product to the cheapest row count at or above it") with their records.

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
import statistics
import time
import warnings

import torch


def padding_up_to(pad_rows: int) -> tuple[int, ...]:
    """`pad_to` that pads every product of fewer than `pad_rows` rows up to `pad_rows`."""
    return (pad_rows,) * (pad_rows - 1)


def checked_padding(pad_to) -> tuple[int, ...]:
    """`pad_to` as a tuple, refused unless each count is at least its own row count; counts
    equal to their own at the end are dropped (rows past the end are not padded)."""
    pad_to = tuple(int(n) for n in pad_to)
    short = [(rows, n) for rows, n in enumerate(pad_to, 1) if n < rows]
    if short:
        raise ValueError(f"pad_to must pad each row count up, not down: (rows, to) {short}")
    while pad_to and pad_to[-1] == len(pad_to):
        pad_to = pad_to[:-1]
    return pad_to


class _Packed(torch.nn.Module):
    """A oneDNN-prepacked copy of a weight, used for products of at least `min_rows` rows;
    a product of r rows, r <= len(pad_to), is padded with zero rows up to `pad_to[r - 1]`."""

    def __init__(self, weight: torch.Tensor, min_rows: int, pad_to=()) -> None:
        super().__init__()
        self.min_rows = min_rows
        self.pad_to = pad_to
        self.enabled = True
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    @property
    def pad_to(self) -> tuple[int, ...]:
        return self._pad_to

    @pad_to.setter
    def pad_to(self, pad_to) -> None:
        self._pad_to = checked_padding(pad_to)

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """x @ weight.T + bias, by the packed copy when there are enough rows (inference only);
        a short product is padded with zero rows as `pad_to` says."""
        rows = x.numel() // weight.shape[1]
        if not self.enabled or rows < self.min_rows or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, weight, bias)
        bias = None if bias is None else bias.detach()
        to = self.pad_to[rows - 1] if rows <= len(self.pad_to) else rows
        if to == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(to - rows, flat.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(padded, self.packed, bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])  # [..., out_features]


class PrepackedLinear(_Packed):
    """`nn.Linear` with a oneDNN-prepacked copy of its weight for multi-row products."""

    def __init__(self, linear: torch.nn.Linear, min_rows: int, pad_to=()) -> None:
        super().__init__(linear.weight, min_rows, pad_to)
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
        self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int, pad_to=()
    ) -> None:
        super().__init__(weight, min_rows, pad_to)
        self._tied = (weight, bias)

    @property
    def weight(self) -> torch.Tensor:
        return self._tied[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, *self._tied)


def kernel_summary(model: torch.nn.Module) -> dict:
    """Which fp32 kernels a model runs: the verify cost of short rounds depends on it.

    `packed_from_rows` is the switch of the largest packed weight (the product that decides a
    step's cost); `row_plans` maps each weight shape to [min_rows, pad_to], pad_to listing the
    row count that a product of 1, 2, ... rows is padded to.
    """
    packed = [m for m in model.modules() if isinstance(m, _Packed)]
    if not packed:
        return {"prepacked": False, "packed_from_rows": None, "row_plans": {}}
    largest = max(packed, key=lambda m: m.weight.numel())
    plans = {_shape_name(m): [m.min_rows, list(m.pad_to)] for m in packed}
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
Plan = tuple[int, tuple[int, ...]]  # (min_rows, pad_to)


def row_plan(module: _Packed, repeats: int = 7, clock=time.perf_counter) -> Plan:
    """(min_rows, pad_to) fastest for `module`'s weight on this machine, timed on its copy.

    Which kernel is faster for one row depends on the CPU: on the 2-core Intel Xeon the
    project was first measured on, MKL; on the 2-core AMD EPYC, the packed copy
    (benchmarks/studies/kernel-rows-causal/ and benchmarks/studies/specdec-kernel-rows/ have
    the figures).
    Plain decoding is the baseline of every speedup, so it gets the faster one.
    """
    candidates = product_candidates(module, range(1, MOST_PADDED_ROWS + 1))
    with torch.inference_mode():
        return plan_from_times(median_times(candidates, repeats, clock))


def calls_per_sample(weight: torch.Tensor) -> int:
    """Products a timing sample runs: several for small weights, so that a sample is not all
    timer noise."""
    return max(1, min(200, round(2e7 / weight.numel())))


def product_candidates(module: _Packed, row_counts) -> dict:
    """Callables timing `module`'s packed product at each row count ("packed", rows) and the
    dense one-row product ("dense", 1), each `calls_per_sample` products long."""
    weight = module.weight
    calls = calls_per_sample(weight)
    inputs = {rows: torch.randn(rows, weight.shape[1]) for rows in {1, *row_counts}}

    def repeated(product):
        return lambda: [product() for _ in range(calls)]

    def packed(rows: int):
        return lambda: torch.ops.mkldnn._linear_pointwise(
            inputs[rows], module.packed, None, "none", [], ""
        )

    candidates = {("packed", rows): repeated(packed(rows)) for rows in row_counts}
    candidates["dense", 1] = repeated(lambda: torch.nn.functional.linear(inputs[1], weight))
    return candidates


def plan_from_times(times: dict[tuple[str, int], float]) -> Plan:
    """(min_rows, pad_to) from the times of ("packed", rows) for 1..n rows and of ("dense", 1):
    a product of r rows is padded to the fewest rows, r or more, within `PAD_TOLERANCE` of the
    fastest packed product of r or more rows; one row takes the dense weight only where that
    beats its padded packed product."""
    packed = {rows: t for (kind, rows), t in times.items() if kind == "packed"}
    pad_to = []
    for rows in sorted(packed):
        above = {n: t for n, t in packed.items() if n >= rows}
        best = min(above.values())
        pad_to.append(min(n for n, t in above.items() if t <= PAD_TOLERANCE * best))
    min_rows = 1 if packed[pad_to[0]] <= times["dense", 1] else 2
    return min_rows, checked_padding(pad_to)


def choose_row_plans(model: torch.nn.Module) -> dict[str, Plan]:
    """Time `row_plan` once per distinct weight shape of the model's packed modules and give
    every module of that shape its plan; returns the plans by shape."""
    plans: dict[str, Plan] = {}
    for module in model.modules():
        if isinstance(module, _Packed):
            name = _shape_name(module)
            if name not in plans:
                plans[name] = row_plan(module)
            module.min_rows, module.pad_to = plans[name]
    return plans


def timed_samples(candidates: dict, repeats: int, clock=time.perf_counter) -> dict:
    """`repeats` times of each callable, interleaved round by round, after a warm-up round."""
    times: dict = {key: [] for key in candidates}
    for round_ in range(repeats + 1):
        for key, run in candidates.items():
            start = clock()
            run()
            if round_:  # the first round warms each up
                times[key].append(clock() - start)
    return times


def median_times(candidates: dict, repeats: int, clock=time.perf_counter) -> dict:
    """The typical time of each callable: the median of `timed_samples`. A real pass pays the
    typical time; the best of a few is an occasional fast run."""
    samples = timed_samples(candidates, repeats, clock)
    return {key: statistics.median(seen) for key, seen in samples.items()}


def prepack_linears(
    model: torch.nn.Module, min_rows: int | None = None, pad_rows: int | None = None
) -> torch.nn.Module:
    """Give every fp32 CPU `nn.Linear` of `model` a prepacked path, in place; returns `model`.

    The packed copy serves products of `min_rows` rows or more, and pads those of fewer than
    `pad_rows` rows with zero rows up to `pad_rows` (1: no padding). None: timed per weight
    shape on this machine (`row_plan`; packed from 1 or 2 rows, each short row count padded to
    the cheapest count at or above it, up to `MOST_PADDED_ROWS`).
    """
    for name, value in (("min_rows", min_rows), ("pad_rows", pad_rows)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not prepack_available():
        raise RuntimeError("this torch build has no oneDNN (mkldnn) linear kernels to prepack for")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if _packable(child):
                setattr(module, name, PrepackedLinear(child, min_rows or 2))
    set_row_plans(model, min_rows, pad_rows)
    return model


def set_row_plans(model: torch.nn.Module, min_rows: int | None, pad_rows: int | None) -> None:
    """Give the model's packed modules the given row numbers, timing those left None
    (`pad_rows` p pads every product of fewer than p rows up to p)."""
    if min_rows is None or pad_rows is None:
        choose_row_plans(model)
    for module in model.modules():
        if isinstance(module, _Packed):
            module.min_rows = min_rows or module.min_rows
            module.pad_to = module.pad_to if pad_rows is None else padding_up_to(pad_rows)


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


def cpu_fp32(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Where the CPU kernels of this module apply: packing and int8 drafting."""
    return torch.device(device).type == "cpu" and dtype == torch.float32
