#!/usr/bin/env bash
# SpecDec++ on the default pair (qwen2.5-coder-1.5b target, qwen2.5-coder-0.5b int8 drafter), CPU.
# 1. collect head data on HumanEval prompts 40..103 (the evaluation uses prompts 0..5, so the two
#    never meet), 96 new tokens, responses at temperature 0.7, mixing ratio 0.15;
# 2. train a greedy head and a sampling head (fp16, shipped in src/specdecode/heads/);
# 3. bench constant k, heuristic, confidence and head on HumanEval (in distribution) and MT-Bench
#    (out of distribution for a head trained on code), greedy and temperature 0.7, batch 1.
# Collection takes about 20-25 minutes on 2 cores, training 15-20 s per head, each bench 15-25.
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
# HumanEval: 6 prompts, thresholds 0.3 0.5 0.7; MT-Bench (longer, slower rounds): 4 prompts and
# the two thresholds that led on HumanEval, to fit the session.
run() {  # prompts limit temperature thresholds...
  local prompts=$1 limit=$2 temperature=$3; shift 3
  local mode=greedy; [ "$temperature" != 0 ] && mode=t07
  specdecode bench --prompts "$prompts" --limit "$limit" --max-new-tokens 64 \
    --temperature "$temperature" --seed 0 --methods ar sd-int8 --num-draft-tokens 3 4 5 \
    --length-policy constant heuristic confidence head --stop-threshold "$@" --bound 1 8 \
    --out "benchmarks/specdecpp-$prompts-$mode" --quiet
}
run humaneval 6 0 0.3 0.5 0.7
run humaneval 6 0.7 0.3 0.5 0.7
run mtbench 4 0 0.5 0.7
run mtbench 4 0.7 0.5 0.7
# the sampling head stops early at 0.3-0.7: a rerun with higher thresholds
specdecode bench --prompts humaneval --limit 6 --max-new-tokens 64 --temperature 0.7 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 4 5 --length-policy constant head \
  --stop-threshold 0.8 0.9 --bound 1 8 --out benchmarks/specdecpp-humaneval-t07-high-thresholds --quiet
