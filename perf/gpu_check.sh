#!/usr/bin/env bash
# Everything GPU-side, in one call on a CUDA host (DEVELOPERS.md: one prepared
# script per device lease), within 9 minutes:
#   1. perf/gpu_step.py: one denoising step of full-size Flux.1-dev and Wan 2.1
#      14B transformers (random weights made on the GPU) through the torch
#      target, eager / CUDA graphs / torch.compile, against diffusers' module;
#   2. perf/gpu_attention.py: the SparseAttention kernel's checks and timings.
# GPU_CHECKS picks and orders them (default "step attention"; "tune" adds the
# attention kernel's launch settings at 32k tokens, about 2 minutes), so that a
# second call can rerun one part alone.
# Needs torch with CUDA and OpenAI Triton (the host's own); machgen is imported
# from this checkout, not installed. diffusers (pure Python) is installed from
# wheels fetched beforehand by `perf/gpu_check.sh --prepare` (on a machine with
# a package index and `make install` done) into build/gpu-wheels, when the host
# lacks it; --prepare also writes the trained model's attention inputs for the
# kernel's check into build/gpu-captured (carry both folders to the host).
# Tables go to $OUT (default build/gpu-check): record them in perf/RESULTS.md
# with the date and card.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=build/gpu-wheels
if [[ "${1:-}" == "--prepare" ]]; then
    diffusers=$(grep -o '"diffusers==[^"]*"' pyproject.toml | tr -d '"')
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$diffusers" importlib_metadata==10.2.0
    ls "$wheels"
    .venv/bin/python perf/bench_attention.py --save-captured build/gpu-captured/shapes-flux.pt
    exit 0
fi
OUT="${OUT:-build/gpu-check}"
mkdir -p "$OUT"

# machgen/ is the package: importable from the checkout's root.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ! python -c "import diffusers" 2>/dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --target build/gpu-site "$wheels"/*.whl
    export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu-site"
fi

python - <<'PY' | tee "$OUT/host.txt"
import platform, torch, diffusers
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
print(f"host {platform.node()}, torch {torch.__version__}, triton {triton_version}, diffusers {diffusers.__version__}, "
      f"cuda {torch.cuda.is_available() and torch.cuda.get_device_name()}")
PY
status=0
for check in ${GPU_CHECKS:-step attention}; do
    case "$check" in
        step) timeout 320 python perf/gpu_step.py --out "$OUT/gpu_step.md" ${GPU_STEP_ARGS:-} 2>&1 \
                  | tee "$OUT/gpu_step.log" || status=1 ;;
        attention) timeout 190 python perf/gpu_attention.py --out "$OUT/gpu_attention.md" 2>&1 \
                       | tee "$OUT/gpu_attention.log" || status=1 ;;
        tune) timeout 150 python perf/gpu_attention.py --tune 2>&1 | tee "$OUT/gpu_attention_tune.md" || status=1 ;;
        *) echo "unknown check '$check' (step, attention, tune)"; status=1 ;;
    esac
done
exit $status
