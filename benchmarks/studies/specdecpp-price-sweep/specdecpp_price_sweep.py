"""How much can an adaptive draft length gain, as a function of what a drafted token costs?

A round of m drafted tokens costs 1 + (verify_slope + draft_cost) m target steps. A drafted
token that will be rejected wastes `draft_cost`; the head's whole gain over a constant k is
those wasted drafts saved (and, past them, the tokens of rounds a constant cut short). So the
gain scales with the drafter's price: near zero for a free drafter, large for a dear one. On
this 2-core CPU the int8 0.5B drafter costs 0.12-0.16 of a 1.5B target step; on a GPU at batch
1, where both models are bound by kernel launches and memory reads rather than arithmetic, a
0.5B drafter costs about half a 1.5B step or more.

This replays the recorded evaluation collections (rounds of 12, T = 0.7, inside real rounds;
`head collect --rounds 12`) at a sweep of drafter prices: the best constant k, the shipped
sampling head at its best threshold, the head with the acceptance number (`head-u`, u drawn
from its law given each recorded verdict), the head told r = p/q of a round's first drafted token
only (the most a head could learn from the target's state where a round starts: the target has
not seen the drafts yet), a head that knew r = p/q of every token, and one that knew the
verdicts. The same text and verdicts at every price; only the prices change.

    python benchmarks/studies/specdecpp-price-sweep/specdecpp_price_sweep.py TRAIN_DIR EVAL_DIR
        [EVAL_DIR ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdecode.acceptance.head import number_logit
from specdecode.acceptance.replay import preview_rounds
from specdecode.core.prices import Prices

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "specdecpp-uniform-feature"))
from specdecpp_uniform_feature import fitted_head, numbers, scored, verdicts

DRAFT_COSTS = (0.05, 0.1, 0.14, 0.2, 0.3, 0.5, 0.7)
# The 2-core AMD EPYC's verify pass on the padded kernels, in target steps for k = 1..12
# drafted tokens, as calibrated by a coupled HumanEval 0-15 bench on the padded kernels
# (2026-11-24)
PADDED_EPYC = (1.02, 1.00, 0.99, 0.97, 0.96, 1.08, 1.14, 1.13, 1.19, 1.17, 1.22, 1.32)
# (bound, verify line slope, verify curve): rounds of 1..6 at a flat verify cost, the padded
# kernels' curve over 1..12, and the line the replays used before the padding
SETTINGS = (((1, 6), 0.0, ()), ((1, 12), 0.0, PADDED_EPYC), ((1, 12), 0.056, ()))


def best_over_constant(data, pred, first, bound, costs) -> tuple[str, float, str]:
    cols = (data.prompt_index, data.position, data.round, data.slot)
    rows = preview_rounds(pred.float(), data.label, *cols, bound, costs, first_pred=first)
    constants = {k: v["est_speed"] for k, v in rows.items() if k.startswith("k=")}
    best = max(constants, key=constants.get)
    heads = {k: v["est_speed"] / constants[best] for k, v in rows.items() if k.startswith("head")}
    top = max(heads, key=heads.get)
    return best, heads[top] - 1, top.removeprefix("head ")


def main() -> None:
    head, w, _, _, eval_dirs = fitted_head(sys.argv[1:])
    for path in eval_dirs:
        data, z = scored(path, head)
        verdict = verdicts(data)
        known = verdict >= 0
        u = numbers(data.label, verdict, 0)
        r = data.label.double()
        preds = {  # name: (prediction, prediction for a round's first drafted token)
            "head": (torch.sigmoid(z), None),
            "head-u": (torch.sigmoid(number_logit(w, z, u)), None),
            "head, knew r of the first": (torch.sigmoid(z), r),
            "knew r": (r, None),
            "knew verdicts": (torch.where(known, verdict.double(), (u < r).double()), None),
        }
        for bound, slope, curve in SETTINGS:
            verify = Prices.stated(0, slope, curve).rounds(1).describe(bound[1])
            print(f"\n{path.name}, rounds {bound[0]}..{bound[1]}, {verify}")
            print("| drafted token costs | best constant | " + " | ".join(preds) + " |")
            print("|---|---|" + "---|" * len(preds))
            for cost in DRAFT_COSTS:
                costs = Prices.stated(draft=cost, verify_slope=slope, verify_curve=curve)
                cells, best = [], ""
                for pred, first in preds.values():
                    best, gain, h = best_over_constant(data, pred, first, bound, costs)
                    cells.append(f"{100 * gain:+.1f}% ({h})")
                print(f"| {cost:g} | {best} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
