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

Fixed shapes: rows are padded to a bucket (1, 2, 4, 8, then multiples of 8), the capacity grows
in powers of two, and when `compile` is on, blocks of up to `MAX_COMPILED_WIDTH` tokens (a
decoding step, a verify pass of k + 1 positions) are padded to a width bucket and run through one
`torch.compile`d function, with CUDA graphs on a GPU ("reduce-overhead"). Longer blocks (a
prompt's prefill) run the same function uncompiled. A pass adds no host sync: lengths, positions,
write slots and the mask are computed on the device; the capacity check reads the longest row
only when a host-side upper bound says it might not fit (rarely).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdecode.backends.base import PendingFromLengths
from specdecode.backends.torch_eager import (
    TorchDecoderInfo,
    cache_argument,
    check_rollback_support,
    model_device,
)

MAX_COMPILED_WIDTH = 16
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


def capacity_bucket(length: int) -> int:
    return max(MIN_CAPACITY, 1 << max(length - 1, 0).bit_length())


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
    """The `Cache` a transformers decoder writes into; `write_index` [rows, n] is set per pass."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[RowOffsetLayer(self) for _ in range(num_layers)])
        self.write_index: torch.Tensor | None = None

    def allocate(self, shapes: list[tuple[int, int, torch.dtype]], rows: int, capacity: int,
                 device: torch.device) -> None:  # fmt: skip
        """Fresh zeroed buffers: `shapes[i]` is layer i's (kv_heads, head_dim, dtype)."""
        for layer, (heads, dim, dtype) in zip(self.layers, shapes, strict=True):
            size = (rows, heads, capacity + 1, dim)
            layer.keys = torch.zeros(size, dtype=dtype, device=device)
            layer.values = torch.zeros(size, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(layer.keys)  # captured graphs write in place
            torch._dynamo.mark_static_address(layer.values)

    def reshape(self, rows: torch.Tensor, capacity: int) -> None:
        """Keep only these rows (in this order) and `capacity` slots, copying once."""
        for layer in self.layers:
            keep = min(capacity, layer.keys.shape[2] - 1)
            for name in ("keys", "values"):
                old = getattr(layer, name).index_select(0, rows)
                new = old.new_zeros(old.shape[0], old.shape[1], capacity + 1, old.shape[3])
                new[:, :, :keep] = old[:, :, :keep]
                torch._dynamo.mark_static_address(new)
                setattr(layer, name, new)


class StaticCachedModel(PendingFromLengths, TorchDecoderInfo):
    """A transformers decoder over a `RowOffsetCache`: the `ModelBackend` of fixed shapes."""

    def __init__(self, model: torch.nn.Module, role: str = "model", compile: bool = False) -> None:
        probe = check_rollback_support(model, role)  # a one-token DynamicCache
        # (kv_heads, head_dim, dtype) of each layer, as the probe's cache holds them
        self.shapes = [(la.keys.shape[1], la.keys.shape[3], la.keys.dtype) for la in probe.layers]
        self.model = model
        self.role = role
        self.device = model_device(model)
        self.cache_argument = cache_argument(model)
        self.cache = RowOffsetCache(len(self.shapes))
        self.compiled = compile
        self._run = self._pass
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._run = torch.compile(self._pass, dynamic=False, mode=mode)
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else (
                "cache_size_limit")  # fmt: skip
            setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
        self.phys_rows = 0
        self.capacity = 0
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        """Empty rows; buffers of the same shape are kept (their addresses are what a captured
        graph writes to), stale slots are never read."""
        rows = row_bucket(batch_size) if batch_size else 0
        if rows != self.phys_rows or self.capacity == 0:
            self.capacity = MIN_CAPACITY
            self.cache.allocate(self.shapes, rows, self.capacity, self.device)
            self.phys_rows = rows
        self.rows = torch.arange(batch_size, device=self.device)  # physical row of each row
        self.phys_lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.bound = 0  # host-side upper bound of the longest row

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
        width = width_bucket(n) if self.compiled and n <= MAX_COMPILED_WIDTH else n
        run = self._run if width <= MAX_COMPILED_WIDTH else self._pass
        tokens_p = tokens.new_zeros(self.phys_rows, width)  # [rows, width]; padding: holes
        valid_p = valid.new_zeros(self.phys_rows, width)
        tokens_p[self.rows, :n] = tokens
        valid_p[self.rows, :n] = valid
        logits, hidden, lengths = run(tokens_p, valid_p, self.phys_lengths, want_hidden)
        if self.compiled and self.device.type == "cuda":  # a replay reuses its outputs' memory
            logits, lengths = logits.clone(), lengths.clone()
            hidden = hidden.clone() if hidden is not None else None
        self.phys_lengths = lengths
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
            self.capacity = capacity_bucket(self.bound + 1)
            identity = torch.arange(self.phys_rows, device=self.device)
            self.cache.reshape(identity, self.capacity)

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
        """Keep only these rows; the buffers shrink (one copy) when the row bucket does."""
        self.rows = self.rows.index_select(0, rows.to(self.device))
        rows_now = row_bucket(len(self.rows)) if len(self.rows) else 0
        if rows_now < self.phys_rows:
            keep = torch.cat([self.rows, self._spare_rows(rows_now - len(self.rows))])
            self.cache.reshape(keep, self.capacity)
            self.phys_lengths = self.phys_lengths.index_select(0, keep)
            self.phys_rows = rows_now
            self.rows = torch.arange(len(self.rows), device=self.device)

    def _spare_rows(self, count: int) -> torch.Tensor:
        """Physical rows no running row uses, to pad a shrunk batch to its bucket."""
        free = torch.ones(self.phys_rows, dtype=torch.bool, device=self.device)
        free[self.rows] = False
        return free.nonzero().flatten()[:count]
