"""SpecDec's Spec-Drafter: a non-autoregressive decoder that proposes a block of k tokens at once.

Input of one pass, per row: the committed target prefix (decoder start token first) followed by
k `<mask>` queries, cross-attending to the source. The prefix attends causally, as in the
verifier; the queries attend to the whole prefix and to each other. The k outputs at the query
slots are the draft: one pass per block, so drafting cost hardly grows with k.

With `first_from_prefix`, the first drafted token is read from the last prefix slot instead,
as a causal language model predicts its next token, and k - 1 queries (one position further on)
give the rest. Why: that slot holds the last committed token itself, which a query must first
fetch through attention, and every prefix slot can then be trained with a language-model loss,
a signal at every position of a sentence for the one drafted token every round depends on.

Why a causal prefix: its states then depend on the committed tokens alone, so at inference they
are cached per row (`DrafterState`) and each round feeds only the tokens committed since the
last one plus the k queries, instead of the whole prefix again. On a CPU, where these passes are
compute-bound, that is most of the drafter's cost.

Source side: the drafter reads the verifier's encoder states instead of running an encoder of
its own (SpecDec gives the drafter its own encoder, initialised from the verifier's). Reuse costs
nothing at inference (the verifier encodes each input once anyway), halves the drafter's size,
and lets a few hours of CPU training go to the decoder alone. Decoder layers are initialised
from the verifier's decoder (same post-norm layout), embeddings and output projection are the
verifier's shared embeddings, so training starts from a model that already reads the source.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.backends.kernels import (
    PackedTiedOutput,
    prepack_linears,
    quantize_int8,
    set_row_plans,
)
from specdecode.backends.torch_eager import HOLE, CachedModel


@dataclass(frozen=True)
class BlockDrafterConfig:
    vocab_size: int
    d_model: int = 256
    layers: int = 3
    heads: int = 4
    ffn: int = 1024
    block_size: int = 25  # k of training; inference may ask for fewer
    max_positions: int = 320
    dropout: float = 0.1
    pad_id: int = 0
    mask_id: int = 3
    scale_embedding: bool = True
    # the block's first token from the last committed token's state (a causal LM's next-token
    # prediction) rather than from a mask query; the k - 1 others from queries, as before
    first_from_prefix: bool = False
    # > 0: every committed slot also reads the verifier's last decoder state at the position
    # before it (the state whose logits chose that token), through a projection from this width
    target_features: int = 0

    def __post_init__(self) -> None:
        if self.target_features < 0:
            raise ValueError(f"target_features must be >= 0, got {self.target_features}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(d_model, d_model) for _ in range(4)
        )

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape  # -> [b, heads, n, d / heads]
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def attend(self, h, k, v, allowed: torch.Tensor) -> torch.Tensor:
        # h: [b, n, d] (queries are projected here); k, v: [b, heads, m, dh]; allowed: [b, n, m]
        q = self.split(self.q_proj(h))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[:, None]
        )  # [b, heads, n, dh]
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class DrafterLayer(nn.Module):
    """Post-norm decoder layer (Marian's layout): self-attention, cross-attention, FFN."""

    def __init__(self, cfg: BlockDrafterConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.heads)
        self.cross_attn = Attention(cfg.d_model, cfg.heads)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.d_model)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout = cfg.dropout

    def forward(self, h, keys, values, allowed, cross_k, cross_v, cross_allowed):
        """h [b, n, d]; keys/values [b, heads, m, dh] (m covers cache + these n slots)."""
        p, train = self.dropout, self.training
        h = self.norm1(h + F.dropout(self.self_attn.attend(h, keys, values, allowed), p, train))
        cross = self.cross_attn.attend(h, cross_k, cross_v, cross_allowed)
        h = self.norm2(h + F.dropout(cross, p, train))
        return self.norm3(h + F.dropout(self.fc2(F.gelu(self.fc1(h))), p, train))


class BlockDrafter(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.layers))
        self.final_logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        # zero at initialisation, so a drafter given the verifier's states starts as the same
        # drafter without them and training can only add what the states tell
        self.feature_proj: nn.Linear | None = None
        if cfg.target_features:
            self.feature_proj = nn.Linear(cfg.target_features, cfg.d_model)
            nn.init.zeros_(self.feature_proj.weight)
            nn.init.zeros_(self.feature_proj.bias)
        # a faster module for the tied output projection at inference (`prepack`, `int8`)
        self.output_kernel: nn.Module | None = None

    def cross_kv(self, encoder_states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the source keys and values: computed once per batch at inference."""
        return [
            (layer.cross_attn.split(layer.cross_attn.k_proj(encoder_states)),
             layer.cross_attn.split(layer.cross_attn.v_proj(encoder_states)))
            for layer in self.layers
        ]  # fmt: skip

    def run(
        self, ids, positions, allowed, past, encoder_states, encoder_mask, cross=None,
        features=None, fed_slots=None,
    ):  # fmt: skip
        """Layers over slots `ids` [b, n] given cached keys/values `past` (per layer, or None).

        allowed: [b, n, past_len + n]; features: [b, n', target_features] for the first n' <= n
        slots (the verifier's states; the slots after them, queries, get none). fed_slots [b]:
        a row's slots from fed_slots[b] on get none either (queries inside a padded prefix):
        a zero state still adds the projection's bias, which no query meets in training.
        returns hidden [b, n, d] and per-layer new (keys, values)
        """
        cross = cross if cross is not None else self.cross_kv(encoder_states)
        cross_allowed = (encoder_mask != 0)[:, None, :].expand(-1, ids.shape[1], -1)
        h = self.embed(ids) * self.embed_scale + self.positions(positions)  # [b, n, d]
        if self.feature_proj is not None:
            if features is None:
                raise ValueError("this drafter reads the verifier's states: pass `features`")
            fed = self.feature_proj(features)  # [b, n', d]
            if fed_slots is not None:
                slot = torch.arange(fed.shape[1], device=fed.device)
                fed = fed * (slot < fed_slots[:, None])[..., None]
            h = torch.cat([h[:, : fed.shape[1]] + fed, h[:, fed.shape[1] :]], 1)
        h = F.dropout(h, self.cfg.dropout, self.training)
        new_kv = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k_new, v_new = attn.split(attn.k_proj(h)), attn.split(attn.v_proj(h))
            new_kv.append((k_new, v_new))
            if past is not None:
                k_new = torch.cat([past[i][0], k_new], 2)
                v_new = torch.cat([past[i][1], v_new], 2)
            h = layer(h, k_new, v_new, allowed, *cross[i], cross_allowed)
        return h, new_kv

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # tied output projection; F.linear, since a matmul with the transposed table takes a
        # slow, copying path on the CPU
        if self.output_kernel is not None and not torch.is_grad_enabled():
            return self.output_kernel(h)
        return F.linear(h, self.embed.weight, self.final_logits_bias)

    def prepack(self, min_rows: int | None = None) -> BlockDrafter:
        """Inference on the CPU with oneDNN-packed weights, the tied output table included.

        A block pass multiplies k or more rows, which MKL's default fp32 path runs at several
        times the cost of one row on some CPUs (`kernels`), the output table included. Training
        (grad enabled) keeps the dense path.
        None: packed from 1 or 2 rows as `kernels.row_plan` finds for each weight shape;
        the zero-row padding of short products is timed per shape either way.
        """
        if self.output_kernel is not None:
            raise ValueError("this drafter's output is already packed or quantized")
        prepack_linears(self, 2, 1)  # planned below, once the tied table is packed as well
        self.output_kernel = PackedTiedOutput(self.embed.weight, self.final_logits_bias, 2)
        set_row_plans(self, min_rows, None)
        return self

    def int8(self) -> BlockDrafter:
        """An int8 dynamically quantized copy for drafting on the CPU (inference only).

        Its weights take a quarter of the bytes, so more of what a round reads (the packed
        verifier's weights and the drafter's) stays in the CPU's last-level cache
        (`docs/seq2seq.md`). Drafts change a little; the verifier's output never does.
        """
        if any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in self.modules()):
            raise ValueError("this drafter is already int8")
        copy = BlockDrafter(self.cfg)
        copy.load_state_dict(self.state_dict())  # dense weights, whatever kernels self runs
        output = nn.Linear(self.cfg.d_model, self.cfg.vocab_size)
        with torch.no_grad():
            output.weight.copy_(self.embed.weight)
            output.bias.copy_(self.final_logits_bias)
        copy.output_kernel = output
        return quantize_int8(copy.eval())

    def block_inputs(
        self, prefix: torch.Tensor, prefix_lens: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded prefixes -> prefix + k mask queries per row.

        prefix: [batch, P] (entries past prefix_lens[b] are ignored), prefix_lens: [batch]
        returns ids [batch, P + k], valid [batch, P + k], query slots [batch, k]
        """
        batch, width = prefix.shape[0], prefix.shape[1] + k
        slots = torch.arange(width, device=prefix.device)  # [P + k]
        ids = torch.full((batch, width), self.cfg.pad_id, dtype=torch.long, device=prefix.device)
        ids[:, : prefix.shape[1]] = prefix
        ids = ids.masked_fill(slots >= prefix_lens[:, None], self.cfg.mask_id)
        valid = slots < (prefix_lens + k)[:, None]
        ids = ids.masked_fill(~valid, self.cfg.pad_id)
        query = prefix_lens[:, None] + torch.arange(k, device=prefix.device)  # [batch, k]
        return ids, valid, query

    def forward(
        self,
        prefix: torch.Tensor,  # [batch, P] committed tokens, right-padded
        prefix_lens: torch.Tensor,  # [batch]
        encoder_states: torch.Tensor,  # [batch, S, d_model]
        encoder_mask: torch.Tensor,  # [batch, S], 1 = real token
        k: int,
        given: torch.Tensor | None = None,  # [batch, k] tokens placed in query slots (training)
        starts: torch.Tensor | None = None,  # [batch, B]: training blocks, see `forward_blocks`
        prefix_logits: bool = False,  # with starts: also the prefix slots' logits
        features: torch.Tensor | None = None,  # [batch, P or T, F] verifier states per slot
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of the k tokens after each row's prefix, in one pass: [batch, k, vocab].

        `given` (GLAT's glancing) puts reference tokens into some query slots; slots holding
        `mask_id` stay queries. With `starts`, the training form (through `forward`, so that
        wrappers such as DDP see the call): B blocks per row -> [batch, B, k, vocab].
        """
        if starts is not None:
            return self.forward_blocks(
                prefix, prefix_lens, starts, encoder_states, encoder_mask, k, given,
                prefix_logits, features,
            )  # fmt: skip
        self._check_positions(int(prefix_lens.max()), k)
        lead = int(self.cfg.first_from_prefix)  # tokens read from the prefix: 0 or 1
        ids, valid, query = self.block_inputs(prefix, prefix_lens, k - lead)
        if given is not None:
            ids = ids.scatter(1, query, given[:, lead:])
        width = ids.shape[1]
        slots = torch.arange(width, device=ids.device)
        in_prefix = slots[None, :] < prefix_lens[:, None]  # [b, width]
        causal = slots[None, :, None] >= slots[None, None, :]  # [1, q, kv]
        # prefix slots: causal over the prefix; query slots: the whole prefix and every query
        allowed = torch.where(in_prefix[:, :, None], causal & in_prefix[:, None, :], True)
        allowed = allowed & valid[:, None, :] | torch.eye(
            width, dtype=torch.bool, device=ids.device
        )
        positions = slots[None] + lead * ~in_prefix  # queries one position on when lead = 1
        h, _ = self.run(ids, positions, allowed, None, encoder_states, encoder_mask,
                        features=features, fed_slots=prefix_lens)  # fmt: skip
        if lead:  # the last prefix slot comes first, then the queries
            query = torch.cat([prefix_lens[:, None] - 1, query], 1)
        h = h.gather(1, query[..., None].expand(-1, -1, h.shape[-1]))  # [batch, k, d]
        return self.logits(h)

    def forward_blocks(
        self,
        targets: torch.Tensor,  # [batch, T]: decoder start token, then the sentence, right-padded
        lens: torch.Tensor,  # [batch] valid slots of targets
        starts: torch.Tensor,  # [batch, B] block starts: block b follows targets[:, : starts + 1]
        encoder_states: torch.Tensor,
        encoder_mask: torch.Tensor,
        k: int,
        given: torch.Tensor | None = None,  # [batch, B, k] glancing tokens (mask_id elsewhere)
        prefix_logits: bool = False,
        features: torch.Tensor | None = None,  # [batch, T, F]: slot i reads the state at i - 1
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Training: B blocks per sentence in one pass, the causal prefix computed once.

        Each block's queries see the prefix up to its start and their own block only, so the
        logits equal B separate `forward` calls: [batch, B, k, vocab]. With `prefix_logits`,
        also every prefix slot's next-token logits [batch, T, vocab] (the language-model loss).
        """
        b, t = targets.shape
        n_blocks = starts.shape[1]
        self._check_positions(int(starts.max()) + 1, k)
        lead = int(self.cfg.first_from_prefix)
        k_q = k - lead  # query slots per block
        queries = (
            given[..., lead:].reshape(b, n_blocks * k_q)
            if given is not None
            else torch.full((b, n_blocks * k_q), self.cfg.mask_id, device=targets.device)
        )
        ids = torch.cat([targets, queries], 1)  # [b, T + B k_q]
        slot = torch.arange(t, device=targets.device)
        j = torch.arange(k_q, device=targets.device)
        query_pos = (starts[:, :, None] + 1 + lead + j).reshape(b, -1)  # [b, B k_q]
        positions = torch.cat([slot.expand(b, -1), query_pos], 1)
        valid = slot[None] < lens[:, None]  # [b, T]
        prefix_rows = torch.cat(
            [(slot[:, None] >= slot[None]) & valid[:, None],
             torch.zeros(b, t, n_blocks * k_q, dtype=torch.bool, device=ids.device)], 2
        )  # fmt: skip
        sees_prefix = slot[None, None] <= starts[:, :, None]  # [b, B, T]
        same_block = torch.eye(n_blocks, dtype=torch.bool, device=ids.device)  # [B, B]
        sees_queries = same_block[:, None, :, None].expand(n_blocks, k_q, n_blocks, k_q)
        query_rows = torch.cat(
            [sees_prefix[:, :, None].expand(-1, -1, k_q, -1).reshape(b, n_blocks * k_q, t),
             sees_queries.reshape(1, n_blocks * k_q, n_blocks * k_q).expand(b, -1, -1)], 2
        )  # fmt: skip
        allowed = torch.cat([prefix_rows, query_rows], 1)
        allowed = allowed | torch.eye(t + n_blocks * k_q, dtype=torch.bool, device=ids.device)
        h, _ = self.run(ids, positions, allowed, None, encoder_states, encoder_mask,
                        features=features)  # fmt: skip
        d = h.shape[-1]
        blocks = h[:, t:].reshape(b, n_blocks, k_q, d)
        if lead:  # each block's first token from its last prefix slot
            first = h[:, :t].gather(1, starts[..., None].expand(-1, -1, d))  # [b, B, d]
            blocks = torch.cat([first[:, :, None], blocks], 2)  # [b, B, k, d]
        logits = self.logits(blocks)
        return (logits, self.logits(h[:, :t])) if prefix_logits else logits

    def _check_positions(self, prefix_len: int, k: int) -> None:
        if prefix_len + k > self.cfg.max_positions:
            raise ValueError(
                f"prefix of {prefix_len} tokens plus a block of {k} exceeds the drafter's "
                f"{self.cfg.max_positions} positions"
            )

    # -- persistence ------------------------------------------------------------------------

    def save(self, directory: str | Path, dtype: torch.dtype = torch.float32) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "drafter.safetensors"))
        (directory / "drafter_config.json").write_text(json.dumps(asdict(self.cfg), indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> BlockDrafter:
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / "drafter_config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{directory} holds no block drafter (drafter_config.json)")
        model = cls(BlockDrafterConfig(**json.loads(config_path.read_text())))
        state = load_file(str(directory / "drafter.safetensors"))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        return model.eval()

    def reading_target_states(self, target_features: int) -> BlockDrafter:
        """The same weights, plus (zero-initialised) or minus the verifier-state projection."""
        if target_features == self.cfg.target_features:
            return self
        return self._rebuilt(
            lambda key: not key.startswith("feature_proj."), target_features=target_features
        )

    def keeping_layers(self, layers: int) -> BlockDrafter:
        """The same drafter cut to its first `layers` layers (a cheaper pass to train on)."""
        if not 1 <= layers <= self.cfg.layers:
            raise ValueError(
                f"can keep 1 to {self.cfg.layers} layers of this drafter, not {layers}"
            )
        if layers == self.cfg.layers:
            return self
        return self._rebuilt(
            lambda key: not key.startswith("layers.") or int(key.split(".")[1]) < layers,
            layers=layers,
        )

    def reading_first_from_prefix(self, first_from_prefix: bool) -> BlockDrafter:
        """The same weights with the first token read from the prefix or not (no new weights)."""
        if first_from_prefix == self.cfg.first_from_prefix:
            return self
        return self._rebuilt(first_from_prefix=first_from_prefix)

    def _rebuilt(self, keep=lambda key: True, **changes) -> BlockDrafter:
        """A drafter of the changed config holding the weights `keep` passes; only a new
        verifier-state projection may be missing from them (it starts at zero)."""
        model = BlockDrafter(replace(self.cfg, **changes))
        state = {k: v for k, v in self.state_dict().items() if keep(k)}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("feature_proj.") for k in missing):
            raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
        return model.train(self.training)


class _Layer:
    """One layer's cached prefix keys and values, shaped as `CachedModel`'s bookkeeping expects."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [b, heads, slots, dh]
        self.values: torch.Tensor | None = None


class DrafterState(CachedModel):
    """The drafter's per-row cache of committed-prefix keys and values.

    Only committed tokens are ever cached (queries are transient), so nothing is rolled back:
    each round appends the tokens committed since the last one. Ragged rows, holes, compaction
    and row selection are `CachedModel`'s bookkeeping, reused.
    """

    def __init__(self, drafter: BlockDrafter, compact_min_holes: int = 8) -> None:
        self.drafter = drafter
        self.device = drafter.embed.weight.device
        self.compact_min_holes = compact_min_holes
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self.layers = [_Layer() for _ in self.drafter.layers]
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.cross = []

    def _rollback_layers(self) -> list:
        return self.layers

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        self.cross = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.cross]
        super().select_rows(rows)

    @torch.no_grad()
    def propose(
        self, sequences, seq_lens, encoder_states, encoder_mask, k: int, states_by_pos=None
    ) -> torch.Tensor:
        """Logits of the next k tokens of every row: [batch, k, vocab].

        states_by_pos [batch, positions, F]: the verifier's last decoder state at each position,
        for a drafter that reads them (the token at position p reads the state at p - 1).
        """
        drafter = self.drafter
        drafter._check_positions(int(seq_lens.max()), k)
        if not self.cross:
            self.cross = drafter.cross_kv(encoder_states)
        new, valid = self.pending(sequences, seq_lens, drafter.cfg.pad_id)  # [b, n]
        b, n = new.shape
        lead = int(drafter.cfg.first_from_prefix)
        if lead and not bool(valid[:, -1].all()):
            raise RuntimeError(
                "a drafter reading its first token from the last committed one needs every row "
                "to have committed a token since its last proposal"
            )
        k_q = k - lead  # query slots
        queries = torch.full((b, k_q), drafter.cfg.mask_id, dtype=torch.long, device=new.device)
        ids = torch.cat([new, queries], 1)  # [b, n + k_q]
        new_pos = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [b, n]
        query_pos = seq_lens[:, None] + lead + torch.arange(k_q, device=new.device)  # [b, k_q]
        positions = torch.cat([new_pos.clamp(min=0), query_pos], 1)  # [b, n + k_q]
        cached = self.slot_pos >= 0  # [b, L]
        # new slots: cached prefix + earlier new slots; queries: all of the prefix and each other
        tri = torch.ones(n, n, dtype=torch.bool, device=new.device).tril()
        new_rows = torch.cat(
            [cached[:, None].expand(-1, n, -1), tri[None] & valid[:, None],
             torch.zeros(b, n, k_q, dtype=torch.bool, device=new.device)], 2
        )  # fmt: skip
        query_rows = torch.cat(
            [cached[:, None].expand(-1, k_q, -1), valid[:, None].expand(-1, k_q, -1),
             torch.ones(b, k_q, k_q, dtype=torch.bool, device=new.device)], 2
        )  # fmt: skip
        allowed = torch.cat([new_rows, query_rows], 1)  # [b, n + k_q, L + n + k_q]
        eye = torch.eye(n + k_q, dtype=torch.bool, device=new.device)
        allowed[:, :, -(n + k_q) :] |= eye  # a hole attends to itself (no empty softmax)
        past = [(layer.keys, layer.values) for layer in self.layers]
        if past[0][0] is None:
            past = None
        features = None
        if states_by_pos is not None:  # [b, n, F]; the first token (position 0) reads none
            before = (new_pos - 1).clamp(min=0)[..., None].expand(-1, -1, states_by_pos.shape[-1])
            features = states_by_pos.gather(1, before) * (valid & (new_pos > 0))[..., None]
        h, new_kv = drafter.run(ids, positions, allowed, past, encoder_states, encoder_mask,
                                self.cross, features)  # fmt: skip
        for layer, (keys, values) in zip(self.layers, new_kv, strict=True):
            keys, values = keys[:, :, :n], values[:, :, :n]  # queries are not cached
            layer.keys = keys if layer.keys is None else torch.cat([layer.keys, keys], 2)
            layer.values = values if layer.values is None else torch.cat([layer.values, values], 2)
        self.slot_pos = torch.cat([self.slot_pos, torch.where(valid, new_pos, HOLE)], 1)
        self.lengths = self.lengths + valid.sum(1)
        self._crop_and_compact()
        return drafter.logits(h[:, n - lead :])  # [b, k, vocab]: last new slot if lead, queries


def init_from_verifier(drafter: BlockDrafter, verifier: nn.Module) -> None:
    """Embeddings, sinusoidal positions and decoder layers copied from a Marian verifier."""
    decoder = verifier.get_decoder()
    with torch.no_grad():
        drafter.embed.weight.copy_(verifier.get_input_embeddings().weight)
        table = decoder.embed_positions
        table = getattr(table, "inner", table).weight  # RowPositions wraps it once installed
        n = min(table.shape[0], drafter.positions.weight.shape[0])
        drafter.positions.weight[:n].copy_(table[:n])
        if hasattr(verifier, "final_logits_bias"):
            drafter.final_logits_bias.copy_(verifier.final_logits_bias.view(-1))
        for mine, theirs in zip(drafter.layers, decoder.layers, strict=False):
            mine.self_attn.load_state_dict(theirs.self_attn.state_dict())
            mine.cross_attn.load_state_dict(theirs.encoder_attn.state_dict())
            mine.fc1.load_state_dict(theirs.fc1.state_dict())
            mine.fc2.load_state_dict(theirs.fc2.state_dict())
            mine.norm1.load_state_dict(theirs.self_attn_layer_norm.state_dict())
            mine.norm2.load_state_dict(theirs.encoder_attn_layer_norm.state_dict())
            mine.norm3.load_state_dict(theirs.final_layer_norm.state_dict())
