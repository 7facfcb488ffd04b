#!/usr/bin/env bash
# The engine issue's GPU measurement in ONE call (after the five calls that carry the vLLM parts):
#   host setup (bench/gpu_host_setup.sh), then bench.engine_bench: the ChatTTS plugin and the
#   stock-vLLM baseline (a Llama of the GPT's shape) in the same process, bursts of 1/64/256/512
#   streams x STEPS steps, CUDA graphs + async scheduling, py-spy on the plugin's engine core
#   during the 256 burst, nvidia-smi dmon beside it. Everything lands under $OUT.
# Carry: .gpudeps .gpuw .gpukit (copies of ../shared/gpu/*.py); calls before it carry the parts .gpu1...gpu8 (bench/gpu_stage.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-600}
LEVELS=${LEVELS:-1,64,256,512}
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
bash bench/gpu_host_setup.sh > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0
python3 -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/spy .gpuw/py_spy-*.whl >> "$OUT/setup.log" 2>&1
SPY=$(ls /tmp/spy/bin/py-spy 2>/dev/null || echo py-spy)
nvidia-smi dmon -s u -d 1 > "$OUT/dmon.txt" 2>&1 &
DMON=$!
run_bench() {  # $1: log name, rest: extra args
  local name=$1; shift
  timeout 520 python3 -m bench.engine_bench --device cuda --compile --backends vllm,stock --concurrency "$LEVELS" \
    --steps "$STEPS" --max-num-seqs 512 --max-num-batched-tokens 8192 --model-dir /tmp/ckgpt \
    --json-out "$OUT/$name.json" --spy-at 256 --spy-bin "$SPY" --spy-out "$OUT/spy" --spy-seconds 4 "$@" \
    > "$OUT/$name.log" 2>&1
}
run_bench engine
rc=$?
if [ $rc -ne 0 ] && ! grep -q "^stock" "$OUT/engine.log"; then  # the plugin did not start: PIECEWISE graphs
  echo "engine_bench rc=$rc; retrying with PIECEWISE CUDA graphs" >> "$OUT/setup.log"
  run_bench engine-piecewise --cudagraph-mode PIECEWISE
fi
kill $DMON 2>/dev/null
for f in "$OUT"/spy-*.txt; do
  [ -f "$f" ] || continue
  python3 .gpukit/spy_summary.py "$f" EngineCore run_busy_loop 6 > "${f%.txt}.core" 2>&1
  python3 .gpukit/spy_summary.py "$f" engine_bench "" 5 > "${f%.txt}.front" 2>&1
  python3 -m bench.spy_share "$f" >> "${f%.txt}.core" 2>&1
done
grep -E "^(vllm|stock) |ratio|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$|start-up" "$OUT"/engine*.log | tail -30
tail -5 "$OUT/dmon.txt"
