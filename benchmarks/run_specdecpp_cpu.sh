#!/usr/bin/env bash
# SpecDec++ (adaptive draft length) on the default pair, CPU: the commands behind
# benchmarks/results/specdecpp-* and benchmarks/studies/specdecpp-*, in the order they ran.
# 1. head data on HumanEval prompts 40..103 (the evaluation uses prompts 0..31 and MT-Bench, so
#    the two never meet), 96 new tokens, responses at temperature 0.7, mixing ratio 0.15;
# 2. a greedy head and a sampling head, shipped in src/specdecode/heads/;
# 3. on-policy data recorded inside real rounds, the evaluation sets recorded the same way, and
#    heads replayed on them (paired: every policy commits the recorded text);
# 4. benches: greedy, then T = 0.7 coupled (every policy commits the same text), priced heads.
# Collection takes 16-26 minutes on 2 cores, training 17 s per head, each bench 15-40 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/heads
heads=src/specdecode/heads
res=benchmarks/results
studies=benchmarks/studies

# --- the shipped heads (2026-11-22) -------------------------------------------------------------
specdecode head collect --backend torch --prompts humaneval --skip 40 --limit 64 --max-new-tokens 96 \
  --temperature 0.7 --mixing-ratio 0.15 --batch-size 8 --out "$D/data-humaneval-40-104"
for rule in greedy sampling; do
  specdecode head train "$D/data-humaneval-40-104" --rule "$rule" --half --no-progress \
    --out "$heads/qwen2.5-coder-0.5b-for-1.5b-$rule" | tee "$res/specdecpp-heads/train-$rule.txt"
done

# --- the first unpaired sampling bench kept: HumanEval 0-15 at T = 0.7 (2-core Intel Xeon) ------
specdecode bench --backend torch --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 5 6 7 --length-policy constant heuristic head \
  --stop-threshold 0.6 0.7 0.8 --bound 1 12 --out "$res/specdecpp-humaneval-t07-unpaired" --quiet

# --- a narrow sampling head on the collection extended to prompts 40..163 (not shipped) --------
wide="$D/data-humaneval-40-164"
[ -d "$wide" ] || cp -r "$D/data-humaneval-40-104" "$wide"
specdecode head collect --backend torch --prompts humaneval --skip 40 --limit 124 --max-new-tokens 96 \
  --temperature 0.7 --mixing-ratio 0.15 --batch-size 8 --out "$wide"
specdecode head train "$wide" --rule sampling --width 128 --layers 2 --half --no-progress \
  --out runs/head-sampling-w128 | tee "$res/specdecpp-heads/train-sampling-w128.txt"

# --- inside real rounds (2026-11-23): on-policy head data, the evaluation sets, replays --------
# prices of the 2-core AMD EPYC then: a drafted token 0.1375 steps, each verified position 0.056
specdecode head collect --backend torch --prompts humaneval --skip 40 --limit 64 --max-new-tokens 96 \
  --temperature 0.7 --rounds 12 --batch-size 8 --no-progress --out "$D/data-rounds12-humaneval-40-104"
specdecode head train "$D/data-rounds12-humaneval-40-104" --rule sampling --half --no-progress \
  --preview-costs 0.1375 0.056 --out runs/head-sampling-rounds \
  | tee "$res/specdecpp-heads/train-sampling-rounds.txt"
specdecode head collect --backend torch --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 \
  --rounds 12 --batch-size 8 --no-progress --out "$D/eval-rounds12-humaneval-0-16"
specdecode head collect --backend torch --prompts mtbench --chat --limit 10 --max-new-tokens 64 --temperature 0.7 \
  --rounds 12 --batch-size 8 --no-progress --out "$D/eval-rounds12-mtbench-10-t07"
for set in "humaneval-0-16 humaneval-t07-16" "mtbench-10-t07 mtbench-t07-10"; do
  read -r eval name <<< "$set"
  specdecode head replay "$D/eval-rounds12-$eval" --head runs/head-sampling-rounds \
    --head "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" --costs 0.1375 0.056 \
    --json "$res/specdecpp-replays/replay-$name.json" | tee "$res/specdecpp-replays/replay-$name.txt"
done
for set in "humaneval 6 0-6" "mtbench 4 4"; do
  read -r prompts limit tag <<< "$set"
  chat=""; [ "$prompts" = mtbench ] && chat="--chat"
  out="$D/eval-rounds12-$prompts-$tag-greedy"
  specdecode head collect --backend torch --prompts "$prompts" $chat --limit "$limit" --max-new-tokens 64 \
    --temperature 0 --rounds 12 --batch-size 1 --no-progress --out "$out"
  specdecode head replay "$out" --head "$heads/qwen2.5-coder-0.5b-for-1.5b-greedy" \
    --costs 0.1375 0.056 --json "$res/specdecpp-replays/replay-$prompts-greedy-$limit.json" \
    | tee "$res/specdecpp-replays/replay-$prompts-greedy-$limit.txt"
done

# --- greedy benches on the EPYC (the greedy head; every method writes the same text) -----------
specdecode bench --backend torch --prompts humaneval --limit 6 --max-new-tokens 64 --temperature 0 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant heuristic head \
  --stop-threshold 0.7 0.8 0.9 --bound 1 12 --out "$res/specdecpp-humaneval-greedy" --quiet
specdecode bench --backend torch --prompts mtbench --limit 4 --max-new-tokens 64 --temperature 0 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 3 5 --length-policy constant heuristic head \
  --stop-threshold 0.7 0.8 0.9 --bound 1 12 --out "$res/specdecpp-mtbench-greedy" --quiet

# --- a head for chat as well: MT-Bench 91-160 inside rounds, trained with the code data --------
specdecode head collect --backend torch --prompts mtbench --chat --skip 10 --limit 70 --max-new-tokens 96 \
  --temperature 0.7 --rounds 12 --batch-size 8 --no-progress --out "$D/data-rounds12-mtbench-10-80"
specdecode head train "$D/data-rounds12-humaneval-40-104" "$D/data-rounds12-mtbench-10-80" \
  --rule sampling --out runs/head-sampling-mixed --preview-costs 0.1375 0.056 --no-progress \
  | tee "$res/specdecpp-heads/train-sampling-mixed.txt"
for set in "mtbench-10-t07 mtbench-t07-10" "humaneval-0-16 humaneval-t07-16"; do
  read -r eval name <<< "$set"
  specdecode head replay "$D/eval-rounds12-$eval" --head "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" \
    --head runs/head-sampling-mixed --costs 0.1375 0.056 \
    --json "$res/specdecpp-replays/replay-$name-mixed.json" \
    | tee "$res/specdecpp-replays/replay-$name-mixed.txt"
done
# heads trained on the chat data alone (replay-mtbench-t07-10-chat-heads.txt) and a history
# feature, offline
for cfg in "rw6:--reject-weight 6" "rw2:--reject-weight 2" "rw12:--reject-weight 12" \
  "n128:--width 128 --layers 2" "exp:--expected-label"; do
  specdecode head train "$D/data-rounds12-mtbench-10-80" --rule sampling --no-progress \
    --preview-costs 0.1375 0.056 --out "runs/heads/chat-${cfg%%:*}" ${cfg#*:}
done
specdecode head replay "$D/eval-rounds12-mtbench-10-t07" --costs 0.1375 0.056 \
  $(for n in rw6 rw2 rw12 n128 exp; do echo --head runs/heads/chat-$n; done) \
  --head runs/head-sampling-mixed
python $studies/specdecpp-history-feature/specdecpp_history_feature.py \
  > $studies/specdecpp-history-feature/specdecpp-history-feature.txt

# --- paired in wall-clock time: HumanEval 0-15, T = 0.7, coupled (before short products were
# padded, 2026-11-23) --------------------------------------------------------------------------
specdecode bench --backend torch --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant heuristic head \
  --stop-threshold 0.8 0.9 --bound 1 12 --coupled \
  --out "$res/specdecpp-humaneval-t07-unpadded" --quiet

# --- the acceptance number (head-u, 2026-11-24): a calibration of the shipped sampling head on a
# code collection inside rounds, replayed offline on the evaluation sets -------------------------
specdecode head collect --backend torch --prompts humaneval --skip 40 --limit 32 --max-new-tokens 64 \
  --temperature 0.7 --rounds 12 --batch-size 8 --no-progress --out "$D/data-rounds12-humaneval-40-72"
specdecode head calibrate "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" \
  "$D/data-rounds12-humaneval-40-72" | tee "$res/specdecpp-heads/calibrate-sampling.txt"
python $studies/specdecpp-uniform-feature/specdecpp_uniform_feature.py data-rounds12-humaneval-40-72 \
  eval-rounds12-mtbench-10-t07 eval-rounds12-humaneval-0-16 \
  > $studies/specdecpp-uniform-feature/specdecpp-uniform-feature.txt

# --- padded short products: the kernel plans compared in place, the drafter-price sweep and
# where a round's time goes (2026-11-24) ---------------------------------------------------------
python $studies/kernel-rows-causal/kernel_rows_causal.py 4 48 \
  > $studies/kernel-rows-causal/kernel-rows-causal.txt
python $studies/specdecpp-price-sweep/specdecpp_price_sweep.py data-rounds12-humaneval-40-72 \
  eval-rounds12-mtbench-10-t07 eval-rounds12-humaneval-0-16 \
  > $studies/specdecpp-price-sweep/specdecpp-price-sweep.txt
python $studies/round-cost-parts/round_cost_parts.py 3 48 > $studies/round-cost-parts/round-cost-parts.txt

# --- priced heads (--priced: each head method also runs knowing the machine's round prices,
# from the run's calibration), with one padding count per weight (2026-11-24) ---------------------
priced_bench() {  # PROMPTS "CONSTANT KS" OUT: constants, heuristic, head-u flat and priced
  specdecode bench --backend torch --prompts "$1" --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
    --methods ar sd-int8 --num-draft-tokens $2 --length-policy constant heuristic head-u \
    --stop-threshold 0.8 0.9 --bound 1 12 --coupled --priced --out "$3" --quiet
}
priced_bench humaneval "4 5 6 8" "$res/specdecpp-humaneval-t07-priced-mlp-unpadded"
specdecode bench --backend torch --prompts mtbench --skip 16 --limit 16 --max-new-tokens 64 --temperature 0.7 \
  --seed 0 --methods ar sd-int8 --num-draft-tokens 2 3 4 --length-policy constant head-u \
  --stop-threshold 0.9 --bound 1 12 --coupled --priced \
  --out "$res/specdecpp-mtbench-t07-97-112" --quiet

# --- per-count row plans (each short product padded to the cheapest count at or above it, read
# off medians; the current kernels): the plans timed, the current benches, the replay at their
# prices, and the pooled MT-Bench figure -----------------------------------------------------------
python $studies/kernel-row-counts/kernel_row_counts.py 6 48 \
  > $studies/kernel-row-counts/kernel-row-counts.txt
priced_bench mtbench "2 3 4 5" "$res/specdecpp-mtbench-t07"
priced_bench humaneval "4 5 6 8" "$res/specdecpp-humaneval-t07"
for set in eval-rounds12-humaneval-0-16 eval-rounds12-mtbench-10-t07; do
  specdecode head replay "$D/$set" --head "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" \
    --bound 1 12 --costs 0.15 0.02 \
    --verify-curve 1.00 0.97 0.96 0.93 0.92 1.13 1.21 1.22 1.26 1.26 1.37 1.50
done > "$res/specdecpp-replays/replay-rowcounts.txt"
for base in 2 3 4; do for method in "head-u t=0.9 1..12" "head-u t=0.9 1..12 priced"; do
  python $studies/pooled-runs/pool_runs.py "sd-int8[k=$base]" "sd-int8[$method]" \
    "$res/specdecpp-mtbench-t07" "$res/specdecpp-mtbench-t07-97-112"
done; done > $studies/pooled-runs/specdecpp-mtbench-t07-81-112.txt

# --- three ways a head might learn more, scored before building (the laws are collected once
# into the cache, 12 minutes) -----------------------------------------------------------------------
python $studies/specdecpp-predictability/specdecpp_predictability.py \
  > $studies/specdecpp-predictability/specdecpp-predictability.txt

# --- the head on llama.cpp's drafter states (2026-11-25, 2-core Intel Xeon shared with other
# runs: --threads 1, since two llama.cpp threads on two busy cores ran a target step 17 times
# slower than one, 2.4 s against 0.14 s; the evaluation collection and the first batch of the
# training collection ran with the default two, before that was seen) -------------------------
specdecode head collect --backend llama.cpp --threads 1 --prompts humaneval --limit 6 \
  --max-new-tokens 128 --temperature 0 --rounds 12 --batch-size 1 --no-progress \
  --out "$D/llamacpp-eval-humaneval-0-6-rounds12-greedy"
specdecode head collect --backend llama.cpp --threads 1 --prompts humaneval --skip 40 --limit 64 \
  --max-new-tokens 96 --temperature 0.7 --mixing-ratio 0.15 --batch-size 8 --no-progress \
  --out "$D/llamacpp-data-humaneval-40-104"
specdecode head train "$D/llamacpp-data-humaneval-40-104" --rule greedy --half --no-progress \
  --preview-costs 0.64 0.16 \
  --preview-verify-curve 1.44 1.77 1.92 2.07 2.36 2.66 2.95 3.11 3.28 3.44 3.60 3.76 \
  --out "$D/qwen2.5-coder-0.5b-for-1.5b-greedy-llamacpp"
python $studies/llamacpp-head-replay/run.py "$D/llamacpp-eval-humaneval-0-6-rounds12-greedy" \
  "$D/qwen2.5-coder-0.5b-for-1.5b-greedy-llamacpp" "$heads/qwen2.5-coder-0.5b-for-1.5b-greedy"
