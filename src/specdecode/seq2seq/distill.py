"""`specdecode seq2seq distill`: the verifier translates the training sources.

Sequence-level knowledge distillation (Kim and Rush, 2016), as SpecDec trains its drafter: the
drafter learns to predict what the verifier will say, not what the human reference says, which is
what acceptance rewards. Greedy outputs, written in chunks to a jsonl that a rerun extends.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdecode.seq2seq.corpus import read_split
from specdecode.seq2seq.verifier_train import translate


def distill(
    verifier_dir: str | Path,
    out_file: str | Path,
    *,
    limit: int = 0,
    chunk: int = 1024,
    batch_size: int = 64,
    progress: bool = True,
) -> Path:
    from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

    model = AutoModelForSeq2SeqLM.from_pretrained(str(verifier_dir)).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(verifier_dir))
    sources = [v.src for v in read_split("train")]
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
