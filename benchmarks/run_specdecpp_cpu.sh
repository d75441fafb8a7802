#!/usr/bin/env bash
# SpecDec++ on the default pair (qwen2.5-coder-1.5b target, qwen2.5-coder-0.5b int8 drafter), CPU.
# 1. collect head data on HumanEval prompts 40..103 (the evaluation uses prompts 0..5, so the two
#    never meet), 96 new tokens, responses at temperature 0.7, mixing ratio 0.15;
# 2. train a greedy head and a sampling head (fp16, shipped in src/specdecode/heads/);
# 3. bench constant k, heuristic, confidence and head on HumanEval (in distribution) and MT-Bench
#    (out of distribution for a head trained on code), greedy and temperature 0.7, batch 1.
# Collection takes about 25 minutes on 2 cores (rerunning it on a collection made before the law
# features were recorded adds them in a minute), training 11 s per head, each bench 20-30.
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
# Constant k 3..6 (k = 5 led HumanEval, k = 3 MT-Bench), heuristic, confidence, and the head at
# three thresholds; HumanEval 6 prompts, MT-Bench (longer, slower rounds) 4, to fit the session.
run() {  # prompts limit temperature
  local prompts=$1 limit=$2 temperature=$3
  local mode=greedy; [ "$temperature" != 0 ] && mode=t07
  specdecode bench --prompts "$prompts" --limit "$limit" --max-new-tokens 64 \
    --temperature "$temperature" --seed 0 --methods ar sd-int8 --num-draft-tokens 3 4 5 6 \
    --length-policy constant heuristic confidence head --stop-threshold 0.5 0.7 0.9 --bound 1 8 \
    --out "benchmarks/specdecpp-$prompts-$mode" --quiet
}
run humaneval 6 0
run humaneval 6 0.7
run mtbench 4 0
run mtbench 4 0.7
# k = 3, the smallest constant above, led MT-Bench greedy: a second run with k = 2..4 and the
# thresholds around the head's best
specdecode bench --prompts mtbench --limit 4 --max-new-tokens 64 --temperature 0 --seed 0 \
  --methods ar sd-int8 --num-draft-tokens 2 3 4 --length-policy constant heuristic confidence head \
  --stop-threshold 0.6 0.7 0.8 --bound 1 8 --out benchmarks/specdecpp-mtbench-greedy-small-k --quiet
