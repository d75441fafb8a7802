"""From logits to tokens: one processing function for target and drafter, per-row randomness.

The lossless guarantee of speculative sampling holds only if the draft probabilities that enter
the acceptance ratio are exactly the distribution each draft token was drawn from, and the target
distribution gets the same temperature, top-k and top-p. Both models therefore go through
`logits_to_probs` below, in fp32, and tokens are drawn from those very tensors.

Randomness is per row: each row owns a `torch.Generator` and draws a fixed number of uniforms per
step, whatever the other rows do, so a row's output depends on its own seed alone and not on the
batch it shares.
"""

from __future__ import annotations

import torch

from specdecode.config import SamplingConfig


class InvalidLogitsError(FloatingPointError):
    """A model produced NaN or +inf logits, or a row with no finite logit."""


def bad_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN, +inf, or a position whose every logit is -inf (a single -inf is a legitimate mask).

    Returns a device-side flag, so the hot loop checks every logit with one host sync per step.
    One reduction does it (see `bad_maxima`): at small models' sizes every extra pass over the
    vocabulary is a measurable share of a step.
    """
    # logits: [..., vocab] -> [] bool
    return bad_maxima(logits.amax(dim=-1))


def bad_maxima(maxima: torch.Tensor) -> torch.Tensor:
    """`bad_logits` from each position's largest logit, for callers that take the max anyway.

    A position's max is NaN when any of its logits is NaN (max propagates NaN), +inf when one is
    +inf, and -inf when all are -inf: it is finite exactly when the position is usable.
    """
    # maxima: [...] -> [] bool
    return ~torch.isfinite(maxima).all()


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax, in fp32. Greedy gives a one-hot."""
    # logits: [..., vocab] -> probs: [..., vocab] float32
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
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
    return torch.where(zero, probs.argmax(-1), tokens)


class RowRandom:
    """One generator per row; draws are made row by row so batches do not mix streams."""

    def __init__(self, seeds: list[int]) -> None:
        self.generators = []
        for seed in seeds:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
            self.generators.append(generator)

    @classmethod
    def for_batch(
        cls, batch_size: int, seed: int | None, row_seeds: tuple[int, ...] | None
    ) -> RowRandom:
        if row_seeds is not None:
            if len(row_seeds) != batch_size:
                raise ValueError(
                    f"row_seeds has {len(row_seeds)} seeds for {batch_size} prompts; give one "
                    "seed per prompt"
                )
            return cls(list(row_seeds))
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        return cls([seed] * batch_size)

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
