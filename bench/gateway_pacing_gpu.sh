#!/usr/bin/env bash
# One device run of bench/gateway_pacing.py on a GPU host (python3.12 + torch preinstalled, offline):
# synthetic code engine at the H200's measured pace + the real decoder of a checkpoint with ChatTTS's
# full decoder (random weights, tiny GPT: the GPT is not used) on the GPU + the real gateway + load test.
# Prepare here (.gpup/ is git-ignored: carry it):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 --implementation cp --no-deps -d .gpup websockets uvloop orjson \
#     soxr prometheus_client safetensors pybase16384
#   python -c 'import dataclasses, engine; from engine.checkpoint import FULL, make_checkpoint; \
#     make_checkpoint("/tmp/ckfd", size=dataclasses.replace(FULL, gpt_hidden=128, gpt_layers=2, gpt_heads=2, \
#     gpt_kv_heads=2, gpt_intermediate=256, gpt_vocab=256, dvae_enc_hidden=32, dvae_enc_layers=1, \
#     decoder_hidden=64, decoder_layers=2))'
#   python bench/gateway_pacing_ckpt.py pack /tmp/ckfd .gpup/ck_packed
#   git show <commit before the fix>:engine/speech.py > .gpup/speech_before.py   (variant "before")
# Usage: bench/gateway_pacing_gpu.sh OUTDIR "SESSIONS..." "LOOKAHEADS..." ["before after"]
# (EXTRA="--set engine.synthetic_steps_per_s=55" etc. is passed to every run.)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/out}; sessions=${2:-10}; lookaheads=${3:--1 4}; variants=${4:-after}
mkdir -p /tmp/site "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpup/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
ck=/tmp/ck_fulldec
# the checkpoint (ChatTTS's full DVAE + Vocos, tiny GPT; `bench/gateway_pacing_ckpt.py pack` of a
# make-checkpoint dir) travels packed: its large random tensors are regenerated here
[ -d $ck ] || { cp -r .gpup/ck_packed $ck && python3 bench/gateway_pacing_ckpt.py unpack $ck; }
cp engine/speech.py /tmp/speech_after.py
for v in $variants; do
  if [ "$v" = before ]; then cp .gpup/speech_before.py engine/speech.py; else cp /tmp/speech_after.py engine/speech.py; fi
  for la in $lookaheads; do for n in $sessions; do
    echo "=== $v lookahead=$la sessions=$n"
    python3 -m bench.gateway_pacing --model-dir $ck --sessions $n --detail 0 \
      --set engine.device=cuda --set engine.decoder_lookahead_steps=$la --set engine.decoder_max_batch=256 \
      --set engine.decoder_torch_threads=0 ${EXTRA:-} 2>&1 | grep -v Warning | tail -6
  done; done
done
cp /tmp/speech_after.py engine/speech.py
