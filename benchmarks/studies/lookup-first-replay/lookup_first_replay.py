"""Would prompt lookup before the drafter pay? A replay on the default pair's greedy outputs.

The target's greedy completions of HumanEval prompts 0-7 (128 tokens) are decoded once; the int8
drafter reads each text once, teacher-forced, which gives at every position whether its greedy
draft there equals the text (a greedy model round keeps drafts while they do). Then decoding is
replayed round by round at this CPU's prices (a drafted token 0.15 target steps; a verify pass
of m drafted tokens as calibrated on 2026-11-24 with per-count row plans), for the drafter
alone at k = 4 and 5, and for lookup first (`LookupFirstDrafter`: matches of min_ngram..4
tokens, up to k looked-up tokens) with the drafter elsewhere. Output: tokens per target step,
and the share of positions with a match and what lookup keeps there.

    python benchmarks/studies/lookup-first-replay/lookup_first_replay.py
    (about 4 minutes; the texts are cached after that)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from specdecode.api import SpeculativeDecoder
from specdecode.backends.kernels import quantize_int8
from specdecode.core.config import PromptLookup
from specdecode.core.drafting.lookup import lookup_continuation
from specdecode.core.prices import Prices
from specdecode.models.store import load_causal_lm
from specdecode.prompts import load_prompts

CACHE = Path.home() / ".cache" / "specdecode" / "lookup-replay.json"
PROMPTS, NEW_TOKENS = 8, 128
# this CPU's prices, as the predictability study reads them (the calibration of 2026-11-24,
# per-count row plans)
DRAFT_PRICE = 0.15
VERIFY = (1.00, 0.97, 0.96, 0.93, 0.92, 1.13, 1.21, 1.22, 1.26, 1.26, 1.37, 1.50)
COSTS = Prices.stated(draft=DRAFT_PRICE, verify_slope=0.0, verify_curve=VERIFY).rounds(1)


def texts_and_drafter_hits() -> list[dict]:
    """Per prompt: its ids, the greedy completion, and hits[t] = drafter's argmax == text[t]."""
    if CACHE.is_file():
        return json.loads(CACHE.read_text())
    decoder = SpeculativeDecoder.from_pretrained(
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", drafter_int8=True, backend="torch"
    )
    drafter = quantize_int8(load_causal_lm("qwen2.5-coder-0.5b")[0])
    rows = []
    for prompt in load_prompts("humaneval", limit=PROMPTS):
        ids = decoder.encode([prompt.text])[0]
        new = decoder.generate([ids], max_new_tokens=NEW_TOKENS, num_draft_tokens=4)
        full = ids + new.new_tokens[0]
        with torch.no_grad():
            guess = drafter(torch.tensor([full])).logits[0].argmax(-1).tolist()
        hits = [False] + [guess[t - 1] == full[t] for t in range(1, len(full))]
        rows.append({"prompt": ids, "new": new.new_tokens[0], "hits": hits})
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps(rows))
    return rows


def kept_of(draft, text: list[int], t: int) -> int:
    """How many of the drafted tokens at position t a greedy verify keeps: those equal to the
    text, up to the first that is not."""
    kept = 0
    while kept < len(draft) and t + kept < len(text) and int(draft[kept]) == text[t + kept]:
        kept += 1
    return kept


def replay(rows: list[dict], k: int, lookup: PromptLookup | None, lookup_k: int) -> float:
    """Committed tokens per target step, decoding every text round by round."""
    tokens = steps = 0.0
    for row in rows:
        full = row["prompt"] + row["new"]
        t, end = len(row["prompt"]), len(full)
        while t < end:
            room = end - t - 1  # the last token of a text is the round's own
            draft = []
            if lookup is not None and room > 0:
                draft = lookup_continuation(torch.tensor(full[:t]), min(lookup_k, room), lookup)
            if len(draft):  # a looked-up round: its verify pass, no drafter pass
                kept = kept_of(draft, full, t)
                steps += COSTS.round_cost(len(draft)) - DRAFT_PRICE * len(draft)
            else:
                m, kept = min(k, room), 0
                while kept < m and row["hits"][t + kept]:
                    kept += 1
                steps += COSTS.round_cost(m)
            tokens += kept + 1
            t += kept + 1
    return tokens / steps


def matches(rows: list[dict], lookup: PromptLookup, k: int) -> tuple[float, float]:
    """Share of positions with a match, and the drafts lookup keeps there (of k)."""
    kept_at, positions = [], 0
    for row in rows:
        full = row["prompt"] + row["new"]
        for t in range(len(row["prompt"]), len(full) - 1):
            positions += 1
            draft = lookup_continuation(torch.tensor(full[:t]), k, lookup)
            if len(draft):
                kept_at.append(kept_of(draft, full, t))
    return len(kept_at) / positions, statistics.mean(kept_at)


def main() -> None:
    torch.set_num_threads(2)
    rows = texts_and_drafter_hits()
    base = {k: replay(rows, k, None, 0) for k in (4, 5)}
    best = max(base.values())
    print(
        f"HumanEval 0-{PROMPTS - 1}, {NEW_TOKENS} tokens, greedy; a drafted token "
        f"{DRAFT_PRICE} steps, verify {' / '.join(map(str, VERIFY))}"
    )
    print("| drafting | tokens per target step | vs the drafter alone, best k |")
    print("|---|---|---|")
    for k, speed in base.items():
        print(f"| drafter alone, k = {k} | {speed:.3f} | {speed / best - 1:+.1%} |")
    for low in (2, 3, 4):
        lookup = PromptLookup(max_ngram=4, min_ngram=low)
        share, kept = matches(rows, lookup, 4)
        for lookup_k in (4, 8):
            speed = replay(rows, 4, lookup, lookup_k)
            print(
                f"| lookup first ({low}-4-grams, a match at {share:.0%} of positions keeping "
                f"{kept:.2f} of 4), up to {lookup_k} looked up, drafter k = 4 | {speed:.3f} | "
                f"{speed / best - 1:+.1%} |"
            )


if __name__ == "__main__":
    main()
