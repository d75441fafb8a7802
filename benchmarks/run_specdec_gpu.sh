#!/usr/bin/env bash
# SpecDec drafter runs on one GPU: several train-drafter variants side by side on the same card
# (the drafter is small, so one run leaves most of an H100 idle), each with a wall-clock budget,
# then each variant's best drafter exported in fp16 with a summary of every run.
#
#   benchmarks/run_specdec_gpu.sh OUT MINUTES VARIANT...
#
# VARIANT is NAME:ARGS, ARGS being train-drafter flags separated by commas, e.g.
#   a:--init-drafter,src/specdecode/pairs/bible-es-en/drafter,--block-size,5,--min-block,2
# Every run reads the shipped verifier and the distilled training file
# ($SPECDECODE_CACHE/seq2seq/bible-es-en/distilled-v2.jsonl), and validates on the corpus's
# validation split, so the cache must hold those two (`data fetch`, `seq2seq distill`).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 minutes=$2
shift 2
mkdir -p "$out"
cache="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}"
pair=src/specdecode/pairs/bible-es-en
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
names=()
for variant in "$@"; do
  name=${variant%%:*}
  IFS=, read -r -a extra <<<"${variant#*:}"
  names+=("$name")
  python3 -m specdecode.cli seq2seq train-drafter --verifier "$pair/verifier" \
    --train-file "$cache/seq2seq/bible-es-en/distilled-v2.jsonl" --out "/tmp/drafter-$name" \
    --minutes "$minutes" --threads 2 --quiet "${extra[@]}" >"$out/$name.log" 2>&1 &
done
wait || true
python3 - "$out" "${names[@]}" <<'EOF'
import json, sys
from pathlib import Path
from specdecode.seq2seq.block_drafter import BlockDrafter
import torch
out, names = Path(sys.argv[1]), sys.argv[2:]
report = {}
for name in names:
    run = Path(f"/tmp/drafter-{name}")
    entry = {"log_tail": (out / f"{name}.log").read_text()[-1500:]}
    if (run / "summary.json").exists():
        entry["summary"] = json.loads((run / "summary.json").read_text())
        entry["train_config"] = json.loads((run / "train_config.json").read_text())
        model = BlockDrafter.load(run / "best")
        model.save(out / name, dtype=torch.float16)
    report[name] = entry
    (out / f"{name}.log").unlink()
(out / "summary.json").write_text(json.dumps(report, indent=1))
for name, entry in report.items():
    s = entry.get("summary", {})
    print(name, s.get("steps"), s.get("best_valid_tokens_per_verifier_call"),
          [h["valid_tokens_per_verifier_call"] for h in s.get("history", [])])
EOF
