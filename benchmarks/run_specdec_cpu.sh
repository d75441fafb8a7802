#!/usr/bin/env bash
# SpecDec on the Bible es->en pair, built from scratch on a 2-core CPU, then benchmarked.
# 1. corpus: Reina-Valera 1909 -> World English Bible (+ KJV as a second reference) from Debian
#    packages; validation books Ruth, Jonah, Nahum, Galatians, Titus, Philemon; test John, Hebrews;
# 2. verifier: Marian-style d_model 256, 3+3 layers, shared 8k BPE (resumable: rerun to go on);
# 3. distillation of the training sources by the verifier (greedy);
# 4. block drafter (2 layers on the verifier's encoder states) and the hf-assisted baseline's
#    assistant (the verifier's encoder + 1 decoder layer), both on the distilled data;
# 5. export in fp16 to src/specdecode/pairs/bible-es-en (the shipped pair);
# 6. bench on the test split: batch 1 (first 200 verses, k and beta/tau sweeps) and batch 32
#    (all 1,179 verses).
set -euo pipefail
cd "$(dirname "$0")/.."
specdecode data fetch bible-es-en
specdecode seq2seq train-verifier --minutes 80 --threads 2 --quiet | tee benchmarks/specdec-train-verifier.json
specdecode seq2seq distill --threads 2 --quiet
specdecode seq2seq train-drafter --minutes 30 --layers 2 --block-size 25 --min-block 5 \
  --threads 2 --quiet | tee benchmarks/specdec-train-drafter.json
specdecode seq2seq train-assistant --minutes 10 --threads 2 --quiet \
  | tee benchmarks/specdec-train-assistant.json
specdecode seq2seq export --out src/specdecode/pairs/bible-es-en
specdecode bench --pair --limit 200 --batch-sizes 1 --block-sizes 5 10 15 25 \
  --relaxed 2,1.0 3,2.0 5,3.0 --threads 2 --out benchmarks/specdec-bible-b1 --quiet
specdecode bench --pair --limit 0 --batch-sizes 32 --methods ar hf hf-beam5 specdec \
  --block-sizes 10 --relaxed 5,3.0 --threads 2 --out benchmarks/specdec-bible-b32 --quiet
