"""Does what the plan learned on one kind of text mislead it on the next? On the simulated
machines (`tests/simulated_machine.py`), one row decodes code for 800 rounds, then chat; the
chat rounds from 200 after the switch are measured against the best of plain and the fixed
lengths on chat. The same run is repeated with the judge's worth, the lookup and corpus keys'
acceptance, or both forgotten at the switch (what a worth or an estimate per kind of text
would give): where forgetting changes nothing, what code taught does not carry.

    cd benchmarks/studies/plan-simulator && python text_switch.py > text_switch.txt
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import simulated_machine as sm
from test_plan_simulated import best_fixed

from specdecode.core.drafting import planners

SHIFT, ROUNDS, SETTLE = 800, 2000, 200
made: dict[str, object] = {}
forget = {"what": ""}


class Judge(sm.Outcomes):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        made["judge"] = self


class Planner(sm.PricedPlanner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        made["planner"] = self


class World(sm.World):
    def __setattr__(self, name: str, value: object) -> None:
        if name == "text" and hasattr(self, "text") and value is not self.text:
            if "worth" in forget["what"]:
                made["judge"].counts.clear()
            if "keys" in forget["what"]:
                p = made["planner"]
                priors = p.by_ngram.priors
                p.by_ngram = planners.Acceptance(
                    len(priors), planners.KEY_MEMORY, planners.KEY_RELAX, priors
                )
        super().__setattr__(name, value)


sm.Outcomes, sm.PricedPlanner, sm.World = Judge, Planner, World
print(
    f"# one row, code for {SHIFT} rounds then chat, {ROUNDS} rounds; chat measured from "
    f"{SETTLE} rounds after the switch, over the best of plain and fixed lengths on chat"
)
print("curve seed | nothing forgotten | worth | keys' acceptance | both")
for curve, seed in (("epyc", 5), ("epyc", 11), ("full-step", 5), ("full-step", 11),
                    ("xeon", 5), ("gpu", 5)):  # fmt: skip
    _, best = best_fixed(
        sm.CURVES[curve], sm.TEXTS["chat"], rounds=ROUNDS - SHIFT, warmup=SETTLE, seed=seed
    )
    cells = []
    for what in ("", "worth", "keys", "worth keys"):
        forget["what"] = what
        run = sm.run(
            sm.CURVES[curve], sm.TEXTS["code"], "auto", rounds=ROUNDS, warmup=0, seed=seed,
            shift_round=SHIFT, after_text=sm.TEXTS["chat"],
        )  # fmt: skip
        late = run.per_round[SHIFT + SETTLE :]
        cells.append(sum(t for t, _, _ in late) / sum(s for _, s, _ in late) / best)
    print(f"{curve} {seed} | " + " | ".join(f"{c:.3f}" for c in cells), flush=True)
