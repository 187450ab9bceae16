#!/usr/bin/env bash
# One GPU session for the inference kernels: build, all GPU tests, compute-sanitizer on the
# fused-kernel tests (row and blocked), then the inference benchmark timing both fused
# kernels (JSON under $OUT); short table last. Step timeouts keep it under 10 minutes.
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
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -n ${GPU_TEST_WORKERS:-6} -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
if [ $sanitize = 1 ]; then
  for tool in memcheck racecheck; do
    for tests in "tests/test_cuda_ffn.py -k adversarial_rows" "tests/test_cuda_ffn_blocked.py -k over_budget"; do
      log="$OUT/sanitizer_${tool}_$(basename ${tests%% *} .py).log"
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 45 compute-sanitizer --tool $tool \
        --kernel-name kns=Twell --print-limit 20 python3 -m pytest -q -x -m gpu $tests > "$log" 2>&1
      echo "compute-sanitizer $tool ${tests}: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$log" | tr '\n' ' ')"
    done
  done
fi
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 230 python3 benchmarks/bench_inference.py $quick --out "$OUT/inference.json" > "$OUT/bench.log" 2>&1
echo "benchmark rc=$?"
grep -v '^{' "$OUT/bench.log" | tail -45
