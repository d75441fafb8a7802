"""From logits to tokens: one processing function for target and drafter, per-row randomness.

The lossless guarantee of speculative sampling holds only if the draft probabilities that enter
the acceptance ratio are exactly the distribution each draft token was drawn from, and the target
distribution gets the same temperature, top-k and top-p. Both models therefore go through
`logits_to_probs` below, in fp32, and tokens are drawn from those very tensors.

Randomness is per row: each row owns a `torch.Generator` and draws a fixed number of uniforms per
step, whatever the other rows do, so a row's output depends on its own seed alone and not on the
batch it shares.

A drafted token's acceptance number (the u of the test u < p/q) is drawn when the token is
drafted, not when it is verified: it is independent of everything else, so when it is drawn does
not change any law, and a length policy may read the numbers of the tokens drafted so far
(`head-u`). Deciding whether to draft position i + 1 from what positions up to i drew leaves
every verdict exact, as any stopping time does.

`PositionRandom` keys every number to the position it decides instead of to the order of draws
(common random numbers). With it, and the bonus token drawn the way a drafted token at its
position would be (`engine.coupled_next_tokens`), a row's sampled text depends on its seed alone,
not on how many tokens each round drafted: every length policy commits the same text, which
makes wall-clock comparisons of policies under sampling paired rather than noisy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdecode.core.config import SamplingConfig


class InvalidLogitsError(FloatingPointError):
    """A model produced NaN or +inf logits, or a row with no finite logit."""


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)`, through NumPy for fp32 on the CPU: torch's CPU argmax over a
    vocabulary-wide row runs several times slower than NumPy's, a share of every greedy round
    at several rows on llama.cpp. Both return the first of tied maxima."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return x.argmax(-1)
    best = np.argmax(x.numpy(), axis=-1)  # a NumPy scalar for a 1-D x
    return torch.from_numpy(np.asarray(best, dtype=np.int64))


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's argmax of [batch, vocab] logits, and whether the row is unusable
    (`bad_rows` of a greedy row), on the host. One read of the vocabulary does both: NaN and
    +inf win an argmax, and an all -inf row's argmax is -inf, so the winner's own logit is
    finite exactly when the row is usable. On the CPU through NumPy and no tensor op: right
    after a pass, each op's first call of the round costs tens of microseconds."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        array = logits.numpy()  # [batch, vocab]
        best = array.argmax(-1).tolist()  # [batch]
        return best, [not math.isfinite(array[b, t]) for b, t in enumerate(best)]
    best = logits.argmax(-1)  # [batch]
    bad = ~torch.isfinite(logits.gather(1, best[:, None])[:, 0])  # [batch]
    host = torch.stack([best, bad.long()]).tolist()  # [2, batch]
    return host[0], [bool(flag) for flag in host[1]]


def bad_maxima(maxima: torch.Tensor) -> torch.Tensor:
    """`bad_rows`'s verdict over the whole batch from each position's largest logit, for
    callers that take the max anyway.

    A position's max is NaN when any of its logits is NaN (max propagates NaN), +inf when one is
    +inf, and -inf when all are -inf: it is finite exactly when the position is usable.
    """
    # maxima: [...] -> [] bool
    return ~torch.isfinite(maxima).all()


def bad_rows(logits: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """NaN, +inf, or a position whose every logit is -inf (a single -inf is a legitimate mask),
    per row; with `scales` ([batch], `law_scales`), also a row whose law its temperature
    spoils: finite logits whose largest, divided by a tiny temperature, overflows float32,
    where the softmax of `logits_to_probs` is NaN (top-k and top-p keep the largest logit, so
    this one check covers them). Per row, so that one row's fault fails it alone. One
    reduction over the vocabulary does it, on the device: the loop reads the flags in its one
    host copy of the round.
    """
    # logits: [batch, ..., vocab] -> [batch] bool
    maxima = logits.amax(dim=-1).reshape(logits.shape[0], -1)  # [batch, positions]
    if scales is not None:
        maxima = maxima.float() / scales[:, None]
    return ~torch.isfinite(maxima).all(-1)


def law_scales(
    sampling: SamplingConfig | RowSampling, rows: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[rows] what each row's logits are divided by before its softmax: its temperature, 1 for
    a greedy row (its law is its argmax's point mass). A running batch's (`RowSampling`) is
    made once per set of rows, for the target's check and the drafter's alike."""
    if isinstance(sampling, RowSampling):
        return sampling.scales(device)
    return _scales([sampling] * rows, device)


def _scales(configs: list[SamplingConfig], device: torch.device | str) -> torch.Tensor:
    return torch.tensor([1.0 if c.greedy else c.temperature for c in configs], device=device)


class RowSampling:
    """A `SamplingConfig` per row, for a batch whose rows were asked for different laws (a
    server's requests). Held by reference by the drafter and the rule of a running batch and
    kept in step with its rows (`add_rows`, `select`), so both always read the current rows.

    A greedy row's law is a point mass on its argmax; under the lossless sampling rule a
    point-mass draft against a point-mass target is accepted exactly when the tokens agree and
    otherwise resampled to the target's argmax: greedy decoding, so greedy and sampled rows
    share one batch and one rule.
    """

    def __init__(self, configs: list[SamplingConfig] | None = None) -> None:
        self.configs = list(configs or [])

    @property
    def configs(self) -> list[SamplingConfig]:
        return self._configs

    @configs.setter
    def configs(self, configs: list[SamplingConfig]) -> None:
        self._configs = configs
        self._scales: torch.Tensor | None = None  # `scales`, made anew for new rows
        self._scales_on: torch.device | str = "cpu"

    @property
    def greedy(self) -> bool:
        return all(c.greedy for c in self.configs)

    def add_rows(self, configs: list[SamplingConfig]) -> None:
        self.configs = self.configs + list(configs)

    def select(self, rows: list[int]) -> None:
        self.configs = [self.configs[i] for i in rows]

    def scales(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[rows] `law_scales` of these rows, made once until the rows change."""
        if self._scales is None or self._scales_on != device:
            self._scales, self._scales_on = _scales(self.configs, device), device
        return self._scales

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [batch, ..., vocab] -> each row's law [batch, ..., vocab] (float32)."""
        first = self.configs[0] if self.configs else SamplingConfig()
        if all(c == first for c in self.configs):
            return logits_to_probs(logits, first)
        return torch.stack(
            [logits_to_probs(row, c) for row, c in zip(logits, self.configs, strict=True)]
        )


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig | RowSampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax, in fp32. Greedy gives a one-hot."""
    # logits: [..., vocab] -> probs: [..., vocab] float32
    if isinstance(cfg, RowSampling):
        return cfg.probs(logits)
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(argmax_last(logits), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with given uniforms, so the caller controls every random draw."""
    # probs: [batch, vocab] (need not be normalised), uniforms: [batch] in [0, 1) -> [batch]
    cdf = probs.cumsum(-1)  # [batch, vocab]
    target = uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    tokens = tokens.clamp_(max=probs.shape[-1] - 1)
    # rounding can land on a zero-probability tail token; fall back to the mode there
    zero = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(zero, argmax_last(probs), tokens)


def row_seed_list(
    batch_size: int, seed: int | None, row_seeds: tuple[int, ...] | None
) -> list[int]:
    """One seed per row: `row_seeds` as given, else `seed` for all (a random one if None)."""
    if row_seeds is not None:
        if len(row_seeds) != batch_size:
            raise ValueError(
                f"row_seeds has {len(row_seeds)} seeds for {batch_size} prompts; give one "
                "seed per prompt"
            )
        return list(row_seeds)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    return [seed] * batch_size


class RowRandom:
    """One generator per row; draws are made row by row so batches do not mix streams."""

    def __init__(self, seeds: list[int]) -> None:
        self.generators = []
        for seed in seeds:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
            self.generators.append(generator)
        self.accepts: list[list[float]] = [[] for _ in seeds]  # this round's, per row

    @classmethod
    def for_batch(
        cls, batch_size: int, seed: int | None, row_seeds: tuple[int, ...] | None
    ) -> RowRandom:
        return cls(row_seed_list(batch_size, seed, row_seeds))

    def uniform(self, counts: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Row b draws counts[b] uniforms: [batch, max(counts)], zero-padded.

        How many numbers a row draws depends on that row alone, which keeps its stream, and so
        its output, independent of the other rows of the batch.
        """
        width = max(counts, default=0)
        out = torch.zeros(len(counts), width)
        for row, (generator, count) in enumerate(zip(self.generators, counts, strict=True)):
            if count:
                out[row, :count] = torch.rand(count, generator=generator)
        return out.to(device)

    def select(self, rows: list[int]) -> None:
        self.generators = [self.generators[i] for i in rows]
        self.accepts = [self.accepts[i] for i in rows]

    def add_rows(self, seeds: list[int]) -> None:
        """Rows that join a running batch, each with its own stream."""
        for seed in seeds:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
            self.generators.append(generator)
            self.accepts.append([])

    def begin_round(self, offsets: torch.Tensor) -> None:
        """Stream draws do not depend on positions; a round starts with no numbers drawn."""
        self.accepts = [[] for _ in self.generators]

    def draft_uniforms(
        self, index: int, active: list[bool], device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """[batch] numbers for drafting position `index` of the round; only active rows draw,
        two numbers each: the one that draws the token, and its acceptance number, kept for
        `accept_uniforms` and the verdict."""
        pairs = self.uniform([2 * int(a) for a in active])  # [batch, 2]: some row drafts
        for row, (drew, pair) in enumerate(zip(active, pairs.tolist(), strict=True)):
            if drew:
                self.accepts[row].append(pair[1])
        return pairs[:, 0].to(device)

    def accept_uniforms(self, index: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[batch] the acceptance numbers of the tokens drafted at position `index` of this
        round (1.0 for a row that drafted none there)."""
        numbers = [a[index] if index < len(a) else 1.0 for a in self.accepts]
        return torch.tensor(numbers, device=device)

    def verify_uniforms(self, num_drafted: torch.Tensor, k: int, device) -> torch.Tensor:
        """[batch, k + 1]: the acceptance tests of the k drafted slots (drawn with the drafts;
        a drafter that draws no numbers has them drawn here), then one for the recovered or
        bonus token. A row's count depends on that row alone."""
        counts = num_drafted.tolist()
        missing = [max(n - len(a), 0) for n, a in zip(counts, self.accepts, strict=True)]
        fresh = self.uniform([m + 1 for m in missing]).tolist()  # [batch][<= k + 1]
        rows = [
            kept[:n] + new[: m + 1]
            for n, m, kept, new in zip(counts, missing, self.accepts, fresh, strict=True)
        ]
        self.accepts = [[] for _ in self.generators]
        return torch.tensor([r + [0.0] * (k + 1 - len(r)) for r in rows], device=device)

    def resample_uniforms(
        self, uniforms: torch.Tensor, num_drafted: torch.Tensor, num_accepted: torch.Tensor
    ) -> torch.Tensor:
        """[batch] the number that draws the recovered or bonus token: the row's last."""
        return uniforms.gather(1, num_drafted[:, None]).squeeze(1)


DRAFT, ACCEPT, RESIDUAL = range(3)  # the three numbers of a position in `PositionRandom`


class PositionRandom(RowRandom):
    """Per row, three numbers per position of the sequence, fixed by the row's seed up front:
    one draws the drafted token there, one tests its acceptance, one draws the recovered (or
    bonus) token. What is decided at a position no longer depends on how the rounds fell.
    """

    def __init__(self, seeds: list[int], capacity: int, device: torch.device | str = "cpu") -> None:
        super().__init__(seeds)
        # [batch, capacity, 3]: drawn once from each row's generator, kept where decoding runs
        # so that a round's look-ups need no transfer
        table = torch.stack([torch.rand(capacity, 3, generator=g) for g in self.generators])
        self.table = table.to(device)
        self.offsets = torch.zeros(len(seeds), dtype=torch.long, device=device)

    def add_rows(self, seeds: list[int]) -> None:
        raise ValueError("coupled randomness runs fixed batches: rows cannot join it")

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.table.device)
        self.table = self.table.index_select(0, index)
        self.offsets = self.offsets.index_select(0, index)

    def begin_round(self, offsets: torch.Tensor) -> None:
        """`offsets[b]`: the position of slot 0 of this round (row b's committed length)."""
        self.offsets = offsets.to(self.table.device)

    def at(self, slots: torch.Tensor, which: int) -> torch.Tensor:
        """slots [batch, n] of this round -> [batch, n] numbers of kind `which` there."""
        index = self.offsets[:, None] + slots.to(self.table.device)  # no-op for own slots
        return self.table[..., which].gather(1, index.clamp(max=self.table.shape[1] - 1))

    def draft_uniforms(self, index, active, device="cpu") -> torch.Tensor:
        slots = torch.full((len(active), 1), index, dtype=torch.long, device=self.table.device)
        return self.at(slots, DRAFT)[:, 0].to(device)

    def accept_uniforms(self, index: int, device: torch.device | str = "cpu") -> torch.Tensor:
        rows = self.table.shape[0]
        slots = torch.full((rows, 1), index, dtype=torch.long, device=self.table.device)
        return self.at(slots, ACCEPT)[:, 0].to(device)

    def verify_uniforms(self, num_drafted, k, device) -> torch.Tensor:
        slots = torch.arange(k + 1, device=self.table.device).expand(len(num_drafted), k + 1)
        return self.at(slots, ACCEPT).to(device)

    def resample_uniforms(self, uniforms, num_drafted, num_accepted) -> torch.Tensor:
        return self.at(num_accepted[:, None], RESIDUAL)[:, 0].to(uniforms.device)
