#!/usr/bin/env bash
# The decoder issue's GPU measurement, call A (after the calls that carry the vLLM parts .gpu1..8 made by bench/gpu_stage.sh):
#   host setup (bench/gpu_host_setup.sh); bench.decoder_bench (static-shape decoder alone: ms per
#   forward and x real time per batch, eager baseline in the same run; the lookahead table; thread
#   vs process placement); bench.gpu_e2e floor + e2e (engine floor, steady levels, closed loop).
# Carry: .gpudeps .gpuw .gpukit. Results: $OUT/*.json|md|log and $OUT/all.tgz (everything).
# Call B: PHASE=B bash bench/gpu_decoder.sh (decoder bench, steady 64/256 with raw records and py-spy of
#   the gateway at 256, then the burst: 64 newcomers while 192 sessions play).
# DECODER=0 skips the decoder bench; PHASES_B=burst runs only the burst in call B; SPY=0 no py-spy
# in call B; EXACT_S>0 adds the exact-mode levels 1,64 after either call; ALT_ARGS="engine.X=V ..." adds
# (call C) a second gateway with those settings, levels ALT_SESSIONS (default 1,64), for a same-call A/B
# (ALT_THROUGHPUT=N: its closed loop too, N sessions).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PHASE=${PHASE:-A}
RES=/tmp/res-$PHASE
mkdir -p "$OUT" "$RES"
T0=$(date +%s)
bash bench/gpu_host_setup.sh > "$RES/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0
python3 -c "import vllm; print('vllm', vllm.__version__)" >> "$RES/setup.log" 2>&1 || { tail -30 "$RES/setup.log"; cp "$RES/setup.log" "$OUT/"; exit 1; }
echo "setup done in $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
nvidia-smi dmon -s u -d 1 > "$RES/dmon.txt" 2>&1 &
DMON=$!
left() { echo $(( ${BUDGET_S:-575} - ($(date +%s) - T0) )); }
if [ "$PHASE" = A ] || [ "$PHASE" = C ]; then
  [ "${DECODER:-1}" = 1 ] && timeout 170 python3 -m bench.decoder_bench --device cuda --batches 1,16,64,256 --json-out "$RES/decoder.json" \
    > "$RES/decoder.log" 2>&1
  echo "decoder bench rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  if [ "$PHASE" = C ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/spy .gpuw/py_spy-*.whl >> "$RES/setup.log" 2>&1
    SPY=$(ls /tmp/spy/bin/py-spy 2>/dev/null || echo py-spy)
    (  # py-spy (non-blocking: nothing is paused) of the gateway and of vLLM's engine core during
       # the 256-session level, from SPY_DELAY s after it starts (default 1: the sessions' arrival)
      for _ in $(seq 600); do grep -q "steady 256 sessions" "$RES/e2e.log" 2>/dev/null && break; sleep 1; done
      sleep "${SPY_DELAY:-1}"
      GW=$(pgrep -f "voicegw-gateway-0" | head -1); [ -n "$GW" ] || GW=$(pgrep -n -f "python3 -m voicegw.cli serve")  # the group: its first gateway process
      CORE=$(pgrep -n -f "EngineCore")
      [ -n "$CORE" ] && timeout 15 "$SPY" record --nonblocking -p "$CORE" -d 8 -r 50 --format raw -o "$RES/spy-core-256.txt" > "$RES/spy-core.log" 2>&1 &
      [ -n "$GW" ] && timeout 15 "$SPY" record --nonblocking -p "$GW" -d 8 -r 50 --format raw -o "$RES/spy-gateway-256.txt" > "$RES/spy.log" 2>&1
      wait
    ) &
  fi
  M=$(python3 -c "print(round(($(left) - 25 - ${EXACT_S:-0}) / 60, 2))")
  timeout $(( $(left) - 10 - ${EXACT_S:-0} )) python3 -m bench.gpu_e2e --phases ${PHASES_A:-floor,e2e} --fresh --floor-concurrency 1,64 \
    --floor-steps 128 --floor-max-seconds 25 --sessions "${SESSIONS:-1,64,256,400}" --duration 12 --settle 5 \
    --compare-concurrency "" --throughput-sessions 512 --max-minutes "$M" --out "$RES/e2e" \
    ${E2E_ARGS:-} > "$RES/e2e.log" 2>&1
  echo "gpu_e2e rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  if [ -n "${ALT_ARGS:-}" ] && [ "$(left)" -gt 150 ]; then  # a second gateway: the default with ALT_ARGS (space-separated SECTION.FIELD=VALUE)
    M=$(python3 -c "print(round(($(left) - 20 - ${EXACT_S:-0}) / 60, 2))")
    GA=(); for a in $ALT_ARGS; do GA+=(--gateway-arg "$a"); done
    timeout $(( $(left) - 8 - ${EXACT_S:-0} )) python3 -m bench.gpu_e2e --phases e2e --fresh --sessions "${ALT_SESSIONS:-1,64}" --duration 12 --settle 5 \
      --compare-concurrency "" --throughput-sessions "${ALT_THROUGHPUT:-0}" --warmup-s 4 --max-minutes "$M" --out "$RES/alt" ${E2E_ARGS:-} "${GA[@]}" > "$RES/alt.log" 2>&1
    echo "alt gpu_e2e ($ALT_ARGS) rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  fi
  if [ "${EXACT_S:-0}" -gt 0 ] && [ "$(left)" -gt 150 ]; then  # exact mode: seg-TTFA beside the default
    M=$(python3 -c "print(round(($(left) - 20) / 60, 2))")
    timeout $(( $(left) - 8 )) python3 -m bench.gpu_e2e --phases e2e --fresh --sessions 1,64 --duration 10 --settle 4 \
      --compare-concurrency "" --throughput-sessions 0 --warmup-s 3 --max-minutes "$M" --out "$RES/exact" \
      --gateway-arg engine.decoder_lookahead_steps=-1 > "$RES/exact.log" 2>&1
    echo "exact gpu_e2e rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  fi
else
  [ "${DECODER:-1}" = 1 ] && timeout 170 python3 -m bench.decoder_bench --device cuda --batches 1,16,64,256 --json-out "$RES/decoder.json" \
    > "$RES/decoder.log" 2>&1
  echo "decoder bench rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  python3 -m pip install -q --no-index --no-deps --target /tmp/spy .gpuw/py_spy-*.whl >> "$RES/setup.log" 2>&1
  SPY=$(ls /tmp/spy/bin/py-spy 2>/dev/null || echo py-spy)
  [ "${SPY:-1}" != 0 ] && (  # py-spy on the gateway process during the 256-session level
    for _ in $(seq 600); do grep -q "steady 256 sessions" "$RES/e2e.log" 2>/dev/null && break; sleep 1; done
    sleep 5
    GW=$(pgrep -f "voicegw-gateway-0" | head -1); [ -n "$GW" ] || GW=$(pgrep -n -f "python3 -m voicegw.cli serve")  # the group: its first gateway process
    [ -n "$GW" ] && timeout 20 "$SPY" record -p "$GW" -d 8 -r 100 --format raw -o "$RES/spy-gateway-256.txt" > "$RES/spy.log" 2>&1
  ) &
  M=$(python3 -c "print(round(($(left) - 25 - ${EXACT_S:-0}) / 60, 2))")
  timeout $(( $(left) - 10 - ${EXACT_S:-0} )) python3 -m bench.gpu_e2e --phases "${PHASES_B:-e2e,burst}" --fresh --sessions "${SESSIONS:-64,256}" \
    --duration 12 --settle 5 --compare-concurrency "" --throughput-sessions 0 --max-minutes "$M" --out "$RES/e2e" \
    --keep-raw ${E2E_ARGS:-} > "$RES/e2e.log" 2>&1
  echo "gpu_e2e rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  if [ "${EXACT_S:-0}" -gt 0 ] && [ "$(left)" -gt 150 ]; then
    M=$(python3 -c "print(round(($(left) - 20) / 60, 2))")
    timeout $(( $(left) - 8 )) python3 -m bench.gpu_e2e --phases e2e --fresh --sessions 1,64 --duration 10 --settle 4 \
      --compare-concurrency "" --throughput-sessions 0 --warmup-s 3 --max-minutes "$M" --out "$RES/exact" \
      --gateway-arg engine.decoder_lookahead_steps=-1 > "$RES/exact.log" 2>&1
    echo "exact gpu_e2e rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  fi
fi
kill $DMON 2>/dev/null
git rev-parse HEAD > "$RES/commit.txt" 2>/dev/null || true
cp "$RES/setup.log" "$OUT/" 2>/dev/null
[ -f "$RES/decoder.json" ] && cp "$RES/decoder.json" "$OUT/"
[ -f "$RES/e2e/gpu_e2e.json" ] && cp "$RES/e2e/gpu_e2e.json" "$OUT/"
[ -f "$RES/e2e/gpu_e2e.md" ] && cp "$RES/e2e/gpu_e2e.md" "$OUT/"
[ -f "$RES/exact/gpu_e2e.md" ] && cp "$RES/exact/gpu_e2e.md" "$OUT/gpu_e2e_exact.md"
[ -f "$RES/alt/gpu_e2e.md" ] && cp "$RES/alt/gpu_e2e.md" "$OUT/gpu_e2e_alt.md"
[ -f "$RES/alt/gpu_e2e.json" ] && cp "$RES/alt/gpu_e2e.json" "$OUT/gpu_e2e_alt.json"
tar czf "$OUT/all-$PHASE.tgz" -C "$RES" . 2>/dev/null
tail -25 "$RES/decoder.log" 2>/dev/null
grep -E "real time|healthy in|level|TTFA" "$RES/e2e.log" | tail -30
