"""An encoder-decoder target for the core engine: encode once, then a ragged decoder cache.

`CachedSeq2Seq` has the interface of `backends.torch_eager.CachedModel` (forward a ragged block,
truncate per row, select rows), so `engine.decode` and `speculative_step` run seq2seq models
unchanged. What differs:

* The encoder runs once per input (`encode`); its states and mask follow the rows through
  `select_rows`, as does the cross-attention cache (computed on the first decoder call).
* Only the decoder's self-attention cache is rolled back.
* Per-row positions. `transformers` encoder-decoder decoders derive positions from the cache
  length, which is wrong for a row with holes. Marian, BART, mBART and Pegasus use an
  absolute position table (an `nn.Embedding`, BART-style ones offset by 2), so a thin wrapper
  (`RowPositions`) looks up the logical positions during our forwards and is transparent
  otherwise (`generate` still works).
  Families without such a module (T5: relative position bias from physical indices) are exact at
  batch size 1, where the cache never has holes, and are refused above it with a clear error.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, EncoderDecoderCache

from specdecode.backends.torch_eager import (
    HOLE,
    CachedModel,
    UnsupportedModelError,
    cache_argument,
    model_device,
)


class RowPositions(torch.nn.Module):
    """Wraps a decoder's position embedding so that a forward can supply per-row positions."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.position_ids: torch.Tensor | None = None  # [batch, n] while one of our forwards runs

    def forward(self, shape_or_ids, past_key_values_length: int = 0, position_ids=None):
        if self.position_ids is None:
            return self.inner(shape_or_ids, past_key_values_length, position_ids=position_ids)
        # a table lookup at the logical positions (BART-style tables are offset by 2)
        offset = getattr(self.inner, "offset", 0)
        return torch.nn.Embedding.forward(self.inner, self.position_ids + offset)  # [b, n, d]


def install_row_positions(model: torch.nn.Module) -> RowPositions | None:
    """Install (once) the position wrapper on the decoder; None if the family has no hook."""
    decoder = model.get_decoder()
    current = getattr(decoder, "embed_positions", None)
    if isinstance(current, RowPositions):
        return current
    if not isinstance(current, torch.nn.Embedding):
        return None  # e.g. T5: relative position bias, no absolute table to index
    wrapper = RowPositions(current)
    decoder.embed_positions = wrapper
    return wrapper


def check_seq2seq_support(model: torch.nn.Module, role: str) -> None:
    if not getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{role} ({type(model).__name__}) is not an encoder-decoder model; use the causal-LM "
            "engine (`SpeculativeDecoder`) for decoder-only models"
        )
    if model.config.decoder_start_token_id is None:
        raise UnsupportedModelError(f"{role} config has no decoder_start_token_id")


class CachedSeq2Seq(CachedModel):
    """An encoder-decoder model whose decoder cache can be rolled back per row."""

    def __init__(self, model: torch.nn.Module, role: str = "verifier", compact_min_holes: int = 8):
        check_seq2seq_support(model, role)
        self.model = model
        self.role = role
        self.device = model_device(model)
        self.cache_argument = cache_argument(model)
        self.compact_min_holes = compact_min_holes
        self.row_positions = install_row_positions(model)
        self.encoder_states = torch.empty(0, 0, 0, device=self.device)  # [batch, src, d_model]
        self.encoder_mask = torch.empty(0, 0, dtype=torch.long, device=self.device)
        self.encoder_passes = 0
        self.reset(0)

    @property
    def decoder_start(self) -> int:
        return int(self.model.config.decoder_start_token_id)

    @torch.no_grad()
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Run the encoder once for the batch about to be decoded."""
        # input_ids, attention_mask: [batch, src]
        encoder = self.model.get_encoder()
        attention_mask = attention_mask.to(self.device)
        out = encoder(input_ids=input_ids.to(self.device), attention_mask=attention_mask)
        self.encoder_states = out.last_hidden_state
        self.encoder_mask = attention_mask.to(self.device)
        self.encoder_passes += 1

    def reset(self, batch_size: int) -> None:
        if batch_size and batch_size != self.encoder_states.shape[0]:
            raise ValueError(
                f"{self.role}: {batch_size} rows to decode but {self.encoder_states.shape[0]} "
                "encoded; call encode() with the batch first"
            )
        if batch_size > 1 and self.row_positions is None:
            raise UnsupportedModelError(
                f"{self.role} ({type(self.model).__name__}) has no per-row position hook (e.g. "
                "T5's relative position bias), so rows of different lengths would see wrong "
                "positions; decode it with batch size 1"
            )
        self.cache = EncoderDecoderCache(
            DynamicCache(config=self.model.config), DynamicCache(config=self.model.config)
        )
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        # a drafter that reads the verifier's decoder states sets this after each reset (so a
        # plain decode never pays for it): each forward then keeps its last layer's states and
        # their logical positions (`last_states`)
        self.keep_states = False
        self.last_states: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rollback_layers(self) -> list:
        return self.cache.self_attention_cache.layers

    @torch.no_grad()
    def forward(self, tokens, valid, logits_to_keep: int = 1, want_hidden: bool = False):
        """As `CachedModel.forward`: tokens, valid [batch, n] -> logits [batch, keep, vocab]."""
        positions = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [batch, n]
        new_pos = torch.where(valid, positions, HOLE)
        mask = torch.cat([self.slot_pos >= 0, valid], dim=1).long()  # [batch, physical + n]
        if self.row_positions is not None:
            self.row_positions.position_ids = positions.clamp(min=0)
        try:
            out = self.model(
                encoder_outputs=(self.encoder_states,),
                attention_mask=self.encoder_mask,
                decoder_input_ids=tokens,
                decoder_attention_mask=mask,
                use_cache=True,
                **{self.cache_argument: self.cache},
                output_hidden_states=want_hidden or self.keep_states,
            )
        finally:
            if self.row_positions is not None:
                self.row_positions.position_ids = None
        self.slot_pos = torch.cat([self.slot_pos, new_pos], dim=1)
        self.lengths = self.lengths + valid.sum(1)
        if self.keep_states:  # [batch, n, d_model] and [batch, n] (HOLE where not valid)
            self.last_states = (out.decoder_hidden_states[-1], new_pos)
        hidden = out.decoder_hidden_states[-1][:, -logits_to_keep:] if want_hidden else None
        return out.logits[:, -logits_to_keep:], hidden

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        for layer in self.cache.cross_attention_cache.layers:
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
        self.encoder_states = self.encoder_states.index_select(0, rows)
        self.encoder_mask = self.encoder_mask.index_select(0, rows)
        super().select_rows(rows)
