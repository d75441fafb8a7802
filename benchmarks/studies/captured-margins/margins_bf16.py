"""The captured bench in bfloat16 on the CPU, with the target's logit margins and without: the
Qwen3-0.6B shape as target (random weights), a one-layer drafter of its vocabulary, acceptance
set to 0.8, k = 3, 2 prompts of 16 tokens, 48 new tokens. Prints, per variant, the acceptance
measured and the texts where `sd` differs from `ar`.

    python benchmarks/studies/captured-margins/margins_bf16.py
"""

import json
import tempfile
from pathlib import Path

from specdecode.bench import captured
from specdecode.bench.captured import CapturedBenchConfig, run_captured_bench

folder = Path(tempfile.mkdtemp())
draft = folder / "draft.json"
draft.write_text(
    json.dumps(dict(model_type="qwen3", vocab_size=151936, hidden_size=256,
                    intermediate_size=768, head_dim=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=1024, tie_word_embeddings=True))
)  # fmt: skip
cfg = CapturedBenchConfig(
    target="qwen3-0.6b", draft=str(draft), dtype="bfloat16", acceptance=(0.8,),
    num_draft_tokens=(3,), batch_sizes=(1,), prompts=2, prompt_tokens=16, max_new_tokens=48,
    methods=("ar", "sd"),
)  # fmt: skip
margined = captured.with_margins
for variant in ("without margins", "with margins"):
    captured.with_margins = margined if variant == "with margins" else (lambda model, seed: model)
    record = run_captured_bench(cfg, progress=False)
    row = next(r for r in record["methods"] if "acceptance_set" in r)
    print(
        f"{variant}: acceptance set {row['acceptance_set']}, measured "
        f"{row['acceptance_measured']:.3f}; texts where sd differs from ar: "
        f"{len(row['mismatches'])} of {cfg.prompt_count}; verdict ok={record['ok']}"
    )
