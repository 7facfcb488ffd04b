#!/usr/bin/env bash
# Stage what an offline GPU host (python3.12 + torch 2.11 cu130, no package index) needs for the
# project's GPU measurements, as ignored folders at the repo root that the device calls carry:
#   .gpu1 .. .gpuN  the vLLM 0.26.0 wheel in 40 MB pieces (each call carries the tree too, ~17 MB);
#                   the last one also carries the largest wheels vLLM imports at start-up
#   .gpudeps        the other wheels vLLM imports + install.sh (joins the pieces, installs all)
#   .gpuw           the wheels voicegw needs beside it (bench/gpu_host_setup.sh installs them)
#   .gpukit         a copy of ../shared/gpu (reference instruments)
# Then: one call per .gpuK (`mkdir -p /tmp/parts && cp .gpuK/* /tmp/parts/`), back to back,
# and the measurement call carrying .gpudeps .gpuw .gpukit (bench/gpu_decoder.sh, bench/gpu_engine.sh).
# Uses ../shared/gpu/stage-vllm.sh for the vLLM wheel set. Needs pip with access to the index.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu\*/' .git/info/exclude 2>/dev/null || echo '/.gpu*/' >> .git/info/exclude
bash ../shared/gpu/stage-vllm.sh
TMP=$(mktemp -d)
# stage-vllm.sh cut 60 MB pieces; re-cut to 40 MB so a piece plus the tree fits one call.
ls .gpu[1-6]/vpart.* | sort -t. -k3 -n | xargs cat > "$TMP/vllm.whl"
[ "$(sha256sum "$TMP/vllm.whl" | awk '{print $1}')" = "$(cat .gpu6/vllm.sha256)" ]
mv .gpu6/deps "$TMP/deps"; cp .gpu6/vllm.sha256 "$TMP/"
rm -rf .gpu[0-9] .gpu[0-9][0-9] .gpudeps
split -b 40000000 -d -a 1 "$TMP/vllm.whl" "$TMP/vpart."
n=0; for f in $(ls "$TMP"/vpart.* | sort -t. -k2 -n); do n=$((n+1)); mkdir -p ".gpu$n"; mv "$f" ".gpu$n/"; done
mkdir -p .gpudeps; mv "$TMP/deps" .gpudeps/deps; cp "$TMP/vllm.sha256" .gpudeps/
for w in pycountry mistral_common llguidance openai_harmony; do mv .gpudeps/deps/$w-*.whl ".gpu$n/"; done
cat > .gpudeps/install.sh <<'INNER'
#!/bin/bash
# On the GPU host: every .gpuK/vpart.* must already be in /tmp/parts.
set -euo pipefail
cd "$(dirname "$0")/.."
W=/tmp/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
cat $(ls /tmp/parts/vpart.* | sort -t. -k2 -n) > "$W"
[ "$(sha256sum "$W" | awk '{print $1}')" = "$(cat .gpudeps/vllm.sha256)" ] || { echo "vllm wheel incomplete: a part is missing from /tmp/parts"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$W" /tmp/parts/*.whl .gpudeps/deps/*.whl
echo "vLLM installed in /tmp/site"
INNER
chmod +x .gpudeps/install.sh
rm -rf .gpuw; mkdir -p .gpuw
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
for p in "websockets>=15,<18" uvloop orjson soxr vocos==0.1.0 einops pybase16384 prometheus-client h11 \
         vector-quantize-pytorch torch-einops-utils einx frozendict py-spy; do
  python3 -m pip download -q --no-deps $PLAT -d .gpuw "$p" || python3 -m pip download -q --no-deps --only-binary=:all: -d .gpuw "$p"
done
python3 -m pip download -q --no-deps --no-binary=:all: -d .gpuw chattts==0.2.5 encodec
rm -rf .gpukit; cp -r ../shared/gpu .gpukit
rm -rf "$TMP"
du -sh .gpu* | tr '\n' ' '; echo
