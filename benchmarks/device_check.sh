#!/usr/bin/env bash
# One device check for a machine with an NVIDIA GPU: run once, from the repository root, in under 8 minutes.
#   benchmarks/device_check.sh [OUT.json] [--require-gpu]     (default: device_check.json)
# It checks the torch CUDA training path (bf16 autocast + activation checkpointing, fp16 + GradScaler, a one-rank
# NCCL group with one DDP step), the runtime's CUDA paths that run without TensorRT (device + pinned buffers, one
# stream, CUDA graph replay; ORT's CUDA EP with IOBinding), and `dsedge verify` on whatever provider is here
# (TensorRT when installed). Every check is pass / fail / skip (with the reason) in one JSON.
# Exit status: 0 no check failed and a GPU check passed (or no GPU here: the last line then says "no GPU here: every
# GPU check skipped", not a pass); 1 a check failed; 2 a usage error (nothing ran); 3 every GPU check skipped on a
# machine where nvidia-smi reports a GPU or is installed but fails (or with --require-gpu), e.g. a CPU-only torch and
# onnxruntime on a GPU box, with one stderr line saying why; 124 device_check.py ran past 460 s.
# Needs: the repo installed (pip install torch==2.13.0 -e ".[toolchain,dev]"; for the GPU paths also
# onnxruntime-gpu / cuda-python / nvidia-ml-py, i.e. the [gpu] extra in an environment without CPU onnxruntime).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-device_check.json}"
[ "$#" -gt 0 ] && shift  # what follows OUT.json (e.g. --require-gpu) goes to device_check.py
if [ -z "${DSEDGE_ENGINE_CACHE:-}" ]; then  # a cache of this run's own, removed at its end
  cache_root="$(mktemp -d)"
  trap 'rm -rf "$cache_root"' EXIT
  export DSEDGE_ENGINE_CACHE="$cache_root/engines"
fi
echo "[device_check] $(date -u +%FT%TZ) on $(hostname); output: $out"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python - <<'PY'
import importlib.util as u
for m in ("torch", "onnxruntime", "tensorrt", "cuda", "pynvml"):
    print(f"[device_check] {m}: {'yes' if u.find_spec(m) else 'no'}")
PY
timeout 460 python benchmarks/device_check.py --out "$out" "$@"
rc=$?
if [ "$rc" -eq 124 ]; then
  echo "[device_check] timed out after 460 s" >&2
fi
exit "$rc"
