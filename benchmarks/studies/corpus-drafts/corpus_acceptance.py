"""How often a corpus's draft is right where the row's own text gives none, on the default
target's greedy answers (HumanEval 0-31, MT-Bench 81-96, 128 tokens, ended at the first
end-of-generation id). For every answer token: the match length prompt lookup finds (0-4) and
how often its next token is the answer's; where that match is shorter than 3, the corpus's
first token, by the share band of its choice; and how many tokens of the corpus's chained draft
are right in a row.

    python benchmarks/studies/corpus-drafts/corpus_acceptance.py

The answers are kept beside this file (answers.json) and generated only where it is missing.
"""

import collections
import json
from pathlib import Path

import torch

from specdecode import SpeculativeDecoder
from specdecode.core.config import LOOKUP_ALONE
from specdecode.core.drafting.corpus import ORDERS, SHARE_BANDS
from specdecode.core.drafting.lookup import lookup_continuation
from specdecode.core.engine import RowRequest
from specdecode.prompts import load_prompts

HERE = Path(__file__).parent
decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", backend="llama.cpp", threads=2)
answers_file = HERE / "answers.json"
if not answers_file.is_file():
    ends = set(decoder.target_backend.stop_token_ids())
    answers = {}
    for name, limit in (("humaneval", 32), ("mtbench", 16)):
        prompts = [decoder.encode(p.text)[0] for p in load_prompts(name, limit=limit)]
        loop = decoder.loop(max_rows=8, prefill_chunk=256, use_drafter=False)
        keys = [loop.add(RowRequest(list(map(int, p)), 128)) for p in prompts]
        out = collections.defaultdict(list)
        while len(loop):
            for update in loop.step():
                out[update.key].extend(update.tokens)
        answers[name] = []
        for p, k in zip(prompts, keys, strict=True):
            tokens = out[k]
            end = next((i for i, t in enumerate(tokens) if t in ends), len(tokens))
            answers[name].append({"prompt": list(map(int, p)), "answer": tokens[:end]})
    answers_file.write_text(json.dumps(answers))
answers = json.loads(answers_file.read_text())
decoder.use_corpus("stdlib")
corpus = decoder.corpus
bands = [f">= {b}" for b in SHARE_BANDS] + [f"< {SHARE_BANDS[-1]}"]
for name, items in answers.items():
    own, own_right = collections.Counter(), collections.Counter()
    band, band_right = collections.Counter(), collections.Counter()
    chained = collections.Counter()
    for item in items:
        text = item["prompt"] + item["answer"]
        for i in range(len(item["prompt"]), len(text)):
            found, n = lookup_continuation(torch.tensor(text[:i]), 1, LOOKUP_ALONE, True)
            own[n] += 1
            own_right[n] += bool(n) and int(found[0]) == text[i]
            if n >= 3:
                continue
            drafted, b = corpus.continuation(text[max(0, i - ORDERS) : i], 4)
            if not drafted:
                continue
            key = ("no match" if n == 0 else "match of 1-2", bands[b])
            band[key] += 1
            band_right[key] += drafted[0] == text[i]
            wrong = [j for j, t in enumerate(drafted) if i + j >= len(text) or t != text[i + j]]
            right = wrong[0] if wrong else len(drafted)
            chained[key] += right
    total = sum(own.values())
    print(f"## {name}: {total} answer tokens\n")
    print("| own text's match | share of tokens | next token right |\n|---|---|---|")
    for n in sorted(own):
        right = f"{own_right[n] / own[n]:.2f}" if n else "-"
        print(f"| {n or 'none'} | {own[n] / total:.2f} | {right} |")
    print(
        "\n| own match | corpus choice's share | tokens | first right | right in a row of 4 |"
        "\n|---|---|---|---|---|"
    )
    for key in sorted(band):
        count = band[key]
        print(
            f"| {key[0]} | {key[1]} | {count} ({count / total:.2f}) | "
            f"{band_right[key] / count:.2f} | {chained[key] / count:.2f} |"
        )
    print()
