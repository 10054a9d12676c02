#!/usr/bin/env bash
# NIXL VRAM -> VRAM through the project's writer and receiver on one GPU (see scripts/gpu_check.py), including a
# layer-wise progressive write racing the kernels that compute each layer (posted only after their events).
#
#   scripts/gpu_check.sh                 on a machine with an NVIDIA GPU; no internet needed
#
# Needs python3 with torch (CUDA) and numpy, the repository's clients/nixl and rendezvous/protocol, and NIXL:
# importable already, or installed here from a wheel file (nixl-cu13, or nixl + nixl-cu13) found in
# $NIXL_WHEELS (default: wheels/ in the repository), into .gpu-check/site (nothing is installed system-wide).
# Without a GPU it prints "no GPU: skipping" and exits 0. Finishes within 8 minutes or fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}  # UCX_TLS: UCX picks (cuda_ipc between processes on one GPU)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU: skipping (nvidia-smi finds no NVIDIA GPU)"
  exit 0
fi
nvidia-smi -L

if ! "$PYTHON" -c 'import nixl._api' 2>/dev/null && ! "$PYTHON" -c 'import nixl_cu13._api' 2>/dev/null; then
  wheels=${NIXL_WHEELS:-wheels}
  shopt -s nullglob
  found=("$wheels"/nixl_cu13-*.whl "$wheels"/nixl-*.whl)
  if [ ${#found[@]} -eq 0 ]; then
    echo "FAIL: NIXL is not importable and no nixl-cu13 wheel is in $wheels (set NIXL_WHEELS)"
    exit 1
  fi
  "$PYTHON" -m pip install --quiet --no-index --no-deps --target .gpu-check/site "${found[@]}"
  export PYTHONPATH=".gpu-check/site${PYTHONPATH:+:$PYTHONPATH}"
fi

exec timeout --kill-after=10 470 "$PYTHON" scripts/gpu_check.py "$@"
