"""Does the acceptance head pay on llama.cpp, and at what prices would it?

The default pair (Qwen2.5-Coder 0.5B drafting for 1.5B) on llama.cpp, greedy. The evaluation
collection is recorded inside real rounds of 12 on HumanEval 0-5 (`head collect --rounds 12`,
128 new tokens); the head is trained on a mixed collection of HumanEval 40-103 on llama.cpp's
drafter states (the shipped heads' recipe). Every policy is replayed on the recorded verdicts
(`head replay`: the same text for all, so the comparison is paired and exact), priced in target
steps; plain decoding is 1.0x.

The measured prices are llama.cpp's on this 2-core Xeon: a drafted token costs 0.64 target
steps; a verify pass of 2 / 3 / 5 / 8 / 12 tokens (1 / 2 / 4 / 7 / 11 drafted) costs
1.44 / 1.77 / 2.07 / 2.95 / 3.60 steps, interpolated linearly between and grown 0.16 a token past
11 (`measured_curve`). The sweep then lowers the drafter's price and scales the verify pass's
growth above one step (a machine with more cores, or a GPU build of llama.cpp, where a pass grows
less with its length), and bisects for the prices where drafting starts to pay.

    specdecode head collect --backend llama.cpp --threads 1 --prompts humaneval --limit 6 \
        --max-new-tokens 128 --temperature 0 --rounds 12 --batch-size 1 --out EVAL
    specdecode head collect --backend llama.cpp --threads 1 --prompts humaneval --skip 40 \
        --limit 64 --max-new-tokens 96 --temperature 0.7 --batch-size 8 --out DATA
    specdecode head train DATA --rule greedy --half --out HEAD
    python benchmarks/studies/llamacpp-head-replay/run.py EVAL HEAD [OTHER_HEAD ...]

writes replay.txt and replay.json beside this file (a bare name is looked up under
`$SPECDECODE_CACHE/heads`). OTHER_HEAD: e.g. the shipped greedy head, trained on the PyTorch
backend's states of the same weights, replayed on llama.cpp's states.
"""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

from specdecode.acceptance.examples import load_examples
from specdecode.acceptance.head import load_head
from specdecode.acceptance.metrics import auc
from specdecode.acceptance.replay import replay_heads
from specdecode.core.prices import Prices
from specdecode.models.packages import cache_root

HERE = Path(__file__).resolve().parent
BOUND = (1, 12)
DRAFT_COST = 0.64  # a drafted token, in target steps
MEASURED = {1: 1.44, 2: 1.77, 4: 2.07, 7: 2.95, 11: 3.60}  # verify pass by drafted tokens
SLOPE = 0.16  # each drafted token past the measured ones
DRAFT_COSTS = (0.64, 0.4, 0.2, 0.1)
VERIFY_SCALES = (1.0, 0.5, 0.25)  # the verify pass's growth above one step, scaled


def measured_curve() -> tuple[float, ...]:
    """The verify pass for 1..12 drafted tokens: `MEASURED` joined by straight lines, 0.16 a
    token past its end, rounded to 0.01 (as passed to `--verify-curve`)."""
    known = sorted(MEASURED.items())
    curve = []
    for m in range(1, BOUND[1] + 1):
        below = max((k, v) for k, v in known if k <= m)
        above = [(k, v) for k, v in known if k > m]
        if not above:
            curve.append(below[1] + SLOPE * (m - below[0]))
            continue
        (k0, v0), (k1, v1) = below, above[0]
        curve.append(v0 + (v1 - v0) * (m - k0) / (k1 - k0))
    return tuple(round(v, 2) for v in curve)


def priced(draft: float, scale: float) -> Prices:
    curve = tuple(round(1 + scale * (v - 1), 4) for v in measured_curve())
    return Prices.stated(draft, SLOPE * scale, curve)


def best(rows: dict, prefix: str) -> tuple[str, dict]:
    named = {k: v for k, v in rows.items() if k.startswith(prefix)}
    name = max(named, key=lambda k: named[k]["est_speed"])
    return name.removeprefix(prefix), named[name]


def located(name: str) -> str:
    """A path as given, or a bare name under `$SPECDECODE_CACHE/heads` (where the commands above
    write)."""
    return name if Path(name).exists() else str(cache_root() / "heads" / name)


def fastest(data_dir: str, head: str, draft: float, scale: float) -> tuple[float, float]:
    """(the head's best est. speed, flat or priced; the best constant's) at these prices."""
    res = replay_heads(data_dir, [head], BOUND, priced(draft, scale))
    rows = res["heads"][head].items()
    head_speed = max(v["est_speed"] for k, v in rows if k.startswith(("head ", "priced ")))
    return head_speed, max(v["est_speed"] for v in res["constants"].values())


def break_even(speed, low: float, high: float, steps: int = 9) -> float | None:
    """The price in [low, high] where `speed(price)` (falling with the price) crosses 1.0x."""
    if speed(low) < 1 or speed(high) > 1:
        return None  # no crossing inside
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if speed(middle) > 1 else (low, middle)
    return (low + high) / 2


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    data_dir, *heads = (located(arg) for arg in sys.argv[1:])
    names = " ".join(sys.argv[1:]).replace(str(Path.home()), "~")
    out = [f"python benchmarks/studies/llamacpp-head-replay/run.py {names}  ({date.today()})", ""]
    record: dict = {"collection": data_dir, "heads": heads, "bound": BOUND, "measured": {}}
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    out.append(
        f"{meta['num_examples']} drafted tokens recorded inside rounds of {meta['rounds']} on "
        f"{meta['prompts']} {meta['skip']}-{meta['skip'] + meta['num_prompts'] - 1}, "
        f"{meta['max_new_tokens']} new tokens, T = {meta['temperature']}, {meta['backend']} "
        f"({meta['seconds']:.0f} s of collection); mean greedy acceptance "
        f"{meta['mean_label_greedy']:.3f}"
    )
    data = load_examples(data_dir, "greedy", law=True)
    for head in heads:
        trained = json.loads((Path(head) / "training.json").read_text())["data"]["meta"]
        score = auc(load_head(head).float().acceptance(data.hidden, data.features), data.label)
        record[f"auc {head}"] = score
        backend = trained.get("backend", "torch")
        out.append(f"head {Path(head).name}: trained on {backend} states; AUC here {score:.3f}")

    costs = priced(DRAFT_COST, 1.0)
    result = replay_heads(data_dir, heads, BOUND, costs)
    record["measured"] = result
    shown_prices = costs.rounds(1).describe(BOUND[1])
    out += ["", f"At the measured prices ({shown_prices}), est. speed vs plain decoding:", ""]
    shown = [f"h={h}" for h in ("0.3", "0.5", "0.7", "0.9")]
    out.append("| k | " + " | ".join(f"k={k}" for k in range(1, 13)) + " |")
    out.append("|---|" + "---|" * 12)
    out.append(
        "| constant | "
        + " | ".join(f"{result['constants'][f'k={k}']['est_speed']:.3f}" for k in range(1, 13))
        + " |"
    )
    out += ["", "| head | " + " | ".join(shown) + " | best | priced, best | perfect head |"]
    out.append("|---|" + "---|" * (len(shown) + 3))
    for head in heads:
        rows = result["heads"][head]
        cells = [f"{rows[f'head {n}']['est_speed']:.3f}" for n in shown]
        h, top = best(rows, "head ")
        ph, ptop = best(rows, "priced ")
        cells += [f"{top['est_speed']:.3f} ({h})", f"{ptop['est_speed']:.3f} ({ph})"]
        cells.append(f"{rows['oracle h=0.5']['est_speed']:.3f}")
        out.append(f"| {Path(head).name} | " + " | ".join(cells) + " |")
    k, top = best(result["constants"], "")
    out.append(f"\nbest constant {k}: {top['est_speed']:.3f}x")

    out += [
        "",
        f"Sweep (head {Path(heads[0]).name}): est. speed vs plain decoding (1.0x) of the best "
        "constant, the head at its best threshold (flat and priced) and a perfect head; the "
        f"verify pass scaled as 1 + s (measured - 1), s x {SLOPE:g} a token past 12.",
        "",
        "| drafted token | verify growth s | best constant | head, best h | priced head, best h "
        "| perfect head | head vs best constant | drafting with the head pays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    record["sweep"] = []
    for draft in DRAFT_COSTS:
        for scale in VERIFY_SCALES:
            res = replay_heads(data_dir, heads[:1], BOUND, priced(draft, scale))
            rows = res["heads"][heads[0]]
            k, const = best(res["constants"], "")
            h, head = best(rows, "head ")
            ph, phead = best(rows, "priced ")
            perfect = rows["oracle h=0.5"]["est_speed"]
            speed = max(head["est_speed"], phead["est_speed"])
            pays = "yes" if speed > 1 else "no"
            low, high = (100 * (x - 1) for x in head["vs_best_constant_95"])
            out.append(
                f"| {draft:g} | {scale:g} | {const['est_speed']:.3f} ({k}) | "
                f"{head['est_speed']:.3f} ({h}) | {phead['est_speed']:.3f} ({ph}) | "
                f"{perfect:.3f} | {100 * (head['vs_best_constant'] - 1):+.1f}% "
                f"[{low:+.1f}%, {high:+.1f}%] | {pays} |"
            )
            setting = {"draft_cost": draft, "verify_scale": scale}
            record["sweep"].append(setting | {"constants": res["constants"], "head": rows})
    head = heads[0]
    even = {
        "draft cost, measured verify curve": [
            break_even(lambda c, i=i: fastest(data_dir, head, c, 1.0)[i], 0.05, DRAFT_COST)
            for i in (0, 1)
        ],
        "verify growth s, drafted token 0.64": [
            break_even(lambda v, i=i: fastest(data_dir, head, DRAFT_COST, v)[i], 0.05, 1.0)
            for i in (0, 1)
        ],
    }
    record["break_even"] = even
    out += ["", "Where drafting stops paying (1.0x, plain decoding), by bisection:", ""]
    out += ["| price swept | head (best h) pays below | best constant pays below |"]
    out += ["|---|---|---|"]
    for name, (by_head, by_constant) in even.items():
        cells = ["-" if x is None else f"{x:.3f}" for x in (by_head, by_constant)]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(out) + "\n"
    print(text, end="")
    (HERE / "replay.txt").write_text(text)
    summary = json.dumps(without_prompts(record), indent=1)  # names the collection and heads,
    (HERE / "replay.json").write_text(summary.replace(str(Path.home()), "~") + "\n")  # not whose


def without_prompts(value):
    """The record without each row's per-prompt counts (the bootstrap's input; 400 kB)."""
    if isinstance(value, dict):
        return {k: without_prompts(v) for k, v in value.items() if k != "per_prompt"}
    if isinstance(value, list):
        return [without_prompts(v) for v in value]
    return value


if __name__ == "__main__":
    main()
