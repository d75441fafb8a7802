"""`specdecode seq2seq distill`: the verifier translates the training sources.

Sequence-level knowledge distillation (Kim and Rush, 2016), as SpecDec trains its drafter: the
drafter learns to predict what the verifier will say, not what the human reference says, which is
what acceptance rewards. Greedy outputs, written in chunks to a jsonl that a rerun extends.

`augment`: new sources made from the training verses (`augmented_sources`) instead of the verses
themselves. Why: the verifier has learnt the training verses nearly by heart, so its outputs on
them are its memorised references, while at inference it translates verses it never saw. The
shipped drafter accepts 2.79 tokens per call on training verses against 2.20 on held-out books
(k = 5): it learnt the verifier's behaviour on what the verifier knows. Verses joined, cut at a
clause or missing a word are inputs the verifier has not learnt, in the corpus' own language and
domain, so its outputs there show how it translates the unseen.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdecode.seq2seq.corpus import read_split
from specdecode.seq2seq.verifier_train import translate

_CLAUSE = re.compile(r"(?<=[,;:])\s+")


def augmented_sources(sources: list[str], seed: int = 0) -> list[str]:
    """One new source per verse, in turn: the verse joined with the next one, one of its clauses
    (split after , ; :), or the verse with one word in ten dropped. Deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for i, src in enumerate(sources):
        words = src.split()
        clauses = [c for c in _CLAUSE.split(src) if len(c.split()) >= 4]
        if i % 3 == 0 and i + 1 < len(sources):
            out.append(f"{src} {sources[i + 1]}")
        elif i % 3 == 1 and len(clauses) >= 2:
            out.append(rng.choice(clauses))
        elif len(words) >= 4:
            kept = [w for w in words if rng.random() >= 0.1]
            out.append(" ".join(kept if len(kept) >= 2 else words))
        else:
            out.append(src)
    return out


def distill(
    verifier_dir: str | Path,
    out_file: str | Path,
    *,
    limit: int = 0,
    chunk: int = 1024,
    batch_size: int = 64,
    augment: bool = False,
    progress: bool = True,
) -> Path:
    from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

    model = AutoModelForSeq2SeqLM.from_pretrained(str(verifier_dir)).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(verifier_dir))
    sources = [v.src for v in read_split("train")]
    if augment:
        sources = augmented_sources(sources)
    if limit:
        sources = sources[:limit]
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for _ in out_file.open(encoding="utf-8")) if out_file.exists() else 0
    bar = tqdm(total=len(sources), initial=done, desc="distill", unit="verse", disable=not progress)
    with torch.inference_mode(), out_file.open("a", encoding="utf-8") as f:
        for start in range(done, len(sources), chunk):
            part = sources[start : start + chunk]
            for src, tgt in zip(part, translate(model, tokenizer, part, batch_size), strict=True):
                f.write(json.dumps({"src": src, "tgt": tgt}, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(part))
    bar.close()
    return out_file
