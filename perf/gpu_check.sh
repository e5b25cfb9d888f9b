#!/usr/bin/env bash
# Everything GPU-side, in one call on a CUDA host (DEVELOPERS.md: one prepared
# script per device lease): the SparseAttention kernel's checks and timings.
# Needs only torch with CUDA and OpenAI Triton (the host's own); machgen is
# imported from this checkout, not installed. Tables go to $OUT (default
# build/gpu-check): record them in perf/RESULTS.md with the date and card.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-check}"
mkdir -p "$OUT"

# pyproject maps machgen.builder to builder/ and so on; a folder of links gives the same import paths.
shim=build/gpu-path
rm -rf "$shim"
mkdir -p "$shim/machgen"
cp machgen/*.py "$shim/machgen/"
for package in builder ensembles client plugins; do
    ln -s "$PWD/$package" "$shim/machgen/$package"
done
export PYTHONPATH="$PWD/$shim${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

python - <<'PY' | tee "$OUT/host.txt"
import platform, torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
print(f"host {platform.node()}, torch {torch.__version__}, triton {triton_version}, "
      f"cuda {torch.cuda.is_available() and torch.cuda.get_device_name()}")
PY
timeout 420 python perf/gpu_attention.py --out "$OUT/gpu_attention.md" 2>&1 | tee "$OUT/gpu_attention.log"
