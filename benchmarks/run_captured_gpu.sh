#!/usr/bin/env bash
# The captured path on one GPU, in one short call: the CUDA tests, then the controlled-acceptance
# benches on the Qwen3-4B / Qwen3-0.6B shapes with random weights (docs/benchmarks.md "The
# static, captured path"), passes captured by hand as CUDA graphs at first use. Each step has its
# own time limit, so one that overruns leaves the others their records.
#
#   benchmarks/run_captured_gpu.sh OUT [STEP...]
#
# STEP (default: all; tests, b1 and curve took 5 minutes on an H100 on 2026-11-27):
#   tests   tests/test_cuda.py (torch.compile's tests only with SPECDECODE_TEST_COMPILE=1)
#   b1      batch 1, 8 prompts: captured plain (ar) against one hand-captured step (graph-ar) and
#           the uncaptured path (eager-ar); sd at k = 2 to 5 against the Leviathan bound
#   curve   the batch curve: 4, 16 and 64 rows over 64 prompts, sd at k = 2, 3, 4 against ar,
#           and what drafting auto plans at each row count
#   hf      transformers' static-cache generate (it compiles first: its warm-up is that time)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
shift
steps=" ${*:-tests b1 curve hf} "
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
began=$(date +%s)

bench() {  # NAME SECONDS ARGS...: one bench on the Qwen3 pair, its table and record under OUT/NAME
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%T), $(($(date +%s) - began)) s in)"
  timeout "$limit" python3 -m specdecode.cli.main bench --shapes qwen3-4b qwen3-0.6b \
    --device cuda --dtype bfloat16 --max-new-tokens 64 --acceptance 0.8 --out "/tmp/$name" \
    --no-plots "$@" 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -30
  mkdir -p "$out/$name" && cp "/tmp/$name/table.md" "/tmp/$name/record.json" "$out/$name/" 2>/dev/null
}

if [[ $steps == *" tests "* ]]; then
  echo "== tests/test_cuda.py ($(date -u +%T))"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15
fi
[[ $steps == *" b1 "* ]] && bench gpu-captured-b1 120 --limit 8 --batch-sizes 1 \
  --num-draft-tokens 2 3 4 5 --methods ar sd graph-ar eager-ar
[[ $steps == *" curve "* ]] && bench gpu-captured-curve 165 --limit 64 --batch-sizes 4 16 64 \
  --num-draft-tokens 2 3 4 --methods ar sd
# transformers compiles its static-cache generate first: in 120 s on an H100 (2026-11-27) the
# 16-token warm-up ended and the first 64-token call did not, so it gets the call's remainder
[[ $steps == *" hf "* ]] && bench gpu-hf-static 240 --limit 2 --batch-sizes 1 \
  --methods ar hf-static
echo "== done ($(date -u +%T), $(($(date +%s) - began)) s)"
