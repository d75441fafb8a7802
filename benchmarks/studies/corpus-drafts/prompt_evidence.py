"""How well the standard library corpus knows a prompt, against how well it knows the answer:
per prompt of answers.json (the default target's greedy answers to HumanEval 0-31 and MT-Bench
81-96), the share of positions where the corpus's choice is the next token
(`CorpusIndex.evidence`), over all bands and in the clearest band (share >= 0.8), in the
prompt and in the answer. The prompt's figure is what a row's corpus estimate starts from.

    python benchmarks/studies/corpus-drafts/prompt_evidence.py
"""

import json
from pathlib import Path

from specdecode import SpeculativeDecoder

HERE = Path(__file__).parent
decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", backend="llama.cpp", threads=2)
decoder.use_corpus("stdlib")
corpus = decoder.corpus
answers = json.loads((HERE / "answers.json").read_text())


def rates(evidence: list[tuple[int, int]]) -> tuple[float, float, int]:
    """Right share over all bands, right share in band 0, and band 0's positions."""
    count, right = sum(c for c, _ in evidence), sum(r for _, r in evidence)
    clear, clear_right = evidence[0]
    return right / max(count, 1), clear_right / max(clear, 1), clear


for name, items in answers.items():
    print(f"## {name}\n")
    print("| prompt tokens | prompt: right | band 0 right (positions) | answer: right | band 0 |")
    print("|---|---|---|---|---|")
    prompt_all, answer_all = [], []
    for item in items:
        prompt, answer = item["prompt"], item["answer"]
        p_all, p_clear, p_n = rates(corpus.evidence(prompt))
        whole, before = corpus.evidence(prompt + answer), corpus.evidence(prompt)
        # the answer's positions: the whole text's counts less the prompt's
        after = [(c - pc, r - pr) for (c, r), (pc, pr) in zip(whole, before, strict=True)]
        a_all, a_clear, a_n = rates(after)
        prompt_all.append(p_all)
        answer_all.append(a_all)
        print(
            f"| {len(prompt)} | {p_all:.2f} | {p_clear:.2f} ({p_n}) | {a_all:.2f} | "
            f"{a_clear:.2f} ({a_n}) |"
        )
    low, high = min(prompt_all), max(prompt_all)
    mean = sum(prompt_all) / len(prompt_all)
    print(
        f"\nprompts: right {mean:.2f} on average [{low:.2f}, {high:.2f}]; answers "
        f"{sum(answer_all) / len(answer_all):.2f}\n"
    )
