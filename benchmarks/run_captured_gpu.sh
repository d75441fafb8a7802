#!/usr/bin/env bash
# The captured path on one GPU, in one short call: the CUDA tests, then the controlled-acceptance
# benches (random weights in published shapes, docs/benchmarks.md "The static, captured path").
# Each step has its own time limit so that one slow compile leaves the others their records; the
# progress bar's last states are kept in the log, so a step cut off still says where it stood.
# Compiling dominates a short call: on an H100 (2026-11-26) the 7B pair had not finished in 170 s
# with 4 prompts and three draft lengths, nor the Qwen3 pair in 240 s with 16 prompts.
#
#   benchmarks/run_captured_gpu.sh OUT [STEP...]    STEP: tests, 7b, qwen3 (default: all three;
#   together they can outlast one 10-minute call, so a call may take one or two)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
shift
steps=" ${*:-tests 7b qwen3} "
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"

bench() {  # NAME SECONDS ARGS...: one bench, its table and record kept under OUT/NAME
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%T))"
  timeout "$limit" python3 -m specdecode.cli.main bench --device cuda --dtype bfloat16 \
    --max-new-tokens 64 --acceptance 0.8 --out "/tmp/$name" "$@" 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -25
  mkdir -p "$out/$name" && cp "/tmp/$name/table.md" "/tmp/$name/record.json" "$out/$name/" 2>/dev/null
}

if [[ $steps == *" tests "* ]]; then
  echo "== tests/test_cuda.py ($(date -u +%T))"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15
fi
[[ $steps == *" 7b "* ]] && bench gpu-captured-7b 240 --shapes qwen2.5-7b qwen2.5-coder-0.5b --limit 2 --batch-sizes 1 \
  --num-draft-tokens 3 4 5 --methods ar sd eager-ar hf-static graph-ar
[[ $steps == *" qwen3 "* ]] && bench gpu-captured-qwen3 300 --shapes qwen3-4b qwen3-0.6b --limit 16 --batch-sizes 1 16 \
  --num-draft-tokens 3 --methods ar sd eager-ar hf-static
echo "== done ($(date -u +%T))"
