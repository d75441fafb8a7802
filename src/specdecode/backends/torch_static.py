"""A static KV cache with per-row write offsets, in fixed shapes that compile and capture.

Where `torch_eager.CachedModel` grows a `DynamicCache` (every append copies the cache, rollback
leaves holes that need compaction, every round has new shapes), `StaticCachedModel` keeps, per
layer, one preallocated buffer `[rows, kv_heads, capacity + 1, head_dim]` and writes each new
token at its row's own position (gpt-fast's layout, batched):

* slot `p` of row `b` holds the key and value of the token at position `p` of that row; the
  last slot (`capacity`) is scratch, where holes (padding) write and no query ever looks;
* a query at position `p` sees slots `0 .. p` of its row: the row's history plus what this
  pass wrote, never a stale slot past it;
* rollback (`truncate`) is moving a row's length back: the rejected slots are overwritten by
  the next pass. No holes, no compaction, no copy per append;
* the mask and the positions come from here, through transformers' public inputs (a 4-D mask is
  used as given; `position_ids`), and the cache goes in through the `Cache` interface, so any
  decoder with full attention in every layer runs unchanged.

Fixed shapes: rows are padded to a bucket (1, 2, 4, 8, then multiples of 8) and blocks of up
to `MAX_FIXED_WIDTH` tokens (a decoding step, a verify pass of k + 1 positions) to a width
bucket. On a GPU those passes are captured by hand as CUDA graphs (`cuda_graphs`), one per row
bucket x width bucket, at first use; `compile` runs them through `torch.compile` instead
("reduce-overhead": CUDA graphs after inductor's compile, tens of seconds a shape). Longer
blocks (a prompt's prefill) run uncaptured.

Buffers that never move: each layer's keys and values are allocated once for the largest row
bucket and the capacity asked for (`capacity`, else grown in powers of two), and a row bucket
is a view of their first rows, so every graph captured over them stays valid when rows leave
(the live rows are copied to the front) or a smaller batch starts. Only outgrowing them
reallocates, which voids the graphs (captured again at next use). A pass adds no host sync:
lengths, positions, write slots and the mask are computed on the device; the capacity check
reads the longest row only when a host-side upper bound says it might not fit (rarely).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdecode.backends.base import PendingFromLengths, StepFromForward
from specdecode.backends.cuda_graphs import CapturedPasses
from specdecode.backends.torch_eager import (
    TorchDecoderInfo,
    cache_argument,
    check_rollback_support,
    model_device,
)

MAX_FIXED_WIDTH = 16
WIDTH_BUCKETS = (1, 2, 4, 8, 16)
MIN_CAPACITY = 256


def row_bucket(rows: int) -> int:
    """Rows padded to 1, 2, 4, 8, then multiples of 8 (vLLM's capture sizes): few shapes, and
    a batch of 40 costs 40 rows, not 64."""
    if rows <= 8:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 8) * 8


def width_bucket(width: int) -> int:
    return next(w for w in WIDTH_BUCKETS if w >= width)


class RowOffsetLayer(CacheLayerMixin):
    """One layer's keys and values; `update` writes each new position at its row's own slot."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: RowOffsetCache) -> None:
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers come from owner
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [rows, kv_heads, n, head_dim]
        index = self.owner.write_index[:, None, :, None].expand_as(key_states)  # [r, h, n, d]
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys, self.values  # [rows, kv_heads, capacity + 1, head_dim]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # positions come from the engine, never from here

    def get_max_length(self) -> int:
        return self.keys.shape[2] - 1


class RowOffsetCache(Cache):
    """The `Cache` a transformers decoder writes into; `write_index` [rows, n] is set per pass.

    Each layer's buffers are allocated once (`allocate`) for the most rows and the capacity
    needed; the layers see a view of their first `rows` rows (`use`): a graph captured over
    them stays valid until they are allocated again."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[RowOffsetLayer(self) for _ in range(num_layers)])
        self.write_index: torch.Tensor | None = None
        self.full: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: keys, values

    @property
    def allocated_rows(self) -> int:
        return self.full[0][0].shape[0] if self.full else 0

    def allocate(self, shapes: list[tuple[int, int, torch.dtype]], rows: int, capacity: int,
                 device: torch.device, keep: torch.Tensor | None = None) -> None:  # fmt: skip
        """New buffers `[rows, kv_heads, capacity + 1, head_dim]` (`shapes[i]`: layer i's
        kv_heads, head_dim, dtype), zeroed; `keep`: rows of the old ones copied to the front,
        with the slots both capacities hold. The layers see none of them until `use`."""
        with torch.inference_mode(False):  # buffers for life: written in and out of it
            self._allocate(shapes, rows, capacity, device, keep)

    def _allocate(self, shapes, rows, capacity, device, keep) -> None:
        full = []
        for i, (heads, dim, dtype) in enumerate(shapes):
            pair = []
            for j in range(2):  # keys, values
                new = torch.zeros((rows, heads, capacity + 1, dim), dtype=dtype, device=device)
                if keep is not None and len(keep):
                    old = self.full[i][j].index_select(0, keep)
                    slots = min(capacity, old.shape[2] - 1)
                    new[: len(keep), :, :slots] = old[:, :, :slots]
                pair.append(new)
            full.append((pair[0], pair[1]))
        self.full = full

    def use(self, rows: int) -> None:
        """The layers see the first `rows` rows of the buffers: a view, no copy."""
        for layer, (keys, values) in zip(self.layers, self.full, strict=True):
            layer.keys, layer.values = keys[:rows], values[:rows]
            torch._dynamo.mark_static_address(layer.keys)  # compiled graphs write in place
            torch._dynamo.mark_static_address(layer.values)

    def compact(self, keep: torch.Tensor) -> None:
        """Rows `keep` (in this order) move to the front of the buffers, in place."""
        for keys, values in self.full:
            keys[: len(keep)] = keys.index_select(0, keep)
            values[: len(keep)] = values.index_select(0, keep)


class StaticCachedModel(PendingFromLengths, StepFromForward, TorchDecoderInfo):
    """A transformers decoder over a `RowOffsetCache`: the `ModelBackend` of fixed shapes.

    `capture`: CUDA graphs captured by hand (default: on a CUDA device unless `compile`);
    `compile`: `torch.compile` the fixed-shape passes instead; `capacity`: tokens a row may
    hold, so the cache is allocated once at it (rows outgrowing it still grow it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        role: str = "model",
        compile: bool = False,
        capture: bool | None = None,
        capacity: int | None = None,
    ) -> None:
        probe = check_rollback_support(model, role)  # a one-token DynamicCache
        # (kv_heads, head_dim, dtype) of each layer, as the probe's cache holds them
        self.shapes = [(la.keys.shape[1], la.keys.shape[3], la.keys.dtype) for la in probe.layers]
        self.model = model
        self.role = role
        self.device = model_device(model)
        self.cache_argument = cache_argument(model)
        self.cache = RowOffsetCache(len(self.shapes))
        if capture is None:
            capture = self.device.type == "cuda" and not compile
        if capture and compile:
            raise ValueError("capture and compile are two ways to the same graphs: choose one")
        self.compiled = compile
        self.graphs: CapturedPasses | None = None
        self._run = self._pass
        if capture:
            self.graphs = CapturedPasses(self._pass)
            self._run = self.graphs
        elif compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._run = torch.compile(self._pass, dynamic=False, mode=mode)
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else (
                "cache_size_limit")  # fmt: skip
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
        # a power of two, as growth keeps it
        self.min_capacity = 1 << (capacity - 1).bit_length() if capacity else MIN_CAPACITY
        self.phys_rows = 0
        self.capacity = 0
        self.reset(0)

    @property
    def fixed_shapes(self) -> bool:
        """Whether short passes run in bucketed shapes (captured or compiled)."""
        return self.compiled or self.graphs is not None

    def reset(self, batch_size: int) -> None:
        """Empty rows; the buffers are kept where they hold the new batch (their addresses are
        what a captured graph writes to), stale slots are never read."""
        rows = row_bucket(batch_size) if batch_size else 0
        if rows > self.cache.allocated_rows or self.capacity == 0:
            self.capacity = max(self.capacity, self.min_capacity)
            self._allocate(max(rows, self.cache.allocated_rows), None)
        self.cache.use(rows)
        self.phys_rows = rows
        self.rows = torch.arange(batch_size, device=self.device)  # physical row of each row
        self.phys_lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.bound = 0  # host-side upper bound of the longest row

    def _allocate(self, rows: int, keep: torch.Tensor | None) -> None:
        self.cache.allocate(self.shapes, rows, self.capacity, self.device, keep)
        if self.graphs is not None:
            self.graphs.clear()

    @property
    def capture_times(self) -> list:
        """Each graph's capture (`cuda_graphs.CaptureTime`), in order; empty uncaptured."""
        return list(self.graphs.times) if self.graphs is not None else []

    @property
    def capture_failure(self) -> str | None:
        """Why the passes run uncaptured though capture was asked for (None: they do not)."""
        return self.graphs.failed if self.graphs is not None else None

    @property
    def lengths(self) -> torch.Tensor:
        return self.phys_lengths.index_select(0, self.rows)  # [batch]

    def _pass(self, tokens, valid, lengths, want_hidden: bool):
        """One pass over physical rows: tokens, valid [rows, n]; lengths [rows]."""
        capacity = self.cache.layers[0].keys.shape[2] - 1
        positions = lengths[:, None] + valid.long().cumsum(1) - 1  # [rows, n]
        positions = positions.clamp(min=0)
        self.cache.write_index = torch.where(valid, positions, capacity)  # holes: scratch
        slots = torch.arange(capacity + 1, device=tokens.device)
        seen = slots[None, None, :] <= positions[:, :, None]  # [rows, n, capacity + 1]
        dtype = self.shapes[0][2]
        mask = torch.zeros(seen.shape, dtype=dtype, device=tokens.device)
        mask = mask.masked_fill(~seen, torch.finfo(dtype).min)[:, None]  # [rows, 1, n, cap + 1]
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_argument: self.cache},
            output_hidden_states=want_hidden,
        )
        hidden = out.hidden_states[-1] if want_hidden else None
        return out.logits, hidden, lengths + valid.sum(1)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 1,
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write a ragged block at every row's own offset; logits (and last hidden states) of
        its last `logits_to_keep` positions. tokens, valid: [batch, n]."""
        n = tokens.shape[1]
        self._fit(n)
        fixed = self.fixed_shapes and n <= MAX_FIXED_WIDTH
        width = width_bucket(n) if fixed else n
        run = self._run if fixed else self._pass
        tokens_p = tokens.new_zeros(self.phys_rows, width)  # [rows, width]; padding: holes
        valid_p = valid.new_zeros(self.phys_rows, width)
        tokens_p[self.rows, :n] = tokens
        valid_p[self.rows, :n] = valid
        logits, hidden, lengths = run(tokens_p, valid_p, self.phys_lengths, want_hidden)
        # a graph's outputs are its own memory, rewritten by its next replay: keep copies
        # (indexing by rows copies the logits and hidden states kept)
        self.phys_lengths = lengths.clone() if fixed else lengths
        keep = slice(n - logits_to_keep, n)
        logits = logits[self.rows, keep].float()  # [batch, keep, vocab]
        return logits, hidden[self.rows, keep] if hidden is not None else None

    def _fit(self, n: int) -> None:
        """Grow the capacity (a power of two, one copy) before a pass could overrun it."""
        self.bound += n
        if self.bound < self.capacity:
            return
        longest = int(self.phys_lengths.max()) if self.phys_rows else 0
        self.bound = longest + n
        if self.bound >= self.capacity:
            self.capacity = 1 << self.bound.bit_length()  # the next power of two past it
            live = torch.arange(self.phys_rows, device=self.device)
            self._allocate(self.cache.allocated_rows, live)
            self.cache.use(self.phys_rows)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep the first `lengths[b]` tokens of each row: a moved offset, nothing else."""
        lengths = torch.minimum(self.lengths, lengths.to(self.device))  # [batch]
        self.phys_lengths = self.phys_lengths.index_put((self.rows,), lengths)

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> list[int]:
        """Rows of a captured batch are fixed for its life: refused, with what to use."""
        raise ValueError(
            "the torch-static backend decodes fixed batches: rows cannot join a running batch; "
            "serve with the llama.cpp or torch backend"
        )

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows; the live ones move to the front of the buffers when the row
        bucket shrinks (one copy in place), so the graphs of the smaller bucket stay valid."""
        self.rows = self.rows.index_select(0, rows.to(self.device))
        rows_now = row_bucket(len(self.rows)) if len(self.rows) else 0
        if rows_now < self.phys_rows:
            keep = torch.cat([self.rows, self._spare_rows(rows_now - len(self.rows))])
            self.cache.compact(keep)
            self.cache.use(rows_now)
            self.phys_lengths = self.phys_lengths.index_select(0, keep)
            self.phys_rows = rows_now
            self.rows = torch.arange(len(self.rows), device=self.device)

    def _spare_rows(self, count: int) -> torch.Tensor:
        """Physical rows no running row uses, to pad a shrunk batch to its bucket."""
        free = torch.ones(self.phys_rows, dtype=torch.bool, device=self.device)
        free[self.rows] = False
        return free.nonzero().flatten()[:count]
