#!/usr/bin/env bash
# One GPU session for the wgmma backup (ffi/twell_backup_gemm.cu): install (a prebuilt
# library may be given as JAX_TWELL_CUDA_LIB), the GPU tests named in TESTS (TESTS_K: a -k
# expression), compute-sanitizer over SANITIZE_K's tests, the graph
# probe (lab/run_graph_cond_probe.sh) built while the tests run, then lab/device_backup.py
# over CONFIGS. Results under $OUT.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${JAX_TWELL_CUDA_LIB:-}" ]; then export JAX_TWELL_CUDA=OFF; fi
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import jax, jax_twell as jt; print(jax.__version__, jax.devices()); print(jt.kernel_status())"
if [ -n "${TESTS:-}" ]; then
  timeout -s INT ${GPU_TEST_SECONDS:-180} python3 -m pytest -q -rf -n ${GPU_TEST_WORKERS:-8} -m gpu $TESTS \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
fi
if [ -n "${SANITIZE_K:-}" ]; then  # e.g. SANITIZE_K="wgmma and odd_shapes"
  for tool in memcheck racecheck; do
    # XLA's command buffers off: under them the sanitizer's process crashed before any report
    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" timeout ${SANITIZE_SECONDS:-240} compute-sanitizer --tool $tool \
      --print-limit 20 python3 -m pytest -q -x -m gpu tests/test_cuda_ffn_warp.py -k "$SANITIZE_K" \
      > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi
if [ -n "${PROBE:-}" ]; then
  OUT=$OUT/probe timeout 90 lab/run_graph_cond_probe.sh 2>&1 | tail -12
fi
if [ -n "${CONFIGS:-}" ]; then
  timeout ${BENCH_SECONDS:-200} python3 lab/device_backup.py --configs "$CONFIGS" ${ONLY:+--only $ONLY} \
    --out "$OUT/device_backup.json" 2>&1 | grep -v "^WARNING" | tail -12
fi
