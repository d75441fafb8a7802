"""The block drafter behind the engine's `Drafter` protocol: one pass proposes a whole block.

It reads the verifier's encoder states from the `CachedSeq2Seq` it drafts for, and caches the
keys and values of the committed prefix (`DrafterState`), so each round feeds only the tokens
committed since the last one plus the k mask queries. Its draft is deterministic (argmax),
which the lossless sampling rule treats as a point mass, so sampling stays exact too.

A drafter built with `target_features` also reads the verifier's last decoder states (as EAGLE
reads its target's features, here for a whole block at once): the verify pass has computed them
anyway, and they carry what the verifier has planned past the token it just committed. The
verifier keeps each forward's states (`CachedSeq2Seq.keep_states`); after the verify pass
(`rollback`) they are filed by position, and the next proposal feeds each newly committed token
with the state at the position before it. States of rejected positions are filed too, and are
overwritten by the next verify pass before any committed token reads them.
"""

from __future__ import annotations

import torch

from specdecode.core.drafting.base import Draft
from specdecode.core.sampling import bad_maxima
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
        width = model.cfg.target_features
        self.states_by_pos: torch.Tensor | None = None  # [batch, positions + 1, width]
        if width:
            d_model = verifier.model.config.d_model
            if width != d_model:
                raise ValueError(
                    f"this drafter reads verifier states of width {width}, but the verifier's "
                    f"d_model is {d_model}: it was trained for another verifier"
                )

    def start(self, batch_size: int) -> None:
        self.state.reset(batch_size)
        width = self.model.cfg.target_features
        if width:  # one spare position at the end takes the writes of invalid slots
            size = (batch_size, self.model.cfg.max_positions + 1, width)
            self.states_by_pos = torch.zeros(
                size, dtype=self.verifier.model.dtype, device=self.state.device
            )
            self.verifier.keep_states = True  # after the verifier's reset, which clears it

    def rests(self) -> bool:
        return False  # its every round may draft

    @torch.no_grad()
    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        del rng  # argmax drafts
        k = min(self.block_size, int(max_tokens.max()))
        if k <= 0 or not self._has_the_states_it_reads(seq_lens):
            return Draft.empty(sequences.shape[0], sequences.device)
        logits = self.state.propose(
            sequences,
            seq_lens,
            self.verifier.encoder_states,
            self.verifier.encoder_mask,
            k,
            self.states_by_pos,
        )  # [batch, k, vocab]
        lengths = max_tokens.clamp(min=0, max=k)  # [batch]
        passes = (lengths > 0).long()  # one pass per row that drafted, whatever k
        best, tokens = logits.max(-1)  # [batch, k]: the draft and the check in one reduction
        return Draft(tokens, None, lengths, 1, bad_maxima(best), row_passes=passes)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        del lengths, num_drafted, num_accepted  # only committed tokens are ever cached
        if self.states_by_pos is not None:
            self._file_verifier_states()

    def _has_the_states_it_reads(self, seq_lens: torch.Tensor) -> bool:
        """A committed token reads the verifier's state at the position before it. A prompt of
        several tokens (a forced prefix) has none before the verifier's first pass: that round
        is a plain step, so that the drafter never caches a token fed a missing state. Every
        token in the verifier's cache went through a pass whose states were filed, so the
        verifier's cached lengths are the positions with a state."""
        if self.states_by_pos is None:
            return True
        return bool((self.verifier.lengths >= seq_lens - 1).all())

    def _file_verifier_states(self) -> None:
        """The verify pass's states [batch, n, d] into `states_by_pos` at their positions."""
        if self.verifier.last_states is None:
            raise RuntimeError("the verifier kept no decoder states for this drafter")
        states, positions = self.verifier.last_states  # [b, n, d], [b, n]
        spare = self.states_by_pos.shape[1] - 1
        index = torch.where(positions >= 0, positions, spare).clamp(max=spare)
        self.states_by_pos.scatter_(1, index[..., None].expand_as(states), states)
        self.verifier.last_states = None

    def select_rows(self, rows: torch.Tensor) -> None:
        self.state.select_rows(rows)
        if self.states_by_pos is not None:
            self.states_by_pos = self.states_by_pos.index_select(0, rows.to(self.state.device))
