#!/usr/bin/env bash
# Issue 33's GPU checks in ONE call (after the part calls of bench/gpu_stage.sh; carry .gpudeps .gpuw
# .gpukit), each bounded so that the call ends well inside the device's limit; results under $OUT:
#   1. host setup (bench/gpu_host_setup.sh) and the full-size random checkpoint /tmp/ckfull (kept
#      when a call before this one on the same machine made it);
#   2. kill -9 of `voicegw serve` under SESSIONS receiving sessions, then a restart (bench.gpu_kill9);
#   3. resume determinism in bf16 on the GPU (bench.resume_determinism, CROWD other requests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
bash bench/gpu_host_setup.sh > "$OUT/crash-setup.log" 2>&1 || { tail -20 "$OUT/crash-setup.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0
[ -f /tmp/ckfull/asset/gpt/config.json ] || python3 -m voicegw.cli make-checkpoint --size full /tmp/ckfull \
  >> "$OUT/crash-setup.log" 2>&1
echo "setup done in $(( $(date +%s) - T0 )) s"
timeout "${KILL9_S:-300}" python3 -m bench.gpu_kill9 --model-dir /tmp/ckfull --sessions "${SESSIONS:-64}" \
  --out "$OUT/kill9.json" > "$OUT/kill9.log" 2>&1
echo "gpu_kill9 rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 "$OUT/kill9.log"
timeout "${DETERMINISM_S:-180}" python3 -m bench.resume_determinism --device cuda --model-dir /tmp/ckfull \
  --crowd "${CROWD:-63}" --out "$OUT/determinism.json" > "$OUT/determinism.log" 2>&1
echo "resume_determinism rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 "$OUT/determinism.log"
