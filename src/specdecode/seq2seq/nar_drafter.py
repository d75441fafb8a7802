"""The block drafter behind the engine's `Drafter` protocol: one pass proposes a whole block.

It reads the verifier's encoder states from the `CachedSeq2Seq` it drafts for, and caches the
keys and values of the committed prefix (`DrafterState`), so each round feeds only the tokens
committed since the last one plus the k mask queries. Its draft is deterministic (argmax),
which the lossless sampling rule treats as a point mass, so sampling stays exact too.
"""

from __future__ import annotations

import torch

from specdecode.drafters import Draft
from specdecode.sampling import bad_maxima
from specdecode.seq2seq.block_drafter import BlockDrafter, DrafterState
from specdecode.seq2seq.cached import CachedSeq2Seq


class NARDrafter:
    def __init__(self, model: BlockDrafter, verifier: CachedSeq2Seq, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model.eval()
        self.verifier = verifier
        self.block_size = block_size
        self.state = DrafterState(self.model)

    def start(self, batch_size: int) -> None:
        self.state.reset(batch_size)

    @torch.no_grad()
    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        del rng  # argmax drafts
        k = min(self.block_size, int(max_tokens.max()))
        if k <= 0:
            return Draft.empty(sequences.shape[0], sequences.device)
        logits = self.state.propose(
            sequences, seq_lens, self.verifier.encoder_states, self.verifier.encoder_mask, k
        )  # [batch, k, vocab]
        lengths = max_tokens.clamp(min=0, max=k)  # [batch]
        passes = (lengths > 0).long()  # one pass per row that drafted, whatever k
        best, tokens = logits.max(-1)  # [batch, k]: the draft and the check in one reduction
        return Draft(tokens, None, lengths, 1, bad_maxima(best), row_passes=passes)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        del lengths, num_drafted, num_accepted  # only committed tokens are ever cached

    def select_rows(self, rows: torch.Tensor) -> None:
        self.state.select_rows(rows)
