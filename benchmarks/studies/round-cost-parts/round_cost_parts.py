"""Where a speculative round's time goes beyond the forward passes, by round length.

The bench's model prices a round by its forward passes as calibrated (a target pass over k + 1
positions, k drafter passes). Measured after the first round, rounds of 6 or more drafted
tokens came out some 8% dearer, next to rounds of 4 or 5, than that model says (a coupled
HumanEval 0-15 bench on the padded kernels, 2026-11-24: measured over modelled 1.08-1.11 for
k = 4-5, 1.02 for k = 6 and 8). This decodes the same prompts with constant
k = 2, 4, 5, 6, 8 (coupled, T = 0.7, so every k commits the same text), rotated, and splits each
method's time, first rounds left out, into: the target's forward passes, the verification rule,
the rest of the verify step (cache rollback, commit, checks), the drafter's forward passes and
the rest of drafting (its sampling laws, the policy). Times are in target steps (the mean
forward pass of plain decoding in the same process).

    python benchmarks/studies/round-cost-parts/round_cost_parts.py [PROMPTS] [NEW_TOKENS]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from specdecode import SpeculativeDecoder
from specdecode.backends.torch_eager import CachedModel
from specdecode.core import engine, verification
from specdecode.prompts import load_prompts

KS = (4, 5, 6, 8)
ROTATIONS = 2
TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(owner, name: str, key, sync=lambda: None) -> None:
    """Replace owner.name by a wrapper adding its time under key(self).

    `sync` waits for the device: a GPU runs ahead of the host, so without it a part's time
    would be its launches and the next synchronizing part would pay for its kernels."""
    inner = getattr(owner, name)

    def wrapper(self, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = inner(self, *args, **kwargs)
        sync()
        TIMES[key(self)] += time.perf_counter() - t0
        CALLS[key(self)] += 1
        return out

    setattr(owner, name, wrapper)


def decode_parts(decoder: SpeculativeDecoder, prompt: str, k: int | None, tokens: int) -> dict:
    """One coupled decode; its times after the first round, by part."""
    TIMES.clear()
    CALLS.clear()
    first: dict[str, float] = {}

    def on_step(event, new_tokens) -> None:
        if not first:
            first.update(TIMES, target_calls=CALLS["target"], drafter_calls=CALLS["drafter"])

    out = decoder.generate(
        [prompt],
        on_step=on_step,
        use_drafter=k is not None,
        num_draft_tokens=k or 1,
        max_new_tokens=tokens,
        temperature=0.7,
        seed=0,
        stop_token_ids=[],
        coupled=True,
    )
    s = out.stats
    after = s.costs_after_first_round()
    return {
        "rounds": after.target_passes,
        "verify": after.verify_seconds,
        "draft": after.draft_seconds,
        "target": TIMES["target"] - first.get("target", 0.0),
        "rule": TIMES["rule"] - first.get("rule", 0.0),
        "drafter": TIMES["drafter"] - first.get("drafter", 0.0),
        "drafter_calls": CALLS["drafter"] - first.get("drafter_calls", 0),
    }


def instrument(decoder: SpeculativeDecoder, sync=lambda: None) -> None:
    """Time the decoder's parts: target and drafter forwards, the rule, the coupling pass."""
    target = decoder.target  # the model that the target's CachedModel wraps
    coupling = [False]  # inside the coupling pass: its drafter pass is not drafting
    inner = engine.coupled_next_tokens

    def coupled_next_tokens(*args, **kwargs):
        coupling[0] = True
        try:
            return inner(*args, **kwargs)
        finally:
            coupling[0] = False

    engine.coupled_next_tokens = coupled_next_tokens
    timed(
        CachedModel,
        "forward",
        lambda self: "target" if self.model is target else "coupling" if coupling[0] else "drafter",
        sync,
    )
    timed(
        verification.LosslessSamplingRule,
        "verify",
        lambda self: "coupling" if coupling[0] else "rule",
        sync,
    )


def measure(decoder: SpeculativeDecoder, prompts: list, tokens: int, ks=KS) -> dict:
    """Plain decoding (None) and each constant k, rotated; each method's parts summed."""
    methods: list[int | None] = [None, *ks]
    for k in methods:  # warm-up
        decode_parts(decoder, prompts[0], k, 8)
    totals: dict[int | None, dict[str, float]] = {m: defaultdict(float) for m in methods}
    for rotation in range(ROTATIONS):
        for method in methods[rotation:] + methods[:rotation]:
            for prompt in prompts:
                for key, value in decode_parts(decoder, prompt, method, tokens).items():
                    totals[method][key] += value
    return totals


def print_parts(totals: dict) -> list[dict]:
    """The per-round table, in steps of plain decoding; returns its rows."""
    ar = totals[None]
    step = ar["verify"] / ar["rounds"]
    print(f"a plain decoding step after the prefill: {1000 * step:.2f} ms; per round, in steps:")
    print(
        "| k | rounds | verify step | of it: target forward | rule | rest | drafting | of it: "
        "drafter forward | rest | drafter passes/round |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for k in (k for k in totals if k is not None):
        t = totals[k]
        per = {
            key: t[key] / t["rounds"] / step
            for key in ("verify", "target", "rule", "draft", "drafter")
        }
        per |= {"k": k, "rounds": t["rounds"], "drafter_calls": t["drafter_calls"] / t["rounds"]}
        rows.append(per)
        print(
            f"| {k} | {t['rounds']:.0f} | {per['verify']:.3f} | {per['target']:.3f} | "
            f"{per['rule']:.3f} | {per['verify'] - per['target'] - per['rule']:.3f} | "
            f"{per['draft']:.3f} | {per['drafter']:.3f} | {per['draft'] - per['drafter']:.3f} | "
            f"{per['drafter_calls']:.2f} |"
        )
    return rows


def main() -> None:
    n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    decoder = SpeculativeDecoder.from_pretrained(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", drafter_int8=True, backend="torch"
    )
    instrument(decoder)
    prompts = [p.text for p in load_prompts("humaneval", limit=n_prompts)]
    totals = measure(decoder, prompts, tokens)
    print(
        f"{n_prompts} HumanEval prompts, {tokens} tokens, T = 0.7, coupled, {ROTATIONS} rotations"
    )
    print_parts(totals)


if __name__ == "__main__":
    main()
