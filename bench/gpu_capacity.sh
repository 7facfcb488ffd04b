#!/usr/bin/env bash
# The capacity measurement on one GPU host, in ONE call (after the calls that carry the vLLM parts
# .gpu1..N made by bench/gpu_stage.sh). Carry: .gpudeps .gpuw .gpukit. Everything lands under $OUT.
#   1. host setup (bench/gpu_host_setup.sh);
#   1b. when DECODER_BENCH is set (bench.decoder_bench arguments, e.g. "--sections dtype --batches 64,256"):
#      the decoder alone, before any gateway (decoder.json);
#   2. the engine floor (bench.engine_bench through bench.gpu_e2e's floor phase) at FLOOR_C streams;
#   3. `voicegw serve` with its own defaults under the conversation workload (bench.gpu_e2e e2e phase,
#      levels SESSIONS, closed loop THROUGHPUT sessions), py-spy of every engine core, the newest decoder and
#      gateway process 0 during the level whose log line matches SPY_AT;
#   4. when ALT_ARGS is set ("SECTION.FIELD=VALUE ..."): a second gateway with those settings on the
#      same levels (ALT_SESSIONS, default SESSIONS), for a same-call A/B, py-spied the same way
#      (A_MAX_S: seconds the first gateway's run may take, so that the second gets the rest;
#      A_EXTRA: more bench.gpu_e2e arguments for the first run). `voicegw serve` runs its GPU
#      processes under an MPS daemon of its own (gateway.cuda_mps); ALT_ARGS="gateway.cuda_mps=false"
#      measures without.
# Budget: BUDGET_S seconds for the whole call (default 570). Every 20 s the files so far are packed
# into $OUT/all-cap.tgz, so a call cut short still returns them.
# Timing seen on H100/H200 hosts: the first call on a fresh machine spends ~60-70 s in setup (the full
# checkpoint is made once, 38-47 s) and its first gateway starts cold (two engine cores and two
# decoder processes compiling: 190 s to more than 250 s); later gateways on the same machine start in
# 80-120 s. A 40-s level takes ~55-65 s with its settle, the 40-s closed loop ~60 s; gpu_e2e skips
# (and records as skipped) a level it has no time for, and does not start a gateway that could not run
# one level after its start (--start-estimate-s). So a first call warms the caches and runs no A/B
# (bench/RESULTS.md, "Next on the GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
RES=/tmp/res-cap
rm -rf "$RES"  # a call before this one on the same machine left its files there
mkdir -p "$OUT" "$RES"
T0=$(date +%s)
left() { echo $(( ${BUDGET_S:-570} - ($(date +%s) - T0) )); }
git rev-parse HEAD > "$RES/commit.txt" 2>/dev/null || true
bash bench/gpu_host_setup.sh > "$RES/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0
python3 -c "import vllm, ChatTTS; print('vllm', vllm.__version__)" >> "$RES/setup.log" 2>&1 \
  || { tail -30 "$RES/setup.log"; cp "$RES/setup.log" "$OUT/"; exit 1; }
echo "setup done in $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/spy .gpuw/py_spy-*.whl >> "$RES/setup.log" 2>&1
SPY=$(ls /tmp/spy/bin/py-spy 2>/dev/null || echo py-spy)
if [ -n "${DECODER_BENCH:-}" ]; then
  timeout 240 python3 -m bench.decoder_bench --device cuda $DECODER_BENCH --json-out "$OUT/decoder.json" \
    > "$RES/decoder.log" 2>&1
  echo "decoder_bench rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"; cp "$RES/decoder.log" "$OUT/"
fi
nvidia-smi dmon -s u -d 1 > "$RES/dmon.txt" 2>&1 &
DMON=$!
# every 20 s, everything so far as $OUT/all-cap.tgz (gpu_e2e saves after each level): a call cut
# short (the machine taken back, the time limit) still brings back what it measured
( while sleep 20; do tar czf "$OUT/snap.tgz.part" -C "$RES" . 2>/dev/null && mv "$OUT/snap.tgz.part" "$OUT/all-cap.tgz"; done ) &
SNAP=$!

spy_during() {  # $1: log to watch, $2: tag; py-spy (non-blocking) of core, decoder, gateway 0
  ( for _ in $(seq 900); do grep -q "${SPY_AT:-steady 400 sessions}" "$1" 2>/dev/null && break; sleep 1; done
    sleep "${SPY_DELAY:-6}"
    DEC=$(pgrep -n -f "voicegw-decoder|decoder.worker")
    GW=$(pgrep -f "voicegw-gateway-0" | head -1); [ -n "$GW" ] || GW=$(pgrep -n -f "voicegw.cli serve")
    for CORE in $(pgrep -f "EngineCore"); do  # every engine core (gateway.engine_cores)
      timeout 20 "$SPY" record --nonblocking -p "$CORE" -d 10 -r 50 --format raw -o "$RES/spy-core-$2-$CORE.txt" > /dev/null 2>&1 &
    done
    [ -n "$DEC" ] && timeout 20 "$SPY" record --nonblocking -p "$DEC" -d 10 -r 50 --format raw -o "$RES/spy-decoder-$2.txt" > /dev/null 2>&1 &
    [ -n "$GW" ] && timeout 20 "$SPY" record --nonblocking -p "$GW" -d 10 -r 50 --format raw -o "$RES/spy-gateway-$2.txt" > /dev/null 2>&1
    wait
    # the gateway's MPS daemon logs (gateway.cuda_mps; removed when the gateway stops): its clients
    for d in /tmp/voicegw-mps-*/log; do [ -d "$d" ] && cp -r "$d" "$RES/mps-log-$2"; done
  ) > /dev/null 2>&1 &  # its own output: a spy still waiting must not hold the call's stdout
}

run_e2e() {  # $1: tag, $2: phases, $3: sessions, $4: closed-loop sessions, rest: extra gpu_e2e args
  local tag=$1 phases=$2 sessions=$3 thr=$4; shift 4
  local cap=$(( $(left) - ${RESERVE_S:-20} )); [ -n "${MAX_S:-}" ] && [ "$MAX_S" -lt "$cap" ] && cap=$MAX_S
  local M; M=$(python3 -c "print(round($cap / 60, 2))")
  spy_during "$RES/$tag.log" "$tag"
  # a gateway that cannot also run one level in the time left is not started (first start on a machine: ~165 s)
  local est=200; [ -f /tmp/voicegw-gateway-started ] && est=120
  timeout $(( cap + 10 )) python3 -m bench.gpu_e2e --phases "$phases" --fresh --workload conversation \
    --start-estimate-s "$est" \
    --floor-concurrency "${FLOOR_C:-1,400,512}" --floor-steps 256 --floor-max-seconds 25 --sessions "$sessions" \
    --compare-concurrency "" --throughput-sessions "$thr" --warmup-s 4 --max-minutes "$M" --out "$RES/$tag" "$@" \
    > "$RES/$tag.log" 2>&1
  echo "gpu_e2e $tag rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$RES/setup.log"
  grep -q "healthy in" "$RES/$tag.log" && touch /tmp/voicegw-gateway-started
  cp "$RES/$tag/gpu_e2e.json" "$OUT/gpu_e2e-$tag.json" 2>/dev/null
  cp "$RES/$tag/gpu_e2e.md" "$OUT/gpu_e2e-$tag.md" 2>/dev/null
}

MAX_S=${A_MAX_S:-} run_e2e a "${PHASES_A:-floor,e2e}" "${SESSIONS:-1,64,400/10,600/16}" "${THROUGHPUT:-400}" ${A_EXTRA:-}
if [ -n "${ALT_ARGS:-}" ] && [ "$(left)" -gt 150 ]; then
  GA=(); for a in ${ALT_ARGS:-}; do GA+=(--gateway-arg "$a"); done
  MAX_S= RESERVE_S=15 run_e2e b e2e "${ALT_SESSIONS:-${SESSIONS:-1,64,400/10,600/16}}" "${THROUGHPUT:-400}" --max-gateway-attempts 1 "${GA[@]}"
fi
kill $DMON $SNAP 2>/dev/null
wait $SNAP 2>/dev/null; rm -f "$OUT/snap.tgz.part"
kill $(jobs -p) 2>/dev/null  # a spy whose SPY_AT never matched
for f in "$RES"/spy-core-*.txt; do  # the engine core's busy-loop split (bench.spy_share)
  [ -f "$f" ] || continue
  python3 -m bench.spy_share "$f" > "${f%.txt}.share" 2>&1
done
cp "$RES"/setup.log "$RES"/commit.txt "$RES"/*.share "$RES"/*.summary "$OUT/" 2>/dev/null
tar czf "$OUT/all-cap.tgz" -C "$RES" . 2>/dev/null
grep -E "real time|healthy in|TTFA|Headline|aggregate" "$RES"/a.log "$RES"/b.log 2>/dev/null | tail -40
