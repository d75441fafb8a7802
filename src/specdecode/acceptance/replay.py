"""Replaying length policies on recorded data: what a head would gain, before decoding with it.

Two replays, both priced in target steps by a `Prices` (one row's rounds, `Prices.rounds`):
* `preview_policies`, along the mixed sequences of a collection: a round starts where the last
  one ended and accepts its tokens with the labels' probabilities, and a backward recursion
  gives the exact expected rounds, tokens and cost;
* `preview_rounds`, on a collection recorded inside real rounds (`head collect --rounds K`):
  coupled on the same random numbers, every policy commits the same text, so each one's rounds
  are counted on the recorded verdicts themselves, with no model of acceptance.
`replay_heads` runs saved heads, every constant k and a perfect head through the second, with a
paired bootstrap over prompts: the comparison the bench cannot make under sampling, where each
method writes its own text.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from specdecode.acceptance.examples import HeadData, load_examples
from specdecode.core.length_policies import going_on_prices, worth_drafting_on
from specdecode.core.prices import Prices, RoundCosts

# The preview's prices when none are given: the default pair's on a 2-core Intel Xeon (the int8
# 0.5B drafter against the 1.5B target, from `specdecode bench`'s calibration: a drafted token
# 0.23 steps, a verify pass 1.04 + 0.07 k). A curve matters where the machine's cost is not a
# line (`Prices.stated`): on the 2-core AMD EPYC, with padded products, a pass of 1 to 6 drafted
# tokens costs about one step and 7 or 8 cost 1.2-1.3, so a line either overprices short
# passes or underprices long ones, and the replayed gain of a head swings with it.
PREVIEW_COSTS = (0.23, 0.07)  # a drafted token, and each position a verify pass adds
PREVIEW_PRICES = Prices.stated(*PREVIEW_COSTS)


PREVIEW_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def _stop_lengths(keep: torch.Tensor, low: int, h: float) -> torch.Tensor:
    """keep [N, MAX] (running product of acceptances of a round starting at each position) ->
    [N] drafted tokens: the first m >= low with 1 - keep > h, else MAX."""
    high = keep.shape[1]
    steps = torch.arange(1, high + 1)[None, :]  # [1, MAX]
    stop = (1 - keep > h) & (steps >= low)  # [N, MAX] a stop after token m
    return torch.where(stop, steps, high).min(1).values


def _run_rounds(
    label: torch.Tensor, starts: list[int], drafted: torch.Tensor, costs: RoundCosts
) -> dict[str, float]:
    """Expected totals when rounds follow one another along each response.

    label [N] acceptance probabilities in response order; starts: the first index of each
    response (and N at the end); drafted [N] tokens a round starting there drafts. A round at t
    accepts n tokens with probability prod_{i<n} a_{t+i} (1 - a_{t+n}) (n < m), or
    prod_{i<m} a_{t+i} (n = m), commits n + 1 and the next round starts at t + n + 1. A backward
    recursion gives each response's expected rounds, tokens, drafted tokens and cost exactly.
    """
    a, m_all = label.tolist(), drafted.tolist()
    totals = [0.0, 0.0, 0.0, 0.0]  # rounds, committed tokens, drafted tokens, cost
    for first, last in itertools.pairwise(starts):
        length = last - first
        ahead = [[0.0] * 4 for _ in range(length + 2)]  # expectations from position t on
        for t in range(length - 1, -1, -1):
            m = m_all[first + t]
            here = [1.0, 0.0, float(m), costs.round_cost(m)]
            survive = 1.0  # P(the first n drafted tokens all accepted)
            for n in range(m + 1):
                chance = survive * (1 - a[first + t + n]) if n < m else survive
                rest = ahead[min(t + n + 1, length)]
                here[0] += chance * rest[0]
                here[1] += chance * (n + 1 + rest[1])
                here[2] += chance * rest[2]
                here[3] += chance * rest[3]
                if n < m:
                    survive *= a[first + t + n]
            ahead[t] = here
        totals = [x + y for x, y in zip(totals, ahead[0], strict=True)]
    rounds, tokens, drafted_total, cost = totals
    return {
        "tokens_per_round": tokens / rounds,
        "drafted_per_round": drafted_total / rounds,
        "est_speed": tokens / cost,
    }


def preview_policies(
    pred: torch.Tensor,
    label: torch.Tensor,
    prompt_index: torch.Tensor,
    position: torch.Tensor,
    bound: tuple[int, int] = (1, 12),
    costs: Prices | None = None,
) -> dict[str, dict[str, float]]:
    """What each stop threshold (and each constant k) would do on held-out responses.

    Decoding is replayed along each response: a round starts where the last one ended, the head
    stops it once 1 - prod(pred) > h (within `bound`), and its accepted tokens follow the labels
    (0/1 under greedy; each drafted token's acceptance probability under sampling, so the
    replay takes the expectation over verdicts). `est_speed` is committed tokens per target step
    under `costs`. Rounds starting where earlier rounds end, rather than at every position,
    matter: decoding spends more of its rounds in hard stretches, where a constant k wastes its
    drafts and a head stops early, and starting everywhere under-weights them. Still a guide
    for choosing thresholds, not a measurement: the states follow the mixed collection
    sequences, not real drafts. Rows `oracle h=...` run the rule on the labels themselves: the
    most any head could get from these responses.
    """
    # pred, label, prompt_index, position: [N]
    at = (costs or PREVIEW_PRICES).rounds(1)
    order = torch.argsort(prompt_index * (int(position.max()) + 1) + position)
    pred, label, prompt = pred[order].double(), label[order].double(), prompt_index[order]
    low, high = bound
    n = len(pred)
    # windows[j, m] = the m-th position of a round starting at j (same response, else absent)
    idx = torch.arange(n)[:, None] + torch.arange(high)[None, :]  # [N, MAX]
    inside = (idx < n) & (prompt[idx.clamp(max=n - 1)] == prompt[:, None])
    idx = idx.clamp(max=n - 1)
    keep_p = torch.where(inside, pred[idx], 0.0).cumprod(1)  # [N, MAX] predicted all-accepted
    keep_l = torch.where(inside, label[idx], 0.0).cumprod(1)  # [N, MAX] actual all-accepted
    starts = torch.nonzero(torch.diff(prompt, prepend=prompt[:1] - 1)).squeeze(1).tolist() + [n]
    available = inside.sum(1)  # [N]

    def replay(drafted: torch.Tensor) -> dict[str, float]:
        return _run_rounds(label, starts, torch.minimum(drafted, available), at)

    rows = {f"k={k}": replay(torch.full((n,), k)) for k in range(1, high + 1)}
    rows |= {f"head h={h:g}": replay(_stop_lengths(keep_p, low, h)) for h in PREVIEW_THRESHOLDS}
    # The same rule fed the true labels: what a perfect head would do on these rounds, the
    # ceiling for head training (greedy: stop exactly at the first rejection; sampling: the
    # exact acceptance probability of each drafted token, still a gamble on the verdict)
    rows |= {f"oracle h={h:g}": replay(_stop_lengths(keep_l, low, h)) for h in PREVIEW_THRESHOLDS}
    return rows


BONUS = -1  # in a chain of recorded rounds: the bonus token after a round that accepted all


def rounds_by_prompt(
    prompt_index: torch.Tensor, round_id: torch.Tensor, slot: torch.Tensor
) -> dict[int, list[list[int]]]:
    """A collection inside rounds as prompt -> its rounds in decoding order, each the example
    rows of slots 0, 1, ... (all [N] inputs)."""
    order = torch.argsort(round_id * (int(slot.max()) + 1) + slot).tolist()
    rounds: dict[int, list[int]] = {}
    for i in order:
        rounds.setdefault(int(round_id[i]), []).append(i)
    by_prompt: dict[int, list[list[int]]] = {}
    for rows in rounds.values():  # round ids grow with decoding steps
        if [int(slot[i]) for i in rows] != list(range(len(rows))):
            raise ValueError("each recorded round must hold the slots 0..m-1 of its drafted tokens")
        by_prompt.setdefault(int(prompt_index[rows[0]]), []).append(rows)
    return by_prompt


def _chained_rounds(
    prompt_index: torch.Tensor, position: torch.Tensor, round_id: torch.Tensor, slot: torch.Tensor
) -> list[tuple[list[int], int]]:
    """Recorded rounds joined into chains: (example rows, accepted count before the rejection).

    A round's accepted count is where the next round of its response starts, less one (the
    token committed after the accepted drafts); the last round of each response has no
    successor and is left out. A round that accepted all its drafts continues, through its
    bonus token (`BONUS`, a position with no recorded draft), into the next one, so that a
    replayed round may run past the recorded round's end.
    """
    chains = []
    for prompt, seq in rounds_by_prompt(prompt_index, round_id, slot).items():
        chain: list[int] = []
        for rows, after in itertools.pairwise(seq):
            accepted = int(position[after[0]]) - int(position[rows[0]]) - 1
            if not 0 <= accepted <= len(rows):
                raise ValueError(
                    f"recorded rounds do not chain: a round of {len(rows)} drafts is followed "
                    f"{accepted + 1} positions later"
                )
            if accepted < len(rows):  # a rejection ends the chain
                chains.append((chain + rows, len(chain) + accepted, prompt))
                chain = []
            else:  # all accepted: the bonus token, then the next round, continue the chain
                chain += rows + [BONUS]
        if chain:
            chains.append((chain[:-1], len(chain) - 1, prompt))
    return chains


def preview_rounds(
    pred: torch.Tensor,
    label: torch.Tensor,
    prompt_index: torch.Tensor,
    position: torch.Tensor,
    round_id: torch.Tensor,
    slot: torch.Tensor,
    bound: tuple[int, int] = (1, 12),
    costs: Prices | None = None,
    first_pred: torch.Tensor | None = None,
) -> dict[str, dict[str, Any]]:
    """Each policy replayed on the recorded responses themselves, with the recorded verdicts.

    A collection inside rounds of K (`head collect --rounds K`) holds, per round, the K drafts
    with their states, and (from where the next round starts) how many were accepted. Coupled
    on the same random numbers, any length policy commits the very same text; only where its
    rounds end differs. Recorded rounds that accepted everything are joined, through their
    bonus token, to the next into one chain of drafts ending at a rejection. A round of the
    replayed policy starting at slot s of a chain drafts m tokens (its decisions read the
    recorded states at slots s, s+1, ...), and then:
    - if the chain accepted them all, they are committed with the token after them, which is
      the recorded draft at slot s + m when that was accepted (the bonus token and the accepted
      draft are one coupled draw), so the next round starts at slot s + m + 1;
    - otherwise it commits the accepted ones and the recorded correction, and the next round
      starts at the next chain.
    So the counts are those decoding with the policy would make on this text, with no model of
    acceptance, with one approximation: a recorded bonus token has no draft, so a replayed
    round that passes over it counts it as a drafted token predicted and labelled 1 (accepted,
    no stop), and a round starting at the bonus token that ends a chain drafts one.
    `oracle h=...` feeds the rule the acceptance labels; `head h=...` the head's predictions,
    or `first_pred` [N] for a round's first drafted token when given (what a policy knowing more
    where a round starts would predict there, e.g. from the target's state at that point).
    A round of m drafted tokens costs `costs.rounds(1).round_cost(m)` target steps. Each row
    also lists, per prompt (in prompt order), the committed tokens, rounds, drafted tokens and
    steps.
    """
    # pred, label, prompt_index, position, round_id, slot: [N]
    rounds_at = (costs or PREVIEW_PRICES).rounds(1)
    chained = _chained_rounds(prompt_index, position, round_id, slot)
    low, high = bound
    pred_l, label_l = pred.double().tolist() + [1.0], label.double().tolist() + [1.0]  # BONUS
    first_l = None if first_pred is None else first_pred.double().tolist() + [1.0]

    def replay(stop_after) -> dict[str, Any]:
        per_prompt: dict[int, list[float]] = {}  # prompt -> [committed, rounds, drafted, steps]
        for rows, accepted, prompt in chained:
            rounds = committed = drafted = steps = 0
            s = 0
            while s <= accepted and s < len(rows):
                m = stop_after(rows[s : s + high])
                rounds, drafted, steps = rounds + 1, drafted + m, steps + rounds_at.round_cost(m)
                if s + m <= accepted:  # all m accepted: commit them and the coupled next token
                    committed += m + 1
                    s += m + 1
                else:
                    committed += accepted - s + 1
                    s = accepted + 1
            if s == len(rows) == accepted:  # a chain cut by the data ends in a bonus token
                rounds, drafted, committed = rounds + 1, drafted + 1, committed + 1
                steps += rounds_at.round_cost(1)
            totals = per_prompt.setdefault(prompt, [0, 0, 0, 0.0])
            for j, x in enumerate((committed, rounds, drafted, steps)):
                totals[j] += x
        committed, rounds, drafted, steps = (
            sum(t[j] for t in per_prompt.values()) for j in range(4)
        )
        return {
            "tokens_per_round": committed / rounds,
            "drafted_per_round": drafted / rounds,
            "est_speed": committed / steps,
            "per_prompt": [per_prompt[p] for p in sorted(per_prompt)],
        }

    def threshold(values: list[float], h: float, first: list[float] | None = None):
        first = values if first is None else first

        def stop_after(rows: list[int]) -> int:
            keep = 1.0
            for m, i in enumerate(rows, 1):
                keep *= (first if m == 1 else values)[i]
                if m >= low and 1 - keep > h:
                    return m
            return len(rows)

        return stop_after

    def priced(values: list[float], h: float):
        bar = going_on_prices(rounds_at, h, high)  # [high, high]

        def stop_after(rows: list[int]) -> int:
            keep = 1.0
            for m, i in enumerate(rows, 1):
                keep *= values[i]
                if m >= low:  # the bar's row for `high` drafted is all inf: a stop there
                    last = torch.tensor([values[i]], dtype=torch.float64)
                    if not worth_drafting_on(last.new_tensor([keep]), last, bar[m - 1]):
                        return m
            return len(rows)

        return stop_after

    out = {f"k={k}": replay(lambda rows, k=k: min(k, len(rows))) for k in range(1, high + 1)}
    out |= {f"head h={h:g}": replay(threshold(pred_l, h, first_l)) for h in PREVIEW_THRESHOLDS}
    if rounds_at.draft > 0 and first_l is None:  # the head told these prices (`--priced`)
        out |= {f"priced h={h:g}": replay(priced(pred_l, h)) for h in PREVIEW_THRESHOLDS}
    out |= {f"oracle h={h:g}": replay(threshold(label_l, h)) for h in PREVIEW_THRESHOLDS}
    return out


def _paired_interval(
    row: dict[str, Any], base: dict[str, Any], resamples: int = 2000
) -> list[float]:
    """95% bootstrap interval over prompts of a replayed policy's speed ratio to `base`.

    Paired: both replay the same recorded text, so a resample draws prompts, not texts.
    """
    a = torch.tensor(row["per_prompt"], dtype=torch.float64)  # [P, 4] committed, .., steps
    b = torch.tensor(base["per_prompt"], dtype=torch.float64)
    pick = torch.randint(len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(0))

    def speed(t: torch.Tensor) -> torch.Tensor:  # [resamples, P, 4] -> [resamples]
        total = t.sum(1)
        return total[:, 0] / total[:, 3]

    ratios = speed(a[pick]) / speed(b[pick])
    return [
        float(x) for x in torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=ratios.dtype))
    ]


def replay_heads(
    data_dir: str | Path,
    heads: list[str | Path],
    bound: tuple[int, int] = (1, 12),
    costs: Prices | None = None,
) -> dict[str, Any]:
    """Replay saved heads (and every constant k, and a perfect head) on a collection made
    inside rounds, e.g. on evaluation prompts: the paired comparison the bench cannot make
    under sampling, where each method writes its own text.

    Returns {"examples", "best_constant", "constants": rows, "heads": {dir: rows}}, rows as
    `preview_rounds` gives them, with `vs_best_constant` added.
    """
    from specdecode.acceptance.head import load_head

    loaded = [(str(h), load_head(h).float()) for h in heads]
    if not loaded:
        raise ValueError("name at least one head to replay (--head DIR)")
    result: dict[str, Any] = {"heads": {}}
    collections: dict[tuple, HeadData] = {}  # heads that read the same columns share one load
    for name, head in loaded:
        reads = (head.config.rule, head.reads_law, head.reads_drawn)
        if reads not in collections:
            rule, law, drawn = reads
            collections[reads] = load_examples(data_dir, rule, law=law, drawn=drawn)
        data = collections[reads]
        if data.round is None or data.slot is None:
            raise ValueError(
                f"{data_dir} was collected along mixed sequences; replaying needs a collection "
                "inside rounds (`specdecode head collect --rounds K`)"
            )
        pred = head.acceptance(data.hidden, data.features)  # [N]
        columns = (data.prompt_index, data.position, data.round, data.slot)
        rows = preview_rounds(pred, data.label, *columns, bound, costs)
        constants = {k: v for k, v in rows.items() if k.startswith("k=")}
        best = max(constants, key=lambda k: constants[k]["est_speed"])
        for row in rows.values():
            row["vs_best_constant"] = row["est_speed"] / constants[best]["est_speed"]
            row["vs_best_constant_95"] = _paired_interval(row, constants[best])
        result["heads"][name] = {k: v for k, v in rows.items() if not k.startswith("k=")}
        result |= {"examples": len(pred), "best_constant": best, "constants": constants}
    return result
