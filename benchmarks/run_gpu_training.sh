#!/usr/bin/env bash
# One GPU session for the training kernels (ffi/twell_train.cu): build, all GPU tests,
# compute-sanitizer memcheck and racecheck on a small training forward + backward, then the
# training benchmark (JSON under $OUT); short table last. Step timeouts (130 + 100 + 2 x 45 + 200 s
# after a ~40 s build) keep it under 10 minutes; a test step cut by its timeout is interrupted
# (SIGINT), so pytest still prints its summary and the failed tests' ids (-rf).
# Usage: JAX_TWELL_COMMIT=<commit measured> benchmarks/run_gpu_training.sh [--quick] [--no-sanitizer]
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
# The training tests first (their own log), then every other GPU test (the blocked inference
# kernels share their device code with the training kernels).
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT 130 python3 -m pytest -q -rf -n ${GPU_TEST_WORKERS:-6} -m gpu tests/test_cuda_train.py 2>&1 \
  | tee "$OUT/gpu_tests_train.log" | tail -15
[ "${SKIP_OTHER_TESTS:-0}" = 1 ] || XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT 100 python3 -m pytest -q -rf -n ${GPU_TEST_WORKERS:-6} -m gpu tests/ --ignore=tests/test_cuda_train.py 2>&1 \
  | tee "$OUT/gpu_tests_other.log" | tail -4
if [ $sanitize = 1 ]; then
  for tool in memcheck racecheck; do
    log="$OUT/sanitizer_${tool}_train.log"
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 45 compute-sanitizer --tool $tool \
      --kernel-name kns=Twell --print-limit 20 python3 -m pytest -q -x -m gpu tests/test_cuda_train.py -k small_for_sanitizer > "$log" 2>&1
    echo "compute-sanitizer $tool test_cuda_train small_for_sanitizer: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$log" | tr '\n' ' ')"
  done
fi
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 benchmarks/bench_training.py $quick --out "$OUT/training.json" > "$OUT/bench_training.log" 2>&1
rc=$?
echo "benchmark rc=$rc"
# Rows are printed as JSON lines as they finish: a timed-out run still shows what it measured.
[ $rc = 0 ] || grep '^{' "$OUT/bench_training.log" | cut -c1-400 | tail -10
grep -v '^{' "$OUT/bench_training.log" | tail -20
