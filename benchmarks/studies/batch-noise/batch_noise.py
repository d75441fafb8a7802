"""How far llama.cpp's logits move with the shape of the pass: each prompt's next-token logits
scored alone (one row, a unified cache) and in a batch of rows (a cache stream per row), on a
served model. A greedy text equals its text alone only while every top-2 gap it meets is wider
than this noise; a server's answers are compared with that in mind.

    python benchmarks/studies/batch-noise/batch_noise.py [--model qwen2.5-coder-1.5b] [--rows 4]
"""

from __future__ import annotations

import argparse
from datetime import date

import torch

from specdecode import SpeculativeDecoder
from specdecode.backends.hugepages import cpu_model
from specdecode.prompts import load_prompts


def last_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), vocab]: logits after each row's last token, the rows left-padded in one pass."""
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [rows, width]
    valid = torch.zeros(len(rows), width, dtype=torch.bool)  # [rows, width]
    for b, ids in enumerate(rows):
        tokens[b, width - len(ids) :] = torch.tensor(ids)
        valid[b, width - len(ids) :] = True
    model.reset(len(rows))
    logits, _ = model.forward(tokens, valid)
    return logits[:, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompts", default="mtbench")
    args = parser.parse_args()
    decoder = SpeculativeDecoder.from_pretrained(args.model, backend="llama.cpp", context=2048)
    chosen = load_prompts(args.prompts, limit=args.rows)
    prompts = decoder.encode([p.text for p in chosen], chat=True)
    model = decoder.target
    alone = [last_logits(model, [p])[0] for p in prompts]
    batch = last_logits(model, prompts)
    print(
        f"{args.model} on llama.cpp, {args.prompts} {chosen[0].id}-{chosen[-1].id} in its chat "
        f"template, {cpu_model()}, {date.today()}"
    )
    print("| prompt | max abs logit difference, alone vs batch | top-2 gap alone | argmax same |")
    print("|---|---|---|---|")
    for b, ref in enumerate(alone):
        gap = ref.topk(2).values
        same = int(ref.argmax()) == int(batch[b].argmax())
        diff = float((batch[b] - ref).abs().max())
        top2 = float(gap[0] - gap[1])
        print(f"| {chosen[b].id} | {diff:.3f} | {top2:.3f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
