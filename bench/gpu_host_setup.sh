#!/usr/bin/env bash
# Prepare an offline GPU host (python3.12 + torch 2.11 cu130, no package index) to run voicegw:
#   - vLLM 0.26.0 from the staged parts (bench/gpu_stage.sh: .gpu1..8 -> /tmp/parts, 40 MB each: the tree travels too) and .gpudeps
#   - the small wheels voicegw needs beside it (.gpuw: websockets, uvloop, orjson, soxr, vocos, ...)
#   - the voicegw vLLM plugin entry point (a dist-info in /tmp/site; the repo itself is on PYTHONPATH)
#   - a no-op numba for upstream ChatTTS's text normaliser (not used; numba is not on the host)
# Then: export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import vllm" 2>/dev/null; then
  bash .gpudeps/install.sh
fi
if [ -d .gpuw ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site/_wheels .gpuw/*.whl && cp -rn /tmp/site/_wheels/. /tmp/site/ 2>&1 | tail -2 || true
  if [ -f .gpuw/chattts-0.2.5.tar.gz ] && [ ! -d /tmp/site/ChatTTS ]; then
    tar -xzf .gpuw/chattts-0.2.5.tar.gz -C /tmp && cp -r /tmp/chattts-0.2.5/ChatTTS /tmp/site/
  fi
  for sd in .gpuw/encodec-*.tar.gz; do  # sdist only on PyPI; pure Python
    [ -f "$sd" ] && [ ! -d /tmp/site/encodec ] && tar -xzf "$sd" -C /tmp && cp -r /tmp/encodec-*/encodec /tmp/site/
  done
fi
mkdir -p /tmp/site/voicegw_plugin-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: voicegw-plugin\nVersion: 0.1.0\n' > /tmp/site/voicegw_plugin-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\nvoicegw_chattts = engine.vllm.plugin:register\n' > /tmp/site/voicegw_plugin-0.1.0.dist-info/entry_points.txt
if ! PYTHONPATH=/tmp/site python3 -c "import numba" 2>/dev/null; then
  mkdir -p /tmp/site/numba
  cat > /tmp/site/numba/__init__.py <<'PY'
"""No-op stand-in for numba on the GPU bench host (upstream ChatTTS's normaliser imports it)."""
def jit(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f
njit = jit
PY
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import vllm, ChatTTS, websockets, orjson, soxr, engine; print('gpu host ready: vllm', vllm.__version__)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
