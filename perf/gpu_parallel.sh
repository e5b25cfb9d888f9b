#!/usr/bin/env bash
# The parallel layouts on CUDA with NCCL: sequence-parallel attention against SDPA, and the ring's overlap.
# Needs 2 or more visible GPUs; with fewer it says so and exits 0 (a one-GPU machine has nothing to check).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -lt 2 ]; then
    echo "perf/gpu_parallel.sh: $gpus GPU(s) visible; the parallel layouts need 2 or more: nothing run"
    exit 0
fi
exec "$PYTHON" perf/gpu_parallel.py
