"""The labels a collection gives a drafted token, under greedy and under sampling.

Both collections (`collect`'s mixed sequences and `rounds`' real rounds) label their examples
with these, so they live below both.
"""

from __future__ import annotations

import torch


def drawn_acceptance(
    p_law: torch.Tensor, q_law: torch.Tensor, drawn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling laws p_law, q_law [..., vocab], drawn [...] (drawn from q_law) ->
    (min(1, p/q) of the drawn token [...], log q of it [...])."""
    pick = drawn[..., None]
    p_drawn = p_law.gather(-1, pick)[..., 0]
    q_drawn = q_law.gather(-1, pick)[..., 0]  # > 0: it was drawn
    return (p_drawn / q_drawn).clamp(max=1.0), q_drawn.clamp_min(1e-30).log()


def acceptance_labels(
    greedy: torch.Tensor,
    p_law: torch.Tensor | None,
    q_law: torch.Tensor | None,
    drawn: torch.Tensor,
    top_log_prob: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampling labels of drafted tokens, for both collections (mixed and inside rounds).

    greedy [...]: argmax agreement; p_law, q_law [..., vocab]: the sampling laws, None under
    greedy, where the drawn token is the argmax and top_log_prob [...] its log probability;
    drawn [...]. -> (label_sampling, label_drawn, drawn_log_prob), each [...].
    """
    if p_law is None or q_law is None:
        return greedy, greedy, top_log_prob
    soft = torch.minimum(p_law, q_law).sum(-1).clamp(0, 1)
    return (soft, *drawn_acceptance(p_law, q_law, drawn))
