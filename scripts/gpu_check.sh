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
python3 -m pytest -q -m gpu tests/ ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -x -m gpu tests/test_gpu_pack.py -k adversarial \
    > "$OUT/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$tool.log" | sort | uniq -c | tr '\n' ' ')"
done
