#!/usr/bin/env bash
# GPU check: install (building the CUDA library against the local jaxlib), report kernel
# status, run the GPU tests, and run compute-sanitizer over the kernel tests.
# Usage: scripts/gpu_check.sh [pytest -k expression]; logs go to $OUT (default ./gpu-logs).
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
grep -E "registers|spill|error" "$OUT/install.log" | head -20
python3 -c "import jax, jax_twell as jt; print(jax.__version__, jax.devices()); print(jt.kernel_status())"
# Test processes share the GPU (no preallocation); compilation dominates, so run several.
timeout 360 python3 -m pytest -q -n ${GPU_TEST_WORKERS:-6} -m gpu tests/ ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
for tool in ${SANITIZERS-memcheck racecheck}; do
  for tests in "tests/test_gpu_pack.py -k adversarial" "tests/test_cuda_ffn.py -k adversarial_rows"; do
    log="$OUT/sanitizer_${tool}_$(basename ${tests%% *} .py).log"
    XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 150 compute-sanitizer --tool $tool --kernel-name kns=Twell --print-limit 20 python3 -m pytest -q -x -m gpu $tests > "$log" 2>&1
    echo "compute-sanitizer $tool ${tests}: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$log" | tr '\n' ' ')"
  done
done
