#!/usr/bin/env bash
# SpecDec++ on the default pair (qwen2.5-coder-1.5b target, qwen2.5-coder-0.5b int8 drafter), CPU.
# 1. collect head data on HumanEval prompts 40..103, later 40..163 for a narrow head (the
#    evaluation uses prompts 0..31, so the two never meet), 96 new tokens, responses at temperature 0.7, mixing ratio 0.15;
# 2. train a greedy head and a sampling head (fp16, shipped in src/specdecode/heads/); the
#    sampling head learns the acceptance of the drawn token, min(1, p/q), and reads its log q;
# 3. bench constant k, heuristic, confidence and head on HumanEval (in distribution) and MT-Bench
#    (out of distribution for a head trained on code), greedy and temperature 0.7, batch 1.
# Collection takes 16-26 minutes on 2 cores (rerunning it on a collection made before the law
# features or drawn-token labels were recorded adds them), training 17 s per head, each bench
# 20-30.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/heads/data-humaneval-40-104
heads=src/specdecode/heads
specdecode head collect --prompts humaneval --skip 40 --limit 64 --max-new-tokens 96 \
  --temperature 0.7 --mixing-ratio 0.15 --batch-size 8 --out "$data"
for rule in greedy sampling; do
  specdecode head train "$data" --rule "$rule" --half --no-progress \
    --out "$heads/qwen2.5-coder-0.5b-for-1.5b-$rule" | tee "benchmarks/specdecpp-train-$rule.txt"
done
# Rounds of up to 12 tokens for the adaptive policies (a held-out preview of the head put
# MAX 12 ahead of MAX 8); the constants sweep the k that led each set in earlier runs and one
# past it: HumanEval k = 4..7, MT-Bench k = 2..5. Thresholds around the preview's best (0.7).
# HumanEval 6 prompts, MT-Bench (longer, slower rounds) 4, to fit the session.
run() {  # prompts limit temperature k...
  local prompts=$1 limit=$2 temperature=$3
  shift 3
  local mode=greedy; [ "$temperature" != 0 ] && mode=t07
  specdecode bench --prompts "$prompts" --limit "$limit" --max-new-tokens 64 \
    --temperature "$temperature" --seed 0 --methods ar sd-int8 --num-draft-tokens "$@" \
    --length-policy constant heuristic confidence head --stop-threshold 0.6 0.7 0.8 --bound 1 12 \
    --out "benchmarks/specdecpp-$prompts-$mode" --quiet
}
run humaneval 6 0.7 4 5 6 7
run mtbench 4 0.7 2 3 4 5
run humaneval 6 0 4 5 6 7
run mtbench 4 0 2 3 4 5
# A larger sample for the closest miss: HumanEval at T = 0.7 on 12 prompts, with the two leading
# constants (k = 5 measured, k = 6 modelled) and the head's two best thresholds only
specdecode bench --prompts humaneval --limit 12 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 5 6 --length-policy constant head \
  --stop-threshold 0.6 0.7 --bound 1 12 --out benchmarks/specdecpp-humaneval-t07-12 --quiet
# Larger samples under sampling (T = 0.7), where the 4-6 prompt runs were within noise of the
# target: HumanEval prompts 0-15 (disjoint from the head's 40-103) and MT-Bench's first 12
# questions, the three constants around each set's best, the heuristic, and three thresholds.
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 5 6 7 --length-policy constant heuristic head \
  --stop-threshold 0.6 0.7 0.8 --bound 1 12 --out benchmarks/specdecpp-humaneval-t07-16 --quiet
specdecode bench --prompts mtbench --limit 12 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 4 --length-policy constant heuristic head \
  --stop-threshold 0.7 0.8 0.9 --bound 1 12 --out benchmarks/specdecpp-mtbench-t07-12 --quiet
# HumanEval prompts 16-31 at T = 0.7, to pool with prompts 0-15 above: the two leading constants
# and the head at the default threshold only
specdecode bench --prompts humaneval --skip 16 --limit 16 --max-new-tokens 64 --temperature 0.7 \
  --seed 0 --methods ar sd-int8 --num-draft-tokens 5 6 --length-policy constant head \
  --stop-threshold 0.7 --bound 1 12 --out benchmarks/specdecpp-humaneval-t07-16-31 --quiet
# A narrow sampling head (the state projected to 128, 2 blocks) on the collection extended to
# prompts 40..163 (a copy, resumed: the first 64 prompts' shards are kept; 18 more minutes), not
# shipped: HumanEval prompts 0-31 in one run, and MT-Bench's 12 questions again, the constants
# around each set's best and the default threshold
wide=${data%-104}-164
[ -d "$wide" ] || cp -r "$data" "$wide"
specdecode head collect --prompts humaneval --skip 40 --limit 124 --max-new-tokens 96 \
  --temperature 0.7 --mixing-ratio 0.15 --batch-size 8 --out "$wide"
specdecode head train "$wide" --rule sampling --width 128 --layers 2 --half --no-progress \
  --out runs/head-sampling-w128 | tee benchmarks/specdecpp-train-sampling-w128.txt
specdecode bench --prompts humaneval --limit 32 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 5 6 --length-policy constant head \
  --stop-threshold 0.7 --bound 1 12 --head runs/head-sampling-w128 \
  --out benchmarks/specdecpp-humaneval-t07-32-w128 --quiet
specdecode bench --prompts mtbench --limit 12 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 4 --length-policy constant head \
  --stop-threshold 0.7 --bound 1 12 --head runs/head-sampling-w128 \
  --out benchmarks/specdecpp-mtbench-t07-12-w128 --quiet
# The floor of a round (--bound MIN): every run above let the head stop after 1 token; SpecDec++'s
# own evaluation drafts 2..20. HumanEval prompts 0-15 at T = 0.7, the shipped sampling head at the
# default threshold with floors 1, 2 and 3, beside k = 5 and 6; the table also reports the speed
# after the first round (the prefill's), which every method shares
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 5 6 --length-policy constant head \
  --stop-threshold 0.7 --bound 1 12 2 12 3 12 \
  --out benchmarks/specdecpp-humaneval-t07-16-bounds --quiet
# (that run, on a 2-core AMD EPYC, calibrated a verify pass of 1-2 drafted tokens at 1.9-2.8
# target steps: products of 2-3 rows took MKL's path. The prepacked copy now serves them.)
# The same prompts with the kernels switched at 2 rows: constants, heuristic, head at 0.6 and 0.7
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 5 6 --length-policy constant heuristic head \
  --stop-threshold 0.6 0.7 --bound 1 12 \
  --out benchmarks/specdecpp-humaneval-t07-16-rows2 --quiet
# With verify passes flat from 1 to 12 drafted tokens, longer rounds: k = 6 and 8, the head at
# the higher thresholds 0.8 and 0.9
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant head \
  --stop-threshold 0.8 0.9 --bound 1 12 \
  --out benchmarks/specdecpp-humaneval-t07-16-rows2-h89 --quiet
# MT-Bench's first 10 questions at T = 0.7 with the same kernels: k = 3 and 5, the head at 0.7, 0.8
specdecode bench --prompts mtbench --limit 10 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 3 5 --length-policy constant head \
  --stop-threshold 0.7 0.8 --bound 1 12 --out benchmarks/specdecpp-mtbench-t07-10-rows2 --quiet
# On-policy head data: HumanEval prompts 40-103 decoded with rounds of 12, every drafted token
# recorded with its state and verdict (18 minutes); a sampling head trained on it, priced at the
# EPYC's costs (c 0.106 and verify 0.78 + 0.048 m steps, scaled to a verify intercept of 1)
onpolicy="$HOME/.cache/specdecode/heads/data-rounds12-humaneval-40-104"
specdecode head collect --prompts humaneval --skip 40 --limit 64 --max-new-tokens 96 \
  --temperature 0.7 --rounds 12 --batch-size 8 --no-progress --out "$onpolicy"
specdecode head train "$onpolicy" --rule sampling --half --no-progress \
  --preview-costs 0.1375 0.056 --out runs/head-sampling-rounds \
  | tee benchmarks/specdecpp-train-sampling-rounds.txt
# The evaluation prompts 0-15 recorded the same way (not for training, 3.5 minutes), and both
# heads replayed on them: paired, every policy commits the recorded text
evalrounds="$HOME/.cache/specdecode/heads/eval-rounds12-humaneval-0-16"
specdecode head collect --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 \
  --rounds 12 --batch-size 8 --no-progress --out "$evalrounds"
specdecode head replay "$evalrounds" --head runs/head-sampling-rounds \
  --head "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" --costs 0.1375 0.056 \
  --json benchmarks/specdecpp-replay-humaneval-t07-16.json \
  | tee benchmarks/specdecpp-replay-humaneval-t07-16.txt
# The bench with the on-policy head
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant head \
  --stop-threshold 0.8 0.9 --bound 1 12 --head runs/head-sampling-rounds \
  --out benchmarks/specdecpp-humaneval-t07-16-onpolicy --quiet
# MT-Bench 81-90 at T = 0.7 and the greedy sets recorded the same way (the greedy ones in
# batches of 1, as the bench decodes), replayed at the EPYC's prices
specdecode head collect --prompts mtbench --chat --limit 10 --max-new-tokens 64 --temperature 0.7 \
  --rounds 12 --batch-size 8 --no-progress --out "$HOME/.cache/specdecode/heads/eval-rounds12-mtbench-10-t07"
specdecode head replay "$HOME/.cache/specdecode/heads/eval-rounds12-mtbench-10-t07" \
  --head runs/head-sampling-rounds --head "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" \
  --costs 0.1375 0.056 --json benchmarks/specdecpp-replay-mtbench-t07-10.json \
  | tee benchmarks/specdecpp-replay-mtbench-t07-10.txt
for set in "humaneval 6 0-6" "mtbench 4 4"; do
  read -r prompts limit tag <<< "$set"
  chat=""; [ "$prompts" = mtbench ] && chat="--chat"
  out="$HOME/.cache/specdecode/heads/eval-rounds12-$prompts-$tag-greedy"
  specdecode head collect --prompts "$prompts" $chat --limit "$limit" --max-new-tokens 64 \
    --temperature 0 --rounds 12 --batch-size 1 --no-progress --out "$out"
  specdecode head replay "$out" --head "$heads/qwen2.5-coder-0.5b-for-1.5b-greedy" \
    --costs 0.1375 0.056 --json "benchmarks/specdecpp-replay-$prompts-greedy-$limit.json" \
    | tee "benchmarks/specdecpp-replay-$prompts-greedy-$limit.txt"
done
# Greedy benches on the EPYC (the greedy head; every method writes the same text)
specdecode bench --prompts humaneval --limit 6 --max-new-tokens 64 --temperature 0 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant heuristic head \
  --stop-threshold 0.7 0.8 0.9 --bound 1 12 --out benchmarks/specdecpp-humaneval-greedy-epyc --quiet
specdecode bench --prompts mtbench --limit 4 --max-new-tokens 64 --temperature 0 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 3 5 --length-policy constant heuristic head \
  --stop-threshold 0.7 0.8 0.9 --bound 1 12 --out benchmarks/specdecpp-mtbench-greedy-epyc --quiet
# A head for chat as well: MT-Bench questions 91-160 recorded inside rounds, trained with the
# HumanEval collection into one head (not shipped), replayed on both evaluation sets
data="$HOME/.cache/specdecode/heads"
specdecode head collect --prompts mtbench --chat --skip 10 --limit 70 --max-new-tokens 96 \
  --temperature 0.7 --rounds 12 --batch-size 8 --no-progress --out "$data/data-rounds12-mtbench-10-80"
specdecode head train "$data/data-rounds12-humaneval-40-104" "$data/data-rounds12-mtbench-10-80" \
  --rule sampling --out runs/head-sampling-mixed --preview-costs 0.1375 0.056 --no-progress \
  | tee benchmarks/specdecpp-train-sampling-mixed.txt
for set in "mtbench-10-t07 mtbench-t07-10" "humaneval-0-16 humaneval-t07-16"; do
  read -r eval name <<< "$set"
  specdecode head replay "$data/eval-rounds12-$eval" --head "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" \
    --head runs/head-sampling-mixed --costs 0.1375 0.056 \
    --json "benchmarks/specdecpp-replay-$name-mixed.json" | tee "benchmarks/specdecpp-replay-$name-mixed.txt"
done
# Paired wall-clock benches under sampling: --coupled makes every policy commit the same text
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant heuristic head \
  --stop-threshold 0.8 0.9 --bound 1 12 --coupled \
  --out benchmarks/specdecpp-humaneval-t07-16-coupled --quiet
specdecode bench --prompts mtbench --limit 10 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 --length-policy constant heuristic head \
  --stop-threshold 0.8 0.9 --bound 1 12 --coupled \
  --out benchmarks/specdecpp-mtbench-t07-10-coupled --quiet
specdecode bench --prompts humaneval --skip 16 --limit 16 --max-new-tokens 64 --temperature 0.7 \
  --seed 0 --methods ar sd-int8 --num-draft-tokens 6 8 --length-policy constant head \
  --stop-threshold 0.9 --bound 1 12 --coupled \
  --out benchmarks/specdecpp-humaneval-t07-16-31-coupled --quiet
# eighth session: heads trained on the chat collection alone, replayed on MT-Bench 81-90
# (benchmarks/specdecpp-replay-mtbench-t07-10-chat-heads.txt), and the history feature offline
D=~/.cache/specdecode/heads
for cfg in "rw6:--reject-weight 6" "rw2:--reject-weight 2" "rw12:--reject-weight 12" \
  "n128:--width 128 --layers 2" "exp:--expected-label"; do
  specdecode head train $D/data-rounds12-mtbench-10-80 --rule sampling --no-progress \
    --preview-costs 0.1375 0.056 --out runs/heads/chat-${cfg%%:*} ${cfg#*:}
done
specdecode head replay $D/eval-rounds12-mtbench-10-t07 --costs 0.1375 0.056 \
  $(for n in rw6 rw2 rw12 n128 exp; do echo --head runs/heads/chat-$n; done) \
  --head runs/head-sampling-mixed
python benchmarks/specdecpp_history_feature.py > benchmarks/specdecpp-history-feature.txt
# MT-Bench questions 91-110 at T = 0.7, coupled (37 minutes)
specdecode bench --prompts mtbench --skip 10 --limit 20 --max-new-tokens 64 --temperature 0.7 \
  --seed 0 --methods ar sd-int8 --num-draft-tokens 2 3 --length-policy constant head \
  --stop-threshold 0.8 0.9 --bound 1 12 --coupled \
  --out benchmarks/specdecpp-mtbench-t07-10-30-coupled --quiet
for h in 0.8 0.9; do python benchmarks/pool_runs.py "sd-int8[k=2]" "sd-int8[head t=$h 1..12]" \
  benchmarks/specdecpp-mtbench-t07-10-coupled benchmarks/specdecpp-mtbench-t07-10-30-coupled
done > benchmarks/specdecpp-mtbench-t07-81-110-pooled.txt
# thirteenth session: head-u, the head reading each drafted token's acceptance number. A code
# collection inside rounds (HumanEval 40-71, 5 minutes) calibrates the shipped sampling head
# against the number; the evaluation collections are recorded again (MT-Bench 81-90, HumanEval
# 0-15) and the calibration replayed on them offline; then MT-Bench 81-110 coupled, with the
# head and head-u at h = 0.8 beside k = 2 and 3
specdecode head collect --prompts humaneval --skip 40 --limit 32 --max-new-tokens 64 \
  --temperature 0.7 --rounds 12 --batch-size 8 --no-progress --out $D/data-rounds12-humaneval-40-72
specdecode head calibrate "$heads/qwen2.5-coder-0.5b-for-1.5b-sampling" \
  $D/data-rounds12-humaneval-40-72 | tee benchmarks/specdecpp-calibrate-sampling.txt
python benchmarks/specdecpp_uniform_feature.py data-rounds12-humaneval-40-72 \
  eval-rounds12-mtbench-10-t07 eval-rounds12-humaneval-0-16 > benchmarks/specdecpp-uniform-feature.txt
specdecode bench --prompts mtbench --limit 30 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 --length-policy constant head head-u \
  --stop-threshold 0.8 --bound 1 12 --coupled \
  --out benchmarks/specdecpp-mtbench-t07-30-coupled-u --quiet
# the same with rounds of at least 3 (this machine verified 2 positions dearer than 4), k = 2-4
specdecode bench --prompts mtbench --limit 30 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 4 --length-policy constant head head-u \
  --stop-threshold 0.8 --bound 3 12 --coupled \
  --out benchmarks/specdecpp-mtbench-t07-30-coupled-u-floor3 --quiet
# fourteenth session: products of a few rows padded to the row count oneDNN runs fastest (timed
# per weight shape at load); the kernel plans compared in place, then MT-Bench 81-110 again with
# k = 2-5 and the head and head-u within 1..6 tokens (a verify pass of 1-6 positions now costs
# about one step, 7 and more cost 1.2-1.3)
python benchmarks/kernel_rows_causal.py 4 48 > benchmarks/kernel-rows-causal.txt
specdecode bench --prompts mtbench --limit 30 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 4 5 --length-policy constant head head-u \
  --stop-threshold 0.8 --bound 1 6 --coupled \
  --out benchmarks/specdecpp-mtbench-t07-30-coupled-padded --quiet
# fifteenth session: HumanEval 0-15 coupled on the padded kernels (26 minutes), the drafter-price
# sweep of the replayed gains (seconds), and where a round's time goes by its length
specdecode bench --prompts humaneval --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 4 5 6 8 --length-policy constant head head-u \
  --stop-threshold 0.8 0.9 --bound 1 12 --coupled \
  --out benchmarks/specdecpp-humaneval-t07-16-coupled-padded --quiet
python benchmarks/specdecpp_price_sweep.py data-rounds12-humaneval-40-72 \
  eval-rounds12-mtbench-10-t07 eval-rounds12-humaneval-0-16 > benchmarks/specdecpp-price-sweep.txt
python benchmarks/round_cost_parts.py 3 48 > benchmarks/round-cost-parts.txt
# seventeenth session: priced heads (--priced: each head method also run knowing the machine's
# round prices, from the run's calibration), HumanEval 0-15 (24 minutes) and MT-Bench 81-96
priced_bench() {  # PROMPTS "CONSTANT KS" OUT: constants, heuristic, head-u flat and priced
  specdecode bench --prompts "$1" --limit 16 --max-new-tokens 64 --temperature 0.7 --seed 0 \
    --methods ar sd-int8 --num-draft-tokens $2 --length-policy constant heuristic head-u \
    --stop-threshold 0.8 0.9 --bound 1 12 --coupled --priced --out "$3" --quiet
}
priced_bench humaneval "4 5 6 8" benchmarks/specdecpp-humaneval-t07-16-coupled-priced
priced_bench mtbench "2 3 4 5" benchmarks/specdecpp-mtbench-t07-16-coupled-priced
specdecode bench --prompts mtbench --skip 16 --limit 16 --max-new-tokens 64 --temperature 0.7 \
  --seed 0 --methods ar sd-int8 --num-draft-tokens 2 3 4 --length-policy constant head-u \
  --stop-threshold 0.9 --bound 1 12 --coupled --priced \
  --out benchmarks/specdecpp-mtbench-t07-16-31-coupled-priced --quiet
python benchmarks/pool_runs.py "sd-int8[k=3]" "sd-int8[head-u t=0.9 1..12 priced]" \
  benchmarks/specdecpp-mtbench-t07-16-coupled-priced benchmarks/specdecpp-mtbench-t07-16-31-coupled-priced
# eighteenth session: row plans per row count (each short product padded to the cheapest count at
# or above it, read off medians), the same benches on them, and the replay at their prices
python benchmarks/kernel_row_counts.py 6 48 > benchmarks/kernel-row-counts.txt
priced_bench mtbench "2 3 4 5" benchmarks/specdecpp-mtbench-t07-16-coupled-rowcounts
priced_bench humaneval "4 5 6 8" benchmarks/specdecpp-humaneval-t07-16-coupled-rowcounts
for set in eval-rounds12-humaneval-0-16 eval-rounds12-mtbench-10-t07; do
  specdecode head replay "$HOME/.cache/specdecode/heads/$set" --head src/specdecode/heads/qwen2.5-coder-0.5b-for-1.5b-sampling \
    --bound 1 12 --costs 0.15 0.02 \
    --verify-curve 1.00 0.97 0.96 0.93 0.92 1.13 1.21 1.22 1.26 1.26 1.37 1.50
done > benchmarks/specdecpp-replay-rowcounts.txt
# nineteenth session: shared Gumbel noise, a colder drafter and the target's view one position
# back, scored on texts the target sampled (the laws are collected once into the cache, 12 min)
python benchmarks/specdecpp_predictability.py > benchmarks/specdecpp-predictability.txt
