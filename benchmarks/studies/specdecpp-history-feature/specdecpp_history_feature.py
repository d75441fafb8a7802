"""Does a row's recent acceptance predict the next round's? An offline check on collections.

For every drafted token of a collection made inside rounds (`head collect --rounds 12`), the
feature is the mean acceptance label of the committed drafted tokens in the 16 positions before
its round starts (what a decoder knows for free after verifying them). Printed: its correlation
with the label, next to the shipped sampling head's; then a logistic fit of the label on the
head's logit plus the feature (trained on the code and chat training collections), replayed on
the evaluation collections at the 2-core AMD EPYC's prices against the head alone.

    python benchmarks/studies/specdecpp-history-feature/specdecpp_history_feature.py [WINDOW]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdecode.acceptance.examples import load_examples
from specdecode.acceptance.head import load_head
from specdecode.acceptance.replay import preview_rounds, rounds_by_prompt
from specdecode.core.prices import Prices

CACHE = Path.home() / ".cache" / "specdecode" / "heads"
HEAD = Path(__file__).parents[1] / "src/specdecode/heads/qwen2.5-coder-0.5b-for-1.5b-sampling"
COSTS = Prices.stated(draft=0.1375, verify_slope=0.056)


def with_history(name: str, head, window: int):
    data = load_examples(CACHE / name, "sampling", law=True, drawn=True)
    with torch.no_grad():
        pred = head.acceptance(data.hidden, data.features)  # [N]
    pos, label = data.position, data.label
    by_prompt = rounds_by_prompt(data.prompt_index, data.round, data.slot)
    feature, known = torch.full((len(label),), 0.6), torch.zeros(len(label))
    for seq in by_prompt.values():
        committed: dict[int, float] = {}  # position -> label of the drafted token committed there
        for j, rows in enumerate(seq):
            start = int(pos[rows[0]])
            seen = [committed[q] for q in range(start - window, start) if q in committed]
            if seen:
                feature[rows], known[rows] = sum(seen) / len(seen), 1.0
            accepted = int(pos[seq[j + 1][0]]) - start - 1 if j + 1 < len(seq) else len(rows)
            committed |= {int(pos[i]): float(label[i]) for i in rows[:accepted]}
    return data, pred, feature, known


def inputs(pred, feature, known) -> torch.Tensor:
    logit = torch.logit(pred.clamp(1e-4, 1 - 1e-4))
    return torch.stack([logit, feature - 0.6, known, torch.ones_like(logit)], 1)  # [N, 4]


def fit(x: torch.Tensor, y: torch.Tensor, reject_weight: float = 6.0) -> torch.Tensor:
    w = torch.zeros(x.shape[1])
    w[0] = 1.0
    w.requires_grad_(True)
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure():
        opt.zero_grad()
        z = x @ w
        logsig = torch.nn.functional.logsigmoid
        loss = -(y * logsig(z) + reject_weight * (1 - y) * logsig(-z)).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def best_vs_constant(data, pred) -> str:
    cols = (data.prompt_index, data.position, data.round, data.slot)
    rows = preview_rounds(pred, data.label, *cols, (1, 12), COSTS)
    best = max((v["est_speed"] for k, v in rows.items() if k.startswith("k=")))
    heads = {k: v["est_speed"] / best - 1 for k, v in rows.items() if k.startswith("head")}
    top = max(heads, key=heads.get)
    return f"{top} {100 * heads[top]:+.1f}% over the best constant"


def main() -> None:
    window = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    head = load_head(HEAD).float()
    sets = {
        name: with_history(name, head, window)
        for name in (
            "data-rounds12-mtbench-10-80", "data-rounds12-humaneval-40-104",
            "eval-rounds12-mtbench-10-t07", "eval-rounds12-humaneval-0-16",
        )
    }  # fmt: skip
    for name, (data, pred, feature, _) in sets.items():
        corr = [float(torch.corrcoef(torch.stack([v, data.label]))[0, 1]) for v in (pred, feature)]
        print(f"{name}: corr(head, label) {corr[0]:.3f}, corr(history, label) {corr[1]:.3f}")
    train = [sets[n] for n in ("data-rounds12-mtbench-10-80", "data-rounds12-humaneval-40-104")]
    x = torch.cat([inputs(p, f, k) for _, p, f, k in train])
    y = torch.cat([d.label for d, *_ in train])
    w = fit(x, y)
    print(f"fit: head logit {w[0]:.3f}, history {w[1]:.3f}, known {w[2]:.3f}, bias {w[3]:.3f}")
    for name in ("eval-rounds12-mtbench-10-t07", "eval-rounds12-humaneval-0-16"):
        data, pred, feature, known = sets[name]
        both = torch.sigmoid(inputs(pred, feature, known) @ w)
        alone, joint = best_vs_constant(data, pred), best_vs_constant(data, both)
        print(f"{name}: head alone {alone}; with history {joint}")


if __name__ == "__main__":
    main()
