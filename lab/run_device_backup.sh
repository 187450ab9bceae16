#!/usr/bin/env bash
# One GPU session for the device backup (ffi/twell_backup.cu): install with a prebuilt
# library (JAX_TWELL_CUDA_LIB) or build, the warp path's GPU tests, compute-sanitizer
# memcheck and racecheck on the backup's kernels, then lab/device_backup.py (the forms side
# by side with XLA's dense FFN). Results under $OUT (device_backup.json and the logs).
# Usage: JAX_TWELL_COMMIT=<commit> [JAX_TWELL_CUDA_LIB=...] [CONFIGS=2048:uniform,...] [TRAIN_NOCOND=1]
#        [TESTS=0] [SANITIZE=0] [BENCH=0] lab/run_device_backup.sh  (TRAIN_NOCOND: also
#        lab/nocond_train.py; TESTS=0, SANITIZE=0, BENCH=0 skip those parts. The whole script
#        takes over 10 minutes: run it as two calls, BENCH=0 then TESTS=0 SANITIZE=0)
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${JAX_TWELL_CUDA_LIB:-}" ]; then export JAX_TWELL_CUDA=OFF; fi
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import jax_twell as jt; print(jt.kernel_status())"
if [ "${TESTS:-1}" = 1 ]; then
timeout -s INT ${GPU_TEST_SECONDS:-240} python3 -m pytest -q -rf -x -n ${GPU_TEST_WORKERS:-8} -m gpu \
  tests/test_cuda_ffn_warp.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
for tool in $([ "${SANITIZE:-1}" = 1 ] && echo memcheck racecheck); do
  XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 90 compute-sanitizer --tool $tool --kernel-name kns=Backup \
    --print-limit 10 python3 -m pytest -q -x -m gpu tests/test_cuda_ffn_warp.py -k "odd_shapes and bfloat16 or deterministic" \
    > "$OUT/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
done
# ~50 s a configuration (eleven variants compiled, nine interleaved rounds of 0.1 s each)
if [ "${BENCH:-1}" = 1 ]; then
timeout ${BENCH_SECONDS:-330} python3 lab/device_backup.py --min-seconds 0.1 \
  --configs "${CONFIGS:-2048:uniform,2048:tail,16384:uniform,16384:tail,65536:uniform,8192:uniform:1.0}" \
  --out "$OUT/device_backup.json" 2>&1 | grep -v "^WARNING"
fi
if [ -n "${TRAIN_NOCOND:-}" ]; then  # what the training step's two conditionals cost
  timeout ${TRAIN_BENCH_SECONDS:-200} python3 lab/nocond_train.py --out "$OUT/nocond_train.json" 2>&1 | grep -v "^WARNING"
fi
