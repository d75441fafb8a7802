"""Prompt lookup decoding: drafts with no model at all, from the row's own text.

The draft is the tokens that followed the latest earlier occurrence of the text's last few
tokens (`PromptLookup`). `lookup_continuation` and `lookup_law` serve the mixed drafter too,
which looks up before a drafter model.
"""

from __future__ import annotations

import torch

from specdecode.core.config import PromptLookup
from specdecode.core.drafting.base import Draft
from specdecode.core.length_policies import LengthPolicy


def lookup_continuation(
    text: torch.Tensor, limit: int, lookup: PromptLookup, with_ngram: bool = False
) -> torch.Tensor | tuple[torch.Tensor, int]:
    """text [length] committed tokens of one row -> [<= limit] the tokens that followed the most
    recent earlier occurrence of its last n tokens, for the largest n in
    max_ngram..min_ngram that occurs; empty if none does. `with_ngram`: also that n (0: none).

    The most recent occurrence rather than the first: a text that repeats itself (a loop
    unrolled, a list, code edited in place) is most like its latest copy.
    """
    length = text.shape[0]
    for n in range(min(lookup.max_ngram, length - 1), lookup.min_ngram - 1, -1):
        # windows[i] = text[i : i + n] for every start whose continuation is not empty
        windows = text[: length - 1].unfold(0, n, 1)  # [length - n, n]
        hits = (windows == text[length - n :]).all(-1).nonzero()  # [matches, 1]
        if hits.numel():
            start = int(hits[-1]) + n
            found = text[start : min(start + limit, length)]
            return (found, n) if with_ngram else found
    return (text[:0], 0) if with_ngram else text[:0]


def lookup_drafts(
    sequences: torch.Tensor, seq_lens: torch.Tensor, limits: list[int], lookup: PromptLookup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's `lookup_continuation` (at most limits[b] tokens), from one host copy of the
    committed texts (the round's one sync) ->
    tokens [batch, width] on the host (zero past each draft), lengths [batch] on the host."""
    lens = seq_lens.tolist()
    texts = sequences[:, : max(lens, default=0)].cpu()  # [batch, longest]
    drafts = [lookup_continuation(texts[b, : lens[b]], lim, lookup) for b, lim in enumerate(limits)]
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)  # [batch]
    width = int(lengths.max()) if drafts else 0
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)  # [batch, width]
    for b, draft in enumerate(drafts):
        tokens[b, : len(draft)] = draft
    return tokens, lengths


def lookup_law(
    sequences: torch.Tensor,
    seq_lens: torch.Tensor,
    rows: torch.Tensor,
    lookup: PromptLookup,
    vocab_size: int,
) -> torch.Tensor:
    """[batch, vocab] a point mass on the token lookup would draft next (on the last committed
    token where nothing matches), for the `rows` ([batch] bool) that ask: a law a bonus token
    can be drawn from and verified against, like any drafted token's."""
    tokens, lengths = lookup_drafts(sequences, seq_lens, [1] * len(seq_lens), lookup)
    first = torch.nn.functional.pad(tokens, (0, 1))[:, 0].to(sequences.device)  # [batch]
    last = sequences.gather(1, (seq_lens - 1)[:, None])[:, 0]  # [batch]
    token = torch.where(lengths.to(sequences.device) > 0, first, last)
    law = torch.nn.functional.one_hot(token, vocab_size).float()  # [batch, vocab]
    return torch.where(rows[:, None], law, 1.0 / vocab_size)


class PromptLookupDrafter:
    """Drafts by n-gram lookup in each row's own text (`PromptLookup`); no model, no cache.

    A draft is deterministic, so it goes to verification with no law (`Draft.probs` None):
    lossless sampling then accepts a drafted token x with probability p(x) and otherwise
    resamples from the target's law without x, which keeps the output law the target's. Only
    policies that fix a round's length up front apply (`constant`, `heuristic`): the others
    read a drafter model's logits or hidden states, which there are none of
    (`factory.make_drafter` refuses the others).
    """

    def __init__(
        self, lookup: PromptLookup, policy: LengthPolicy, vocab_size: int, device: torch.device
    ) -> None:
        self.lookup, self.policy, self.device = lookup, policy, device
        self.vocab_size = vocab_size

    def start(self, batch_size: int) -> None:
        self.policy.start(batch_size, self.device)

    def rests(self) -> bool:
        return False  # its every round may draft

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        limits = self.policy.round_limits(max_tokens).tolist()  # most tokens per row
        tokens, lengths = lookup_drafts(sequences, seq_lens, limits, self.lookup)
        lengths = lengths.to(sequences.device)
        return Draft(
            tokens.to(sequences.device),
            None,
            lengths,
            row_passes=torch.zeros_like(lengths),  # no drafter pass at all
        )

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        return lookup_law(sequences, seq_lens, rows, self.lookup, self.vocab_size)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        self.policy.observe(num_drafted, num_accepted)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.policy.select_rows(rows)

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> None:
        self.policy.add_rows(len(prompts))
