#!/usr/bin/env bash
# SpecDec on the Bible es->en pair, built from scratch on a 2-core CPU, then benchmarked: the
# commands behind src/specdecode/pairs/bible-es-en (the shipped pair) and
# benchmarks/results/specdec-*, benchmarks/studies/specdec-*, in the order they ran.
# 1. corpus: Reina-Valera 1909 -> World English Bible (+ KJV as a second reference) from Debian
#    packages; validation books Ruth, Jonah, Nahum, Galatians, Titus, Philemon; test John, Hebrews;
# 2. verifier: Marian-style d_model 256, 3+3 layers, shared 8k BPE; 110 minutes, then the mean of
#    its last 3 snapshots (every trainer resumes from its last checkpoint when rerun);
# 3. distillation of the 29,423 training sources by the verifier (greedy, about 10 minutes);
# 4. block drafter (2 layers on the verifier's encoder states), position-weighted objective; the
#    shipped drafter was then trained on for 7.5 minutes on one GPU (benchmarks/run_specdec_gpu.sh);
# 5. export in fp16; benches on the test split at batch 1 (first 100 verses) and 32 (all 1,179).
set -euo pipefail
cd "$(dirname "$0")/.."
W="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/seq2seq/bible-es-en"
S=src/specdecode/pairs/bible-es-en
res=benchmarks/results
studies=benchmarks/studies

# --- 2026-11-22: corpus, verifier (70 minutes), first distillation, first drafter, assistant ---
specdecode data fetch bible-es-en
specdecode seq2seq train-verifier --minutes 60 --threads 2 --quiet
specdecode seq2seq train-verifier --minutes 10 --eval-minutes 5 --threads 2 --quiet
specdecode seq2seq distill --threads 2 --quiet
# the first drafter: equal weights over k in [5, 25] (beside it, a glancing run stopped at 7
# minutes: results/specdec-drafter-ab/glat-ab.txt); the hf-assisted baseline's assistant (the
# verifier's encoder + 1 decoder layer) on one thread beside it
specdecode seq2seq train-drafter --minutes 28 --layers 2 --block-size 25 --min-block 5 \
  --threads 1 --quiet --eval-minutes 7 &
specdecode seq2seq train-assistant --minutes 20 --threads 1 --quiet --eval-minutes 100
wait
specdecode seq2seq train-drafter --minutes 16 --layers 2 --block-size 25 --min-block 5 \
  --threads 2 --quiet --eval-minutes 8

# --- 2026-11-23: 40 more verifier minutes, averaged; a second distillation; the drafter objective
# verifier: five resumed calls of 8 minutes, each keeping a snapshot, then the mean of the last 3
# (validation BLEU 22.17 against 21.64 for the best single checkpoint; the mean of 5 scored 21.92
# and was not kept): results/specdec-training/train-verifier.json
specdecode seq2seq train-verifier --minutes 40 --eval-minutes 8 --checkpoint-minutes 8 \
  --keep-snapshots 5 --threads 2 --quiet
specdecode seq2seq average --last 3 --threads 2
specdecode seq2seq average --last 5 --threads 2
# the new verifier changes 96% of the distilled translations, so distil again (about 10 minutes)
specdecode seq2seq distill --out "$W/distilled-v2.jsonl" --threads 2 --quiet
# drafter objective A/B (results/specdec-drafter-ab/objective-ab.txt), 15 minutes each on one
# thread side by side, both from the first drafter: equal weights over k in [5, 25], 4 blocks per
# sentence (the old objective) against k in [2, 5], 16 blocks per sentence, position j weighted 0.5^j
mv "$W/drafter" "$W/drafter-v1"
COMMON=(--train-file "$W/distilled-v2.jsonl" --init-drafter "$W/drafter-v1/best" --quiet)
specdecode seq2seq train-drafter "${COMMON[@]}" --out "$W/drafter-ab-equal" --block-size 25 \
  --min-block 5 --blocks-per-sentence 4 --minutes 15 --eval-minutes 100 --threads 1 &
NEW=(--block-size 5 --min-block 2 --blocks-per-sentence 16 --position-decay 0.5)
specdecode seq2seq train-drafter "${COMMON[@]}" --out "$W/drafter" "${NEW[@]}" --minutes 15 \
  --eval-minutes 100 --threads 1
wait
# the winner goes on (12 minutes on one thread beside the assistant's fine-tuning on the new
# distillation, then 32 on two): results/specdec-training/train-drafter.json, train-assistant.json
specdecode seq2seq train-drafter "${COMMON[@]}" --out "$W/drafter" "${NEW[@]}" --minutes 12 \
  --eval-minutes 100 --threads 1 &
specdecode seq2seq train-assistant --train-file "$W/distilled-v2.jsonl" --minutes 11 \
  --eval-minutes 100 --threads 1 --quiet
wait
specdecode seq2seq train-drafter "${COMMON[@]}" --out "$W/drafter" "${NEW[@]}" --minutes 32 \
  --eval-minutes 11 --threads 2
specdecode seq2seq export --out "$S"
# the verifier's test BLEU, greedy and beam 5, all 1,179 test verses (results/specdec-bible-bleu;
# its SpecDec rows are this drafter's, since replaced)
specdecode bench --pair --limit 0 --max-new-tokens 100 --batch-sizes 32 \
  --methods ar hf hf-beam5 specdec --block-sizes 2 3 --relaxed 2,1.0 5,3.0 \
  --threads 2 --out "$res/specdec-bible-bleu" --quiet
# the drafter on one GPU (benchmarks/run_specdec_gpu.sh, three calls of 7.5-8 minutes, three
# variants each: results/specdec-training/drafter-gpu-{1,2,3}.json). Variant `a` ships:
#   benchmarks/run_specdec_gpu.sh OUT 7.5 \
#     "a:--init-drafter,src/specdecode/pairs/bible-es-en/drafter,--block-size,5,--min-block,2,--blocks-per-sentence,16,--position-decay,0.5,--max-tokens,16384,--eval-minutes,1.5,--valid-sentences,300"
#   cp OUT/a/drafter.safetensors src/specdecode/pairs/bible-es-en/drafter/
# First token from the prefix, A/B from the shipped drafter, 24 minutes each on one thread
# (results/specdec-drafter-ab/first-token-ab.txt; not shipped)
FIRST=(--verifier "$S/verifier" --train-file "$W/distilled-v2.jsonl"
  --init-drafter "$S/drafter" --block-size 5 --min-block 2
  --blocks-per-sentence 16 --position-decay 0.5 --first-from-prefix --minutes 24 --eval-minutes 8
  --threads 1 --quiet)
specdecode seq2seq train-drafter "${FIRST[@]}" --out "$W/drafter-first-lm" --lm-weight 0.5 &
specdecode seq2seq train-drafter "${FIRST[@]}" --out "$W/drafter-first"
wait
# packed kernels for the verifier and the drafter (the default), with +dense variants for the
# A/B in the same run: batch 1 (about 16 minutes), batch 32 (about 12)
specdecode bench --pair --limit 100 --max-new-tokens 100 --batch-sizes 1 \
  --methods ar ar+dense hf hf-beam5 hf-assisted specdec specdec+dense --block-sizes 2 3 4 \
  --relaxed 2,1.0 5,3.0 --threads 2 --repeats 2 --out "$res/specdec-bible-b1-packed-vs-dense" --quiet
specdecode bench --pair --limit 0 --max-new-tokens 100 --batch-sizes 32 \
  --methods ar ar+dense hf specdec specdec+dense --block-sizes 2 3 --relaxed 2,1.0 5,3.0 \
  --threads 2 --out "$res/specdec-bible-b32" --quiet
# (the inference_mode A/B, results/specdec-inference-mode-ab, ran this bench from git worktrees of
# feeb919 and 28a2adc with PYTHONPATH=<worktree>/src:
#   specdecode bench --pair --limit 50 --max-new-tokens 100 --batch-sizes 1 --methods ar specdec \
#     --block-sizes 2 3 --threads 2 --repeats 2 --out <dir> --quiet)

# --- 2026-11-24: what the drafter does not take; plain decoding's kernel; the round's cost ------
# drafter A/Bs from the shipped drafter on the first 12,288 training verses, two arms side by side
# on one thread each, 21 minutes (results/specdec-drafter-ab/states-ab.txt, augment-ab.txt)
specdecode seq2seq distill --verifier "$S/verifier" --limit 12288 --out "$W/distilled-shipped.jsonl"
specdecode seq2seq distill --verifier "$S/verifier" --limit 12288 --augment \
  --out "$W/distilled-augmented.jsonl"
AB=(--verifier "$S/verifier" --init-drafter "$S/drafter" --block-size 5 --min-block 2
    --blocks-per-sentence 16 --position-decay 0.5 --lr 3e-4 --warmup 50 --minutes 21
    --eval-minutes 7 --threads 1 --quiet)
D=(--train-file "$W/distilled-shipped.jsonl")
specdecode seq2seq train-drafter "${AB[@]}" "${D[@]}" --out "$W/ab-plain" &
specdecode seq2seq train-drafter "${AB[@]}" "${D[@]}" --target-features --out "$W/ab-states"
wait
specdecode seq2seq train-drafter "${AB[@]}" "${D[@]}" --layers 1 --out "$W/ab1-plain" &
specdecode seq2seq train-drafter "${AB[@]}" "${D[@]}" --layers 1 --target-features \
  --out "$W/ab1-states"
wait
specdecode seq2seq train-drafter "${AB[@]}" "${D[@]}" \
  --extra-train-file "$W/distilled-augmented.jsonl" --out "$W/ab-mixed" &
specdecode seq2seq train-drafter "${AB[@]}" --train-file "$W/distilled-augmented.jsonl" \
  --out "$W/ab-aug"
wait
# plain decoding packed from one row against two, and what a round costs at Transformer-base size
python $studies/specdec-kernel-rows/specdec_kernel_rows.py 100 \
  > $studies/specdec-kernel-rows/specdec-kernel-rows.txt
python $studies/specdec-round-cost/specdec_round_cost.py > $studies/specdec-round-cost/specdec-round-cost.txt
# the pair packed from one row (the current default), batch 1 (about 11 minutes): the current
# batch-1 table
specdecode bench --pair --limit 100 --max-new-tokens 100 --batch-sizes 1 \
  --methods ar hf hf-assisted specdec-int8 --block-sizes 3 4 5 --relaxed 2,1.0 5,3.0 \
  --threads 2 --repeats 2 --out "$res/specdec-bible-b1" --quiet
# an upper bound for tree drafting; drafting only while few rows of a batch run (by batch size,
# then the batch-32 part again and batches by source length), and the bench's gated methods
python $studies/specdec-tree-bound/specdec_tree_bound.py > $studies/specdec-tree-bound/specdec-tree-bound.txt
python $studies/specdec-draft-batch/specdec_draft_batch.py > $studies/specdec-draft-batch/specdec-draft-batch.txt
python $studies/specdec-draft-batch/specdec_draft_batch.py --parts batch32 --repeats 3 \
  >> $studies/specdec-draft-batch/specdec-draft-batch.txt
python $studies/specdec-draft-batch/specdec_draft_batch.py --parts sorted --repeats 3 \
  >> $studies/specdec-draft-batch/specdec-draft-batch.txt
specdecode bench --pair --limit 640 --max-new-tokens 128 --batch-sizes 32 \
  --methods ar specdec-int8 --block-sizes 2 4 --relaxed --repeats 2 --max-draft-batch 4 \
  --out "$res/specdec-bible-b32-gated" --quiet
