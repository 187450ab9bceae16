#!/usr/bin/env bash
# One GPU session for the inference kernels: build, all GPU tests, the inference benchmark
# (JSON under $OUT), then compute-sanitizer on the fused-kernel tests; short table last.
# Usage: JAX_TWELL_COMMIT=<commit measured> benchmarks/run_gpu.sh [--quick] [--no-sanitizer]
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
quick=""; sanitize=1
for a in "$@"; do
  case $a in --quick) quick=--quick ;; --no-sanitizer) sanitize=0 ;; esac
done
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
grep -E "spill stores|error" "$OUT/install.log" | sort | uniq -c | head
python3 -c "import jax, jax_twell as jt; print(jax.__version__, jax.devices()); print(jt.kernel_status())"
timeout 200 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 220 python3 benchmarks/bench_inference.py $quick --out "$OUT/inference.json" > "$OUT/bench.log" 2>&1
if [ $sanitize = 1 ]; then
  for tool in memcheck racecheck; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 80 compute-sanitizer --tool $tool --print-limit 20 \
      python3 -m pytest -q -x -m gpu tests/test_cuda_ffn.py -k "adversarial or poisoned" > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$tool.log" | sort | uniq -c | tr '\n' ' ') $(tail -1 "$OUT/sanitizer_$tool.log")"
  done
fi
grep -v '^{' "$OUT/bench.log" | tail -45
