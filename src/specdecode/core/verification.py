"""Verification rules: given a draft and the target's logits, decide what is committed.

One protocol, several rules, chosen by name from `RULES`:

* `greedy`: accept while the draft equals the target's argmax; the first mismatch is replaced by
  the argmax. Output equals the target's own greedy decoding.
* `sampling`: the lossless rule of Leviathan et al. (2023, Alg. 1) and Chen et al. (2023).
  Draft token d at position i is accepted with probability min(1, target_probs[d] /
  draft_probs[d]); the first rejected one is replaced by a sample from
  normalize(max(0, target_probs - draft_probs)); if all are accepted, a bonus token is sampled
  from the target. The output distribution equals the target's.

* `top-beta-tau`: SpecDec's relaxed rule (Xia et al., 2023) for a deterministic drafter. A draft
  token is accepted while it is among the target's top-beta tokens at its position and its
  log-probability is within tau of the top-1's; the first that fails is replaced by the target's
  top-1. beta = 1 is exactly greedy; beta > 1 trades fidelity for longer accepted runs, so its
  output is approximate (`exact` is False and every report marks it).

Vocabulary of the outcome (vLLM's): *accepted* draft tokens, a *recovered* token after a
rejection, a *bonus* token when everything was accepted. Every row has its own number of drafted
tokens (`num_drafted`), so rows stop drafting independently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.core.config import SamplingConfig
from specdecode.core.sampling import RowRandom, argmax_last, logits_to_probs, sample_from


@dataclass(frozen=True)
class Verdict:
    num_accepted: torch.Tensor  # [batch] leading draft tokens accepted
    next_tokens: torch.Tensor  # [batch] recovered (if num_accepted < num_drafted) or bonus


class VerificationRule(Protocol):
    """Decides, per row, how many draft tokens to keep and which token follows them."""

    name: str
    exact: bool  # True when the output equals the target's own decoding (greedy or in law)

    def verify(
        self,
        draft_tokens: torch.Tensor,  # [batch, k]
        draft_probs: torch.Tensor | None,  # [batch, k, vocab], None for a deterministic drafter
        target_logits: torch.Tensor,  # [batch, k + 1, vocab]
        num_drafted: torch.Tensor,  # [batch] valid draft tokens per row, <= k
        rng: RowRandom | None,
    ) -> Verdict: ...


def acceptance_probability(p_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """min(1, p/q): the chance a token drawn from q is kept when the target's law is p."""
    return torch.where(q_tok > 0, (p_tok / q_tok.clamp(min=1e-30)).clamp(max=1.0), 1.0)


def residual_law(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)), the law of the recovered token after a rejection.

    Where p == q leaves no mass (a rejection then has probability zero) the target itself is
    returned, which keeps the function total without changing the output law.
    """
    # [..., vocab] -> [..., vocab]
    residual = (target_probs - draft_probs).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs, residual)
    return residual / residual.sum(-1, keepdim=True)


def leading_true(accept: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row: [batch, k] -> [batch]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def drafted_mask(num_drafted: torch.Tensor, k: int) -> torch.Tensor:
    """[batch] -> [batch, k]: True where a row really drafted a token."""
    return torch.arange(k, device=num_drafted.device) < num_drafted[:, None]


class GreedyRule:
    name = "greedy"
    exact = True

    def __init__(self, sampling: SamplingConfig | None = None) -> None:
        del sampling  # greedy ignores temperature, top-k and top-p by definition

    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng) -> Verdict:
        best = argmax_last(target_logits)  # [batch, k + 1]
        k = draft_tokens.shape[1]
        accept = (draft_tokens == best[:, :k]) & drafted_mask(num_drafted, k)  # [batch, k]
        num_accepted = leading_true(accept)  # [batch]
        next_tokens = best.gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
        return Verdict(num_accepted, next_tokens)


class LosslessSamplingRule:
    name = "sampling"
    exact = True

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng) -> Verdict:
        if rng is None:
            raise ValueError("the sampling rule needs per-row random generators")
        batch, k = draft_tokens.shape
        target_probs = logits_to_probs(target_logits, self.sampling)  # [batch, k + 1, vocab]
        if draft_probs is None:  # a deterministic drafter proposes with probability one
            draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1])
        # laws past a row's own draft are padding (rows of a batch draft different lengths):
        # zero them, so that after a full acceptance the residual is the target itself (bonus)
        drafted = drafted_mask(num_drafted, k)  # [batch, k]
        draft_probs = draft_probs.to(target_probs.dtype) * drafted[..., None]
        padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], 1)
        uniforms = rng.verify_uniforms(num_drafted, k, target_probs.device)  # [batch, k + 1]
        index = draft_tokens[..., None]  # [batch, k, 1]
        p_tok = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [batch, k]
        q_tok = draft_probs.gather(-1, index).squeeze(-1)  # [batch, k]
        keep = uniforms[:, :k] < acceptance_probability(p_tok, q_tok)  # [batch, k]
        accept = keep & drafted
        num_accepted = leading_true(accept)  # [batch]
        at = num_accepted[:, None, None].expand(batch, 1, target_probs.shape[-1])
        # padded is zero from each row's num_drafted on: after a full acceptance, the target
        residual = residual_law(target_probs.gather(1, at), padded.gather(1, at)).squeeze(1)
        resample_u = rng.resample_uniforms(uniforms, num_drafted, num_accepted)  # [batch]
        return Verdict(num_accepted, sample_from(residual, resample_u))


@dataclass(frozen=True)
class TopBetaTau:
    """Parameters of the relaxed rule; the defaults are those of SpecDec's inference script."""

    beta: int = 5
    tau: float = 3.0

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise ValueError(f"beta must be an integer >= 1, got {self.beta!r}")
        if not (self.tau >= 0 and self.tau != float("inf")):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")

    @property
    def exact(self) -> bool:
        return self.beta == 1

    @property
    def label(self) -> str:
        return "b=1" if self.exact else f"b={self.beta},t={self.tau:g}"


class TopBetaTauRule:
    """Accept a draft token while it is in the target's top-beta and within tau of the top-1."""

    name = "top-beta-tau"

    def __init__(self, sampling: SamplingConfig, params: TopBetaTau | None = None) -> None:
        if not sampling.greedy:
            raise ValueError("top-beta-tau is a deterministic rule; use temperature 0")
        self.params = params or TopBetaTau()
        self.exact = self.params.exact

    def verify(self, draft_tokens, draft_probs, target_logits, num_drafted, rng) -> Verdict:
        k = draft_tokens.shape[1]
        logp = target_logits[:, :k].float().log_softmax(-1)  # [batch, k, vocab]
        top = logp.topk(self.params.beta, dim=-1)  # values, indices: [batch, k, beta]
        in_top = (top.indices == draft_tokens[..., None]).any(-1)  # [batch, k]
        draft_logp = logp.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, k]
        close = top.values[..., 0] - draft_logp <= self.params.tau  # [batch, k]
        accept = in_top & close & drafted_mask(num_drafted, k)
        num_accepted = leading_true(accept)  # [batch]
        # the top-1 of the k drafted positions is already in `top`; only the bonus one is new
        bonus = target_logits[:, k].argmax(-1, keepdim=True)  # [batch, 1]
        best = torch.cat([top.indices[..., 0], bonus], 1)  # [batch, k + 1]
        next_tokens = best.gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
        return Verdict(num_accepted, next_tokens)


def make_rule(
    name: str | None, sampling: SamplingConfig, relaxed: TopBetaTau | None = None
) -> VerificationRule:
    """Pick a rule by name; `None` means greedy at temperature 0 and lossless sampling above."""
    if relaxed is not None and name != "top-beta-tau":
        raise ValueError(f"beta/tau parameters belong to the top-beta-tau rule, not {name!r}")
    if name == "top-beta-tau":
        return TopBetaTauRule(sampling, relaxed)
    if name is None:
        name = "greedy" if sampling.greedy else "sampling"
    if name not in RULES:
        raise ValueError(f"unknown verification rule {name!r}; known: {sorted(RULES)}")
    if name == "sampling" and sampling.greedy:
        raise ValueError("the sampling rule needs temperature > 0; use 'greedy' at temperature 0")
    return RULES[name](sampling)


RULES: dict[str, Callable[[SamplingConfig], VerificationRule]] = {
    "greedy": GreedyRule,
    "sampling": LosslessSamplingRule,
    "top-beta-tau": TopBetaTauRule,
}
