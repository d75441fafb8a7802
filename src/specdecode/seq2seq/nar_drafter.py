"""The block drafter behind the engine's `Drafter` protocol: one pass proposes a whole block.

It reads the verifier's encoder states from the `CachedSeq2Seq` it drafts for, so it keeps no
state of its own: rows leave the batch in the verifier, and the drafter sees the same rows on its
next call. Its draft is deterministic (argmax), which the lossless sampling rule treats as a
point mass, so sampling stays exact too.
"""

from __future__ import annotations

import torch

from specdecode.drafters import Draft
from specdecode.sampling import bad_logits
from specdecode.seq2seq.block_drafter import BlockDrafter
from specdecode.seq2seq.cached import CachedSeq2Seq


class NARDrafter:
    def __init__(self, model: BlockDrafter, verifier: CachedSeq2Seq, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model.eval()
        self.verifier = verifier
        self.block_size = block_size

    def start(self, batch_size: int) -> None:
        del batch_size  # stateless: the verifier holds the encoder states of the batch

    @torch.no_grad()
    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        del rng  # argmax drafts
        k = min(self.block_size, int(max_tokens.max()))
        if k <= 0:
            return Draft.empty(sequences.shape[0], sequences.device)
        width = int(seq_lens.max())
        logits = self.model(
            sequences[:, :width],
            seq_lens,
            self.verifier.encoder_states,
            self.verifier.encoder_mask,
            k,
        )  # [batch, k, vocab]
        lengths = max_tokens.clamp(min=0, max=k)  # [batch]
        return Draft(logits.argmax(-1), None, lengths, 1, bad_logits(logits))

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        del lengths, num_drafted, num_accepted  # nothing cached between rounds

    def select_rows(self, rows: torch.Tensor) -> None:
        del rows  # the verifier's encoder states are already selected
