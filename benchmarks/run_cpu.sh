#!/usr/bin/env bash
# The recorded CPU benchmark of the default pair (qwen2.5-coder-1.5b + qwen2.5-coder-0.5b).
# 1. a draft-length sweep on the first 3 HumanEval prompts (chooses k for each method);
# 2. the main run: HumanEval first 20 prompts, 128 new tokens, greedy, batch 1;
# 3. sampling at temperature 0.7 with batches of 4 and 8 (and 1 for the engine).
# About 100 minutes on a 2-core machine. Results land in benchmarks/<run><suffix>/, the suffix
# naming the machine (the records without one are the 2-core Xeon's; `-epyc` the AMD EPYC's):
#   benchmarks/run_cpu.sh -epyc
set -uo pipefail
cd "$(dirname "$0")/.."
out=benchmarks
suffix=${1:-}
specdecode bench --prompts humaneval --limit 3 --max-new-tokens 128 \
  --methods ar hf-assisted hf-assisted-k sd-int8 --num-draft-tokens 3 4 5 6 \
  --out $out/humaneval-k-sweep$suffix --quiet
best() {  # best k of a method family in the sweep record
  python - "$1" "$out/humaneval-k-sweep$suffix/record.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[2]))["methods"]
fam = [r for r in rows if r["method"].startswith(sys.argv[1] + "[k=")]
best = max(fam, key=lambda r: r["speedup"]["geomean"])
hfa = next(r for r in rows if r["method"] == "hf-assisted")
print(best["method"].split("[k=")[1].rstrip("]"), int(best["speedup"]["geomean"] > hfa["speedup"]["geomean"]))
PY
}
read -r k_sd _ < <(best sd-int8)
read -r k_hf hf_better < <(best hf-assisted-k)
# sd (the fp32 drafter hf-assisted also gets) runs at the same k as sd-int8, so the engine and
# the drafter's speed are seen apart; hf-assisted-k joins when a constant k beat its defaults.
methods="ar hf-assisted sd sd-int8"
ks="$k_sd"
if [ "$hf_better" = 1 ]; then
  methods="$methods hf-assisted-k"; [ "$k_hf" != "$k_sd" ] && ks="$k_sd $k_hf"
fi
echo "sweep: best sd-int8 k=$k_sd, best hf-assisted-k k=$k_hf (beats defaults: $hf_better)"
specdecode bench --prompts humaneval --limit 20 --max-new-tokens 128 \
  --methods $methods --num-draft-tokens $ks --out $out/humaneval-greedy-b1$suffix --quiet
specdecode bench --prompts humaneval --limit 8 --max-new-tokens 128 --temperature 0.7 --seed 0 \
  --methods ar hf sd-int8 --num-draft-tokens 2 3 --batch-sizes 8 4 \
  --out $out/humaneval-sample-batch$suffix --quiet
