"""Per-row KV-cache rollback for a batch whose rows accept different numbers of tokens.

Design: one physical `transformers.DynamicCache` shared by the batch, plus a per-row logical view.

* Every forward appends the same number of physical slots to every row (that is what a batched
  matmul wants), but each slot carries a *logical position* in its row, or -1 for a hole.
  `slot_pos: [batch, physical_len]` is the whole bookkeeping.
* A row that rejects drafted tokens does not re-run anything: `truncate(lengths)` turns the
  rejected slots into holes. The attention mask handed to the model is `slot_pos >= 0`, and
  position ids are the logical positions, so the model sees each row as if the holes were not
  there (rotary or learned positions stay contiguous per row).
* Holes at the right end that every row shares are cropped; when holes pile up inside the cache
  (they cost attention FLOPs and memory), `compact` gathers each row's valid slots to the right,
  keeping order. One gather per layer; `DynamicCache` already copies the cache on every append,
  so this costs about one step's cache traffic and happens only every few steps.
* Rows that finish are dropped from the batch (`select_rows`), so they stop costing compute.
* Ragged inputs (a prompt batch of different lengths, or a drafter catching up on one or two
  tokens per row) use the same mechanism: a block is left-padded with hole slots.

Why not a static cache with per-row write pointers: `transformers` attention layers write a
shared `cache_position` for the whole batch, so per-row offsets would need a custom attention
path per architecture. This design uses only public model inputs (`attention_mask`,
`position_ids`, and the cache: `cache`, `past_key_values` in older releases) and works for any
decoder whose cache is a plain `DynamicCache` of full-attention layers. Models whose cache cannot
be rolled back this way (sliding-window layers drop old slots; recurrent or linear-attention states
cannot be truncated) are refused by `check_rollback_support` at set-up.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdecode.backends.base import PendingFromLengths, StepFromForward

HOLE = -1


class UnsupportedModelError(ValueError):
    """The model cannot be used by the engine (its cache cannot be rolled back per row)."""


def check_rollback_support(model: torch.nn.Module, role: str) -> DynamicCache:
    """Refuse, loudly and before any decoding, a model whose cache cannot be truncated per row.

    Returns the cache of the one-token probe it ran, whose layers show each layer's key and
    value shapes (what a static cache preallocates)."""
    config = model.config
    name = f"{role} ({type(model).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; the causal-LM engine needs a decoder-only model"
        )
    params = inspect.signature(model.forward).parameters
    for arg in ("attention_mask", "position_ids", cache_argument(model)):
        if arg not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise UnsupportedModelError(
                f"{name}.forward takes no `{arg}`; per-row rollback needs it"
            )
    cache = DynamicCache(config=config)
    bad = sorted(
        {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    )
    if bad:
        raise UnsupportedModelError(
            f"{name} uses cache layers {bad} (sliding-window or non-attention state), which cannot "
            "be rolled back per row by truncation; use a model with full attention in every layer"
        )
    probe = torch.zeros(1, 1, dtype=torch.long, device=model_device(model))
    with torch.no_grad():
        out = model(input_ids=probe, use_cache=True, **cache_kwargs(model, cache))
    returned = returned_cache(out)
    if returned is not cache or any(type(x) is not DynamicLayer for x in cache.layers):
        raise UnsupportedModelError(
            f"{name} returned a {type(returned).__name__} cache instead of the "
            "DynamicCache it was given; its state cannot be rolled back per row"
        )
    return cache


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which `model.forward` takes its KV cache.

    transformers renamed `past_key_values` to `cache` (5.24 still accepts the old name, with a
    FutureWarning, until 5.40); the lowest supported release (4.56) knows only the old one. The
    forward's own signature says which this model has (`deprecate_kwarg` keeps `__wrapped__`, so
    `inspect.signature` sees the real parameters). A forward with neither (remote code taking
    `**kwargs`) gets the old name, which every release still routes.
    """
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """`{name: cache}` for a forward call, under the name this model takes (`cache_argument`)."""
    return {cache_argument(model): cache}


def returned_cache(out):
    """The cache a forward returned: `out.cache` where the output class has that field, else
    `out.past_key_values` (releases before the rename; reading it on newer ones logs a warning)."""
    if "cache" in getattr(out, "__dataclass_fields__", {}):
        return out.cache
    return out.past_key_values


def shaped(layer) -> bool:
    """Whether a cache layer holds keys [rows, heads, slots, dim]: a batch that emptied holds
    [0, heads, slots, dim], no element yet a shape that every later append and mask must
    match, so it is cropped and grown with the others."""
    return layer.keys is not None and layer.keys.dim() == 4


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def context_length(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's config admits (None if it names none)."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class TorchDecoderInfo:
    """What the engine asks of a transformers decoder's backend besides passes (`self.model`)."""

    model: torch.nn.Module
    moving_pages = False  # its weights stay where they loaded: prices always see them there

    @property
    def vocab_size(self) -> int:
        """Logits per position (families pad the embedding past the tokenizer's size)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def context_length(self) -> int | None:
        return context_length(self.model)

    def stop_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence ids the model's generation config names."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        return tuple(sorted([eos] if isinstance(eos, int) else (eos or [])))


class CachedModel(PendingFromLengths, StepFromForward, TorchDecoderInfo):
    """A decoder plus its ragged per-row cache: forward appends, truncate rolls back."""

    def __init__(
        self, model: torch.nn.Module, role: str = "model", compact_min_holes: int = 8
    ) -> None:
        check_rollback_support(model, role)
        self.model = model
        self.device = model_device(model)
        self.cache_argument = cache_argument(model)
        self.compact_min_holes = compact_min_holes
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def _rollback_layers(self) -> list:
        """The cache layers whose slots follow `slot_pos` (all layers of a decoder-only model)."""
        return self.cache.layers

    @property
    def physical_len(self) -> int:
        return self.slot_pos.shape[1]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 1,
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append a ragged block and return the logits (and last hidden states) of its end.

        tokens, valid: [batch, n] (invalid entries are holes: any token id, masked out)
        returns logits [batch, logits_to_keep, vocab], hidden [batch, logits_to_keep, hidden]
        """
        positions = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [batch, n]
        new_pos = torch.where(valid, positions, HOLE)  # [batch, n]
        mask = torch.cat([self.slot_pos >= 0, valid], dim=1).long()  # [batch, physical + n]
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions.clamp(min=0),
            use_cache=True,
            **{self.cache_argument: self.cache},
            logits_to_keep=logits_to_keep,
            output_hidden_states=want_hidden,
        )
        self.slot_pos = torch.cat([self.slot_pos, new_pos], dim=1)
        self.lengths = self.lengths + valid.sum(1)
        hidden = out.hidden_states[-1][:, -logits_to_keep:] if want_hidden else None
        return out.logits, hidden

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` logical tokens of each row (bookkeeping only)."""
        # lengths: [batch]
        lengths = torch.minimum(self.lengths, lengths.to(self.device))
        self.slot_pos = self.slot_pos.masked_fill(self.slot_pos >= lengths[:, None], HOLE)
        self.lengths = lengths
        self._crop_and_compact()

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> list[int]:
        """Append an empty row per prompt: every physical slot of it a hole (no prefix reuse
        here: rows share one cache tensor, and a finished row's slots leave with it)."""
        count = len(prompts)
        for layer in self._rollback_layers():
            if shaped(layer):
                _, h, n, d = layer.keys.shape
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(count, h, n, d)])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(count, h, n, d)])
        holes = torch.full((count, self.physical_len), HOLE, dtype=torch.long, device=self.device)
        self.slot_pos = torch.cat([self.slot_pos, holes])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])
        return [0] * count

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows stop costing compute)."""
        rows = rows.to(self.device)
        for layer in self._rollback_layers():
            if shaped(layer):
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
        self.slot_pos = self.slot_pos.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self._crop_and_compact()

    def _crop_and_compact(self) -> None:
        occupied = (self.slot_pos >= 0).any(0).nonzero()
        keep = int(occupied[-1]) + 1 if occupied.numel() else 0
        if keep < self.physical_len:
            self._crop(keep)
        holes = self.physical_len - int(self.lengths.min()) if self.lengths.numel() else 0
        if holes > max(self.compact_min_holes, self.physical_len // 4):
            self.compact()

    def _crop(self, keep: int) -> None:
        for layer in self._rollback_layers():
            if shaped(layer):
                layer.keys = layer.keys[:, :, :keep]
                layer.values = layer.values[:, :, :keep]
        self.slot_pos = self.slot_pos[:, :keep]

    def compact(self) -> None:
        """Move each row's valid slots to the right end, in order; holes go to the left."""
        width = int(self.lengths.max())
        # stable sort on validity: holes (0) first, valid slots (1) after, in physical order
        order = torch.sort((self.slot_pos >= 0).int(), dim=1, stable=True).indices
        index = order[:, self.physical_len - width :]  # [batch, width]
        for layer in self._rollback_layers():
            if shaped(layer):
                b, h, _, d = layer.keys.shape
                gather = index[:, None, :, None].expand(b, h, width, d)
                layer.keys = layer.keys.gather(2, gather)
                layer.values = layer.values.gather(2, gather)
        self.slot_pos = self.slot_pos.gather(1, index)
