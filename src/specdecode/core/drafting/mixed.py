"""One drafter for lookup and a model together, under a planner (`planners`).

Per row and round: if the text's last n tokens (n >= `lookup.min_ngram`) occurred before, the
row may draft what followed them, at no model pass; where they did not, a corpus (if given,
`corpus.CorpusIndex`) may know what follows them; the other rows draft with the model (if
there is one). The planner says which rows draft by model and how far each row drafts:
`FixedPlanner` every match by lookup, as far as the model's length policy allows (drafting
`lookup-first`), `PricedPlanner` a corpus draft by the corpus or by the model, whichever plan
pays more, as far as it pays at this machine's prices (drafting `auto`). A row's model cache
catches up on the committed tokens the next time it drafts with the model
(`ModelBackend.pending`). The model drafts a row only within its own context (`room`): past
it the row drafts by lookup or not at all, while the target's longer context serves it.

A search whose finds do not pay for it rests (`Rest`): the lookup, the corpus and the plan
cost every round that searches some host time, drafting or not, and on a machine where almost
nothing pays (a CPU whose every extra token costs most of a step; a GPU, whose steps are
short, on text that repeats nothing) that time alone makes `auto` slower than plain decoding. So the
drafter times its searches and its plain rounds on the machine it runs on, and counts the tokens
its last `QUIET` searches kept, per row; where those fall short of `PAYS` times a search's own
time in plain rounds, the next searches come a round, then two, then up to `MOST_REST` rounds
apart, until the finds pay again or a row joins. A resting search costs a fifth of a search
every round and misses a match for at most `MOST_REST` rounds. Tokens kept, not drafts made,
are the finds: a draft that is all rejected found nothing either. `QUIET` is long enough that
the gaps between a code text's repeats (a dozen rounds or so) do not start a rest: there, a rest
would miss the next repeat's first rounds.

Why mix: a text that repeats itself (code edited in place, a list, a quotation) is drafted by
lookup about as well as by a model, without the model's passes (`docs/findings.md` has the
measurements on the default pair).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

from specdecode.core.config import LOOKUP_FIRST, PromptLookup
from specdecode.core.drafting.base import Draft
from specdecode.core.drafting.corpus import ORDERS, CorpusIndex
from specdecode.core.drafting.lookup import lookup_continuation, lookup_law
from specdecode.core.drafting.model import DeferredModelDrafter, ModelDrafter
from specdecode.core.drafting.planners import Planner

QUIET = 32  # the searches whose kept tokens decide whether the search rests
MOST_REST = 4  # rounds a resting search skips at most between two searches
PAYS = 2.0  # tokens kept per row and search, per plain round of a search's own time, at least
TIMED = 9  # searches, and rounds that drafted nothing, in the medians of their seconds


class Rest:
    """When the search for drafts runs: every round while the tokens the last `QUIET` searches
    kept (per row and search) pay `PAYS` times for a search's own time in plain rounds, less
    often once they do not (rests of 1, 2, 4 ... `MOST_REST` rounds between searches), every
    round again once they do or a row joins. Times are of the machine it runs on (`clock`):
    where none are known yet, a search pays if it kept anything at all."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.kept: deque[float] = deque(maxlen=QUIET)  # per search: tokens kept per row
        self.searches: deque[float] = deque(maxlen=TIMED)  # seconds of the latest searches
        self.plain: deque[float] = deque(maxlen=TIMED)  # seconds of the latest plain rounds
        self.rest = 0  # the latest rest, in rounds
        self.left = 0  # rounds of the current rest still to skip
        self.began: float | None = None  # when the round now running began
        self.drafting = False  # whether it drafts

    def begin(self) -> bool:
        """A round begins: whether it rests (runs plain, no search). A round that drafted
        nothing before it is timed as a plain round."""
        now = self.clock()
        if self.began is not None and not self.drafting:
            self.plain.append(now - self.began)
        self.began, self.drafting = now, False
        if self.left:
            self.left -= 1
            return True
        return False

    def searched(self, drafts: bool) -> None:
        """This round's search and plan are done: their time is a search's; a round that
        drafts nothing kept nothing (one that drafts is counted when verified, `found`)."""
        if self.began is not None:
            self.searches.append(self.clock() - self.began)
        self.drafting = drafts
        if not drafts:
            self.found(0.0)

    def found(self, kept: float) -> None:
        """A search kept `kept` tokens per row."""
        self.kept.append(kept)
        if len(self.kept) < QUIET:
            return
        if statistics.fmean(self.kept) > PAYS * self.cost():
            self.rest = 0
        else:
            self.rest = self.left = min(2 * self.rest or 1, MOST_REST)

    def cost(self) -> float:
        """A search's own time, in plain rounds (0 until both are timed)."""
        if len(self.searches) < 3 or len(self.plain) < 3:
            return 0.0
        return statistics.median(self.searches) / max(statistics.median(self.plain), 1e-9)

    def wake(self) -> None:
        self.rest = self.left = 0


class MixedDrafter:
    """Lookup where the text repeats, the drafter model (`model`, may be None) elsewhere."""

    def __init__(
        self,
        lookup: PromptLookup,
        model: ModelDrafter | DeferredModelDrafter | None,
        planner: Planner,
        vocab_size: int,
        corpus: CorpusIndex | None = None,
        clock: Callable[[], float] = time.perf_counter,  # times the searches (`Rest`)
    ) -> None:
        self.lookup, self.model, self.planner = lookup, model, planner
        self.clock = clock
        self.vocab_size, self.corpus = vocab_size, corpus
        # (match length or 0, tokens from the source, tokens from the model) per row
        self.round: tuple[list[int], list[int], list[int]] | None = None
        self.primed: list[bool] = []  # per row: the planner has heard the corpus on its prompt
        self.rest = Rest(clock)

    def start(self, batch_size: int) -> None:
        self.planner.start(batch_size)
        self.primed = [False] * batch_size
        self.rest = Rest(self.clock)
        if self.model is not None:
            self.model.start(batch_size)

    def rests(self) -> bool:
        """A round of the search's rest (`Rest`), begun here: the engine runs it plain."""
        if not self.rest.left:
            return False
        self.rest.begin()
        self.round = None
        return True

    def propose(self, sequences, seq_lens, max_tokens, rng) -> Draft:
        if self.rest.begin():  # a plain round, as the engine runs one with no drafter asked
            self.round = None
            return Draft.empty(len(seq_lens), sequences.device)
        budget = self.planner.budget(max_tokens)  # most tokens per row this round
        lens = seq_lens.tolist()
        texts = sequences[:, : max(lens, default=0)].cpu()  # [batch, longest] the round's copy
        found = self.find(texts, lens, budget)
        keys = [n for _, n in found]  # each row's source key (`find`): 0, nothing found
        behind = self.model.behind(seq_lens) if self.model is not None else [0] * len(lens)
        room = self.model.room(seq_lens).tolist() if self.model is not None else [0] * len(lens)
        plan, fillers, by_model = self.planner.plan(
            keys, [len(c) for c, _ in found], budget, behind, room
        )
        by_model = [m and self.model is not None for m in by_model]
        self.rest.searched(any(plan) or any(fillers))  # its kept tokens come with `rollback`
        model_k = [k if m else 0 for m, k in zip(by_model, plan, strict=True)]
        # what the planner learns from: the key of a row that drafted by lookup or corpus
        self.round = ([0 if m else n for n, m in zip(keys, by_model, strict=True)], plan, model_k)
        device = sequences.device
        use = torch.tensor([k == 0 for k in model_k], device=device)  # [batch] not the model's
        if max(model_k, default=0) > 0:
            limits = torch.tensor(model_k, device=device)  # [batch]
            draft = self.model.propose(sequences, seq_lens, limits, rng)
        else:
            draft = Draft.empty(len(lens), device)
        looked = []  # a filler (the row's last token) evens the pass where the plan asks one
        for b, ((tokens, _), k, filler, m) in enumerate(
            zip(found, plan, fillers, by_model, strict=True)
        ):
            source = tokens[:0] if m else tokens[:k]
            if filler:
                source = torch.cat([source, texts[b, lens[b] - 1 : lens[b]].repeat(filler)])
            looked.append(source)
        return merge_lookup(draft, looked, use)

    def find(
        self, texts: torch.Tensor, lens: list[int], budget: list[int]
    ) -> list[tuple[torch.Tensor, int]]:
        """Each row's draft that costs no model pass, up to `budget[b]` tokens, with its
        acceptance key: what followed the last tokens of its text `texts[b, :lens[b]]` earlier
        (key: the match length), else the corpus's guess (key: `corpus_key`), else nothing
        (key 0). texts: [batch, longest] on the host."""
        found = [
            lookup_continuation(texts[b, : lens[b]], budget[b], self.lookup, with_ngram=True)
            for b in range(len(lens))
        ]
        if self.corpus is None:
            return found
        for b, primed in enumerate(self.primed):
            # a new row, once its whole prompt is in (a row still prefilling has no budget):
            # how well the corpus knew the prompt
            if not primed and budget[b] > 0:
                self.planner.prime(b, self.corpus.evidence(texts[b, : lens[b]].tolist()))
                self.primed[b] = True
        return [self._corpus_draft(texts[b, : lens[b]], f, budget[b]) for b, f in enumerate(found)]

    def _corpus_draft(
        self, text: torch.Tensor, found: tuple[torch.Tensor, int], limit: int
    ) -> tuple[torch.Tensor, int]:
        """The corpus's draft where the row's own text has no match, or only one of 1-2 tokens
        (lookup with no drafter model) and the corpus's choice is clear; its key is
        `corpus_key` of its share band."""
        n = found[1]
        if n >= LOOKUP_FIRST.min_ngram or limit < 1:
            return found
        drafted, band = self.corpus.continuation(text[-ORDERS:].tolist(), limit)
        if not drafted or (n and band > 0):
            return found
        return torch.tensor(drafted, dtype=torch.long), corpus_key(self.lookup, band)

    def next_law(self, sequences, seq_lens, rows) -> torch.Tensor:
        if self.model is None:
            return lookup_law(sequences, seq_lens, rows, self.lookup, self.vocab_size)
        return self.model.next_law(sequences, seq_lens, rows)

    def rollback(self, lengths, num_drafted, num_accepted) -> None:
        if self.round is None:  # a plain round (the engine did not ask for a draft)
            if self.model is not None:
                self.model.rollback(lengths, num_drafted, num_accepted)
            return
        keys, plan, model_k = self.round
        accepted = num_accepted.tolist()
        self.planner.observe(keys, plan, accepted)
        if self.rest.drafting:
            self.rest.found(sum(accepted) / max(len(accepted), 1))
        if self.model is not None:
            # the model's policy hears only its own rows: a looked-up or padded row drafted
            # nothing with the model (a heuristic k stays as it was)
            looked = torch.tensor([k == 0 for k in model_k], device=num_drafted.device)
            self.model.rollback(lengths, num_drafted.masked_fill(looked, 0), num_accepted)
        self.round = None  # heard: a round the engine runs plain next leaves nothing to learn

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.planner.select_rows(keep)
        self.primed = [self.primed[b] for b in keep]
        self.round = None
        if self.model is not None:
            self.model.select_rows(rows)

    def add_rows(self, prompts: list[list[int]], partitions: list[str] | None = None) -> None:
        self.planner.add_rows(len(prompts))
        self.primed += [False] * len(prompts)
        self.round = None
        self.rest.wake()  # a new prompt may hold what the others did not
        if self.model is not None:
            self.model.add_rows(prompts, partitions)


def corpus_key(lookup: PromptLookup, band: int) -> int:
    """The acceptance key of a corpus draft of share band `band`: past the match lengths."""
    return lookup.max_ngram + 1 + band


def merge_lookup(draft: Draft, looked: list[torch.Tensor], use: torch.Tensor) -> Draft:
    """The model's draft with the rows in `use` ([batch] bool) replaced by their looked-up
    tokens (`looked[b]`, [n_b] on any device): a looked-up row's law is a point mass on its
    token, and it spent no drafter pass."""
    device = draft.tokens.device
    width = max(draft.tokens.shape[1], max((len(t) for t in looked), default=0))
    if not any(len(t) for t in looked):  # no row looked anything up (no host sync on `use`)
        return draft
    lengths = torch.tensor([len(t) for t in looked], dtype=torch.long, device=device)  # [batch]
    tokens = torch.zeros(len(looked), width, dtype=torch.long)  # [batch, width] on the host
    for b, t in enumerate(looked):
        tokens[b, : len(t)] = t
    tokens = tokens.to(device)
    padded = torch.nn.functional.pad(draft.tokens, (0, width - draft.tokens.shape[1]))
    tokens = torch.where(use[:, None], tokens, padded)  # [batch, width]
    lengths = torch.where(use, lengths, draft.lengths)  # [batch]
    probs = draft.probs  # [batch, drafted, vocab] or None
    if probs is not None:  # sampling: the looked-up rows' laws are point masses
        probs = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]))
        point = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(probs.dtype)
        probs = torch.where(use[:, None, None], point, probs)
    passes = draft.row_passes if draft.row_passes is not None else draft.lengths
    return Draft(
        tokens,
        probs,
        lengths,
        draft.passes,
        draft.invalid_logits,
        draft.policy_seconds,
        row_passes=passes.masked_fill(use, 0),
    )
