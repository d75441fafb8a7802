"""SpecDec's Spec-Drafter: a non-autoregressive decoder that proposes a block of k tokens at once.

Input of one pass, per row: the committed target prefix (decoder start token first) followed by
k `<mask>` queries; every valid slot attends to every other (the prefix is known, the queries
see each other), and cross-attends to the source. The k outputs at the mask slots are the draft.
One pass per block, so drafting cost hardly grows with k.

Source side: the drafter reads the verifier's encoder states instead of running an encoder of
its own (SpecDec gives the drafter its own encoder, initialised from the verifier's). Reuse costs
nothing at inference (the verifier encodes each input once anyway), halves the drafter's size,
and on a 2-core CPU lets a session's training budget go to the decoder alone. Its decoder layers
are initialised from the verifier's decoder (same post-norm layout), its embeddings and output
projection are the verifier's shared embeddings, so training starts from a model that already
attends to the source.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


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

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")


class BlockDrafter(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                cfg.d_model,
                cfg.heads,
                cfg.ffn,
                cfg.dropout,
                activation=nn.functional.gelu,
                batch_first=True,
                norm_first=False,
            )
            for _ in range(cfg.layers)
        )
        self.final_logits_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0

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
    ) -> torch.Tensor:
        """Logits of the k tokens after each row's prefix: [batch, k, vocab].

        `given` (GLAT's glancing) puts reference tokens into some query slots; slots holding
        `mask_id` stay queries.
        """
        if int(prefix_lens.max()) + k > self.cfg.max_positions:
            raise ValueError(
                f"prefix of {int(prefix_lens.max())} tokens plus a block of {k} exceeds the "
                f"drafter's {self.cfg.max_positions} positions"
            )
        ids, valid, query = self.block_inputs(prefix, prefix_lens, k)
        if given is not None:
            ids = ids.scatter(1, query, given)
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.embed(ids) * self.embed_scale + self.positions(pos)[None]  # [batch, P + k, d]
        for layer in self.layers:
            h = layer(
                h,
                encoder_states,
                tgt_key_padding_mask=~valid,
                memory_key_padding_mask=encoder_mask == 0,
            )
        h = h.gather(1, query[..., None].expand(-1, -1, h.shape[-1]))  # [batch, k, d]
        return h @ self.embed.weight.T + self.final_logits_bias  # tied output projection

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
            _copy_attention(mine.self_attn, theirs.self_attn)
            _copy_attention(mine.multihead_attn, theirs.encoder_attn)
            mine.linear1.load_state_dict(theirs.fc1.state_dict())
            mine.linear2.load_state_dict(theirs.fc2.state_dict())
            mine.norm1.load_state_dict(theirs.self_attn_layer_norm.state_dict())
            mine.norm2.load_state_dict(theirs.encoder_attn_layer_norm.state_dict())
            mine.norm3.load_state_dict(theirs.final_layer_norm.state_dict())


def _copy_attention(mine: nn.MultiheadAttention, theirs: nn.Module) -> None:
    mine.in_proj_weight.copy_(
        torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight])
    )
    mine.in_proj_bias.copy_(torch.cat([theirs.q_proj.bias, theirs.k_proj.bias, theirs.v_proj.bias]))
    mine.out_proj.load_state_dict(theirs.out_proj.state_dict())
