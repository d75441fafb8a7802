#!/usr/bin/env bash
# Serving on the default pair (qwen2.5-coder-1.5b target, qwen2.5-coder-0.5b drafter, Q4_K_M
# GGUF): our server against llama-server (plain, and with the same drafter) and
# llama-cpp-python's server, all on this machine at once, driven by `specdecode bench-serve`
# over the same prompts, servers interleaved at each concurrency level. Into
# benchmarks/results/serving-default-pair/:
#   new/               HumanEval 0-15, every prompt behind a fresh tag, concurrency 1 4 8 16
#   seen/              the same prompts sent once to warm, then measured, concurrency 1 8
#   chat/              MT-Bench 81-88 as 2-turn conversations, concurrency 1 8
#   llama-cpp-python/  ours and llama-cpp-python's server (one request at a time), 1 8
#   repeats-c1/        HumanEval 0-7 one at a time, four servers, three passes each
#   repeats-*/         the cells at 8 and 16 again, three passes each
#   equal-*/           at 8 and 16 (new), 8 (seen) and 1, three passes each, and 4 (new), two,
#                      every request run to 64 tokens (--ignore-eos): the same work on every
#                      server
#   servers.json       each server's command and its peak RSS over the run (resumed parts too)
# Every server gets 8 rows of 2048 tokens and 2 threads; ours drafts from the standard library
# corpus too (its default since 2026-11-26 15:30; from 12:30 that day --corpus stdlib, before
# then without). A step whose record exists is skipped, so a run cut short goes on where it
# stopped. About two hours on a 2-core machine; run it on
# a quiet machine (llama.cpp's threads spin, and a busy core slows them far more than its share).
#
# Needs: the serve extra; llama-server built from the llama.cpp that llama-cpp-python vendors
# (benchmarks/studies/llamacpp-peer/llamacpp_peer.sh builds it where LLAMA_SERVER points by
# default); llama-cpp-python's server extra (pip install 'llama-cpp-python[server]').
set -uo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${LLAMA_SERVER:-/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
[ -x "$LLAMA_SERVER" ] || { echo "no llama-server at $LLAMA_SERVER: build it with benchmarks/studies/llamacpp-peer/llamacpp_peer.sh, or set LLAMA_SERVER" >&2; exit 1; }
# SERVING_PLAN=auto-check: only drafting auto against drafting off and llama-server (code and
# chat at 1, 4 and 8 requests, equal work, three passes, the servers taking turns wave by wave),
# into
# benchmarks/studies/auto-any-machine/serving/: what `auto` gives on the machine that runs it.
# SERVING_LEVELS="1" (with auto-check): those concurrency levels only, into serving-c1/
# SERVING_PLAN=plain-check: only our --no-draft server against llama-server, code and chat at
# one request, equal work, wave by wave, into benchmarks/studies/plain-path/two-servers-c1/:
# plain decoding served, with nothing else between the two (with two servers the waves' turns
# are symmetric, each following itself and the other alike). Both servers are started
# PLAIN_STARTS times (3), three passes each start, into start-N/, the first to start taking
# turns: where a process's weights land moves its step by a per cent or more, start to start,
# so one start of each is one draw of that; pooled.md pools the starts (pooled.py)
plan=${SERVING_PLAN:-full}
case $plan in
  full | auto-check | plain-check) ;;
  *) echo "SERVING_PLAN=$plan: expected full, auto-check or plain-check" >&2; exit 2 ;;
esac
levels=${SERVING_LEVELS:-1 4 8}
out=benchmarks/results/serving-default-pair
servers="ours ours-plain llama-server llama-server-draft llama-cpp-python"
if [ "$plan" = auto-check ]; then
  out=benchmarks/studies/auto-any-machine/serving
  [ -n "${SERVING_LEVELS:-}" ] && out=$out-c${levels// /-}
  servers="ours ours-plain llama-server"
elif [ "$plan" = plain-check ]; then
  out=benchmarks/studies/plain-path/two-servers-c1
  servers="ours-plain llama-server" levels=1
fi
logs=runs/serving-logs
mkdir -p "$out" "$logs"
for name in $servers; do : >"$logs/$name.log"; done  # each start of a plain-check appends
tokens=64
read -r target draft < <(python -c "
from specdecode.models.store import gguf_file
print(gguf_file('qwen2.5-coder-1.5b', progress=False), gguf_file('qwen2.5-coder-0.5b', progress=False))")

declare -A port=([ours]=8180 [ours-plain]=8181 [llama-server]=8182 [llama-server-draft]=8183
  [llama-cpp-python]=8184)
declare -A cmd=(
  [ours]="specdecode serve --port 8180 --max-batch 8 --context 2048 --threads 2"
  [ours-plain]="specdecode serve --port 8181 --max-batch 8 --context 2048 --threads 2 --no-draft"
  [llama-server]="$LLAMA_SERVER -m $target -t 2 -tb 2 -np 8 -c 16384 --port 8182"
  [llama-server-draft]="$LLAMA_SERVER -m $target -md $draft --spec-type draft-simple \
--spec-draft-n-max 4 -t 2 -tb 2 -td 2 -tbd 2 -np 8 -c 16384 --port 8183"
  [llama-cpp-python]="python -m llama_cpp.server --model $target --n_ctx 2048 --n_threads 2 \
--n_threads_batch 2 --interrupt_requests False --port 8184"
)
declare -A pid
stop_all() {
  for name in "${!pid[@]}"; do kill "${pid[$name]}" 2>/dev/null; done
  wait
  pid=()
}
trap stop_all EXIT
start_all() {  # start_all NAME...: in that order, one at a time, each ready before the next
  # starts: our servers time this machine's pass prices on a first start, which other servers
  # loading beside them would skew
  local name probe
  for name in "$@"; do
    ${cmd[$name]} >>"$logs/$name.log" 2>&1 &
    pid[$name]=$!
    probe=/health  # 503 while loading
    [ "$name" = llama-cpp-python ] && probe=/v1/models  # it listens once loaded
    for _ in $(seq 1 1800); do
      curl -sf "http://127.0.0.1:${port[$name]}$probe" >/dev/null && continue 2
      kill -0 "${pid[$name]}" 2>/dev/null || break
      sleep 1
    done
    echo "$name did not start; see $logs/$name.log" >&2
    exit 1
  done
  echo "servers ready: $(date -u +%H:%M:%S)"
}

labels() { for name in "$@"; do printf -- "--label %s=http://127.0.0.1:%s " "$name" "${port[$name]}"; done; }
step() {  # step NAME BENCH-ARGS...: one bench-serve record unless it is there already
  local name=$1; shift
  [ -f "$out/$name/record.json" ] && { echo "$name: recorded already"; return; }
  specdecode bench-serve "$@" --max-tokens $tokens --out "$out/$name" --quiet \
    || echo "$name: failed (see above)" >&2
}
three="ours ours-plain llama-server"
check() {  # a check's cells: code and chat, equal work, wave by wave
  # shellcheck disable=SC2046,SC2086
  step code $(labels $servers) --prompts humaneval --limit 8 --modes new --concurrency $levels \
    --repeats 3 --ignore-eos --waves
  # shellcheck disable=SC2046,SC2086
  step chat $(labels $servers) --prompts mtbench --limit 8 --modes chat --turns 2 \
    --concurrency $levels --repeats 3 --ignore-eos --waves
}
if [ "$plan" = plain-check ]; then
  root=$out
  for start in $(seq 1 "${PLAIN_STARTS:-3}"); do
    out=$root/start-$start
    [ -f "$out/code/record.json" ] && [ -f "$out/chat/record.json" ] && continue
    order=$servers
    [ $((start % 2)) = 0 ] && order=$(echo "$servers" | tr ' ' '\n' | tac | xargs)
    start_all $order
    check
    stop_all
  done
  python benchmarks/studies/plain-path/pooled.py "$root"/start-* | tee "$root/pooled.md"
  exit 0
fi
# shellcheck disable=SC2086
start_all $servers
if [ "$plan" = auto-check ]; then
  check
  grep -h "delivers" "$logs/ours.log" || echo "ours: no correction of what drafting is worth"
  exit 0
fi
four="ours ours-plain llama-server llama-server-draft"
# shellcheck disable=SC2046
step new $(labels $four) --prompts humaneval --limit 16 --modes new --concurrency 1 4 8 16
# shellcheck disable=SC2046
step seen $(labels $four) --prompts humaneval --limit 16 --modes seen --concurrency 1 8
# shellcheck disable=SC2046
step chat $(labels $four) --prompts mtbench --limit 8 --modes chat --turns 2 --concurrency 1 8
# shellcheck disable=SC2046
step llama-cpp-python $(labels ours llama-cpp-python) --prompts humaneval --limit 8 --modes new \
  --concurrency 1 8
# the loaded cells again, three passes each: one pass of a cell at 8 or 16 varies by several
# percent between sittings, more than the differences the targets there ask about
# shellcheck disable=SC2046
step repeats-c1 $(labels $four) --prompts humaneval --limit 8 --modes new --concurrency 1 \
  --repeats 3
# shellcheck disable=SC2046
step repeats-new $(labels $three) --prompts humaneval --limit 16 --modes new --concurrency 8 16 \
  --repeats 3
# shellcheck disable=SC2046
step repeats-seen $(labels $three) --prompts humaneval --limit 16 --modes seen --concurrency 8 \
  --repeats 3
# shellcheck disable=SC2046
step repeats-chat $(labels $three) --prompts mtbench --limit 8 --modes chat --turns 2 \
  --concurrency 8 --repeats 3
# the same work on every server (--ignore-eos: every request runs to 64 tokens), since greedy
# texts move with the batch's shape and tokens/s otherwise weighs texts of different lengths
# shellcheck disable=SC2046
step equal-new $(labels $three) --prompts humaneval --limit 16 --modes new --concurrency 8 16 \
  --repeats 3 --ignore-eos
# shellcheck disable=SC2046
step equal-seen $(labels $three) --prompts humaneval --limit 16 --modes seen --concurrency 8 \
  --repeats 3 --ignore-eos
# shellcheck disable=SC2046
step equal-c4 $(labels $three) --prompts humaneval --limit 16 --modes new --concurrency 4 \
  --repeats 2 --ignore-eos
# shellcheck disable=SC2046
step equal-c1 $(labels $four) --prompts humaneval --limit 8 --modes new --concurrency 1 \
  --repeats 3 --ignore-eos

python - "$out/servers.json" <<PY
import json, sys
pids = {$(for name in "${!pid[@]}"; do printf '"%s": %s, ' "$name" "${pid[$name]}"; done)}
cmds = {$(for name in "${!cmd[@]}"; do printf '"%s": "%s", ' "$name" "${cmd[$name]//\"/}"; done)}
def peak_gib(p):  # VmHWM: the process's peak resident set
    try:
        for line in open(f"/proc/{p}/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        return None
try:  # a resumed run: the peak over every part of it
    before = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    before = {}
peaks = {n: max(filter(None, [peak_gib(p), before.get(n, {}).get("peak_rss_gib")]), default=None)
         for n, p in pids.items()}
json.dump({n: {"command": cmds[n], "peak_rss_gib": peaks[n]} for n in pids},
          open(sys.argv[1], "w"), indent=2)
PY
cat "$out/servers.json"
