"""Does knowing a drafted token's acceptance number help the head? An offline check.

Under sampling, drafted token x is accepted when u < min(1, p(x)/q(x)), with u uniform. The
number u does not depend on anything the round does, so a decoder may draw it when x is drafted
instead of when x is verified, and a stopping rule may read the u of every token drafted so far:
whether to draft position i + 1 then depends on positions up to i only, which keeps every
verdict exact (see `length_policies`). The head predicts E[min(1, p/q)]; with u known, the
chance of acceptance is P(p/q > u), which is sharper when u is near 0 or near 1.

For every drafted token of a collection made inside rounds (`head collect --rounds 12`), u is
drawn from its law given the recorded verdict (U(0, r) for an accepted token, U(r, 1) for the
rejected one, U(0, 1) past it, r = min(1, p/q) recorded), so (u, verdict) have their true joint
law. The calibration of the shipped head's logit z against u that policy `head-u` reads,
    logit P(accept) = bias + a z + b log u   (`head_calibration.fit_number_calibration`),
is fitted on a code collection (u drawn afresh, verdict 1[u < r], the head's loss weights) and
replayed on the evaluation collections at the 2-core AMD EPYC's prices, beside the head alone,
a head that knew r = p/q, and one that knew the verdicts.

    python benchmarks/studies/specdecpp-uniform-feature/specdecpp_uniform_feature.py TRAIN_DIR
        EVAL_DIR [EVAL_DIR ...]
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import torch

from specdecode.acceptance.calibration import NUMBER_DRAWS, fit_number_calibration
from specdecode.acceptance.examples import load_examples
from specdecode.acceptance.head import load_head, number_logit
from specdecode.acceptance.replay import preview_rounds, rounds_by_prompt
from specdecode.core.prices import Prices

CACHE = Path.home() / ".cache" / "specdecode" / "heads"
HEAD = Path(__file__).parents[1] / "src/specdecode/heads/qwen2.5-coder-0.5b-for-1.5b-sampling"
REJECT_WEIGHT = float(os.environ.get("REJECT_WEIGHT", 6.0))  # the head's own loss weight
COSTS = Prices.stated(draft=0.1375, verify_slope=0.056)


def verdicts(data) -> torch.Tensor:
    """[N] 1 accepted, 0 rejected, -1 past the rejection or in a response's last round."""
    out = torch.full((len(data.label),), -1)
    by_prompt = rounds_by_prompt(data.prompt_index, data.round, data.slot)
    for seq in by_prompt.values():
        for rows, after in itertools.pairwise(seq):
            accepted = int(data.position[after[0]]) - int(data.position[rows[0]]) - 1
            out[rows[:accepted]] = 1
            if accepted < len(rows):
                out[rows[accepted]] = 0
    return out


def numbers(r: torch.Tensor, verdict: torch.Tensor, seed: int) -> torch.Tensor:
    """[N] acceptance numbers with their law given the verdict."""
    v = torch.rand(len(r), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    r = r.double().clamp(0, 1)
    u = torch.where(verdict == 1, v * r, torch.where(verdict == 0, r + v * (1 - r), v))
    return u.clamp(1e-9, 1 - 1e-9)


def replayed(data, pred) -> tuple[str, float]:
    cols = (data.prompt_index, data.position, data.round, data.slot)
    rows = preview_rounds(pred.float(), data.label, *cols, (1, 12), COSTS)
    constants = {k: v["est_speed"] for k, v in rows.items() if k.startswith("k=")}
    best = max(constants, key=constants.get)
    heads = {
        k: v["est_speed"] / constants[best] - 1 for k, v in rows.items() if k.startswith("head")
    }
    top = max(heads, key=heads.get)
    return f"{top} {100 * heads[top]:+.1f}% over {best}", heads[top]


def scored(path: Path, head):
    """A sampling collection and the head's logits on it ([N])."""
    data = load_examples(path, "sampling", law=True, drawn=True)
    with torch.no_grad():
        return data, head(data.hidden, data.features).double()


def fitted_head(args: list[str]):
    """The shipped sampling head, its number calibration fitted on the first collection named
    (as `head-u` reads it), that collection's size and path, and the other collections' paths."""
    train_dir, *eval_dirs = (Path(a) if "/" in a else CACHE / a for a in args)
    head = load_head(HEAD).float()
    data, z = scored(train_dir, head)
    return head, fit_number_calibration(z, data.label, REJECT_WEIGHT), len(z), train_dir, eval_dirs


def main() -> None:
    head, w, size, train_dir, eval_dirs = fitted_head(sys.argv[1:])
    print(
        f"calibration fitted on {train_dir.name} ({size} tokens x {NUMBER_DRAWS} numbers, "
        f"reject weight {REJECT_WEIGHT:g}): bias {w[0]:.3f}, z {w[1]:.3f}, log u {w[2]:.3f}"
    )
    for path in eval_dirs:
        data, z = scored(path, head)
        verdict = verdicts(data)
        known = verdict >= 0
        print(
            f"{path.name}: {len(z)} tokens, {int(known.sum())} with a verdict, "
            f"acceptance {verdict[known].double().mean():.3f}"
        )
        for seed in range(3):
            u = numbers(data.label, verdict, seed)
            truth = torch.where(known, verdict.double(), (u < data.label.double()).double())
            with_u = torch.sigmoid(number_logit(w, z, u))
            preds = {
                "head": torch.sigmoid(z),
                "head + u": with_u,
                "r = p/q": data.label.double(),  # a head that knew the target's law
                "verdicts": truth,  # one that also knew the number: r and u
            }
            for name, pred in preds.items():
                corr = float(torch.corrcoef(torch.stack([pred[known], truth[known]]))[0, 1])
                text, _ = replayed(data, pred)
                print(f"  seed {seed} {name:>9}: corr with verdict {corr:.3f}; {text}")


if __name__ == "__main__":
    main()
