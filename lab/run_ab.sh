#!/usr/bin/env bash
# One GPU session for an A/B of two builds: the working tree's package with the library
# .carry/b/libjax_twell_cuda.so.gz (B) against .carry/a/ (A): another commit's package, lab
# and library, or its library alone (then A runs the working tree's package). No install:
# both run from source (PYTHONPATH), each with its own library. Runs the working tree's GPU
# tests (TESTS, TESTS_K) while compute-sanitizer memcheck and racecheck run over SANITIZE_K
# (RACE_K for racecheck), then lab/device_backup.py over CONFIGS for each of SIDES (default: b a),
# then lab/timeline.py for each RULE:M:PATTERN of TIMELINES on the working tree's build. Results under $OUT.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
for z in .carry/b/libjax_twell_cuda.so.gz .carry/a/libjax_twell_cuda.so.gz; do [ -f $z ] && gunzip -kf $z; done
B_LIB=$PWD/.carry/b/libjax_twell_cuda.so A_LIB=$PWD/.carry/a/libjax_twell_cuda.so
A_DIR=$PWD; [ -d .carry/a/jax_twell ] && A_DIR=$PWD/.carry/a
b() { PYTHONPATH=$PWD JAX_TWELL_CUDA_LIB=$B_LIB "$@"; }
a() { (cd "$A_DIR" && PYTHONPATH=$A_DIR JAX_TWELL_CUDA_LIB=$A_LIB "$@"); }
# side c: B's build with the environment C_ENV (e.g. C_ENV="JAX_TWELL_WARP_CTAS=11")
c() { env ${C_ENV:-} PYTHONPATH=$PWD JAX_TWELL_CUDA_LIB=$B_LIB "$@"; }
b python3 -c "import jax, jax_twell as jt; print(jt.__file__, jax.__version__, jax.devices()); print(jt.kernel_status())"
[ -f "$A_LIB" ] && a python3 -c "import jax_twell as jt; print(jt.__file__); print(jt.kernel_status())"
pids=()
if [ -n "${SANITIZE_K:-}" ]; then
  for tool in memcheck racecheck; do
    k=$SANITIZE_K; [ $tool = racecheck ] && k=${RACE_K:-$SANITIZE_K}
    ( XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" b timeout ${SANITIZE_SECONDS:-240} \
        compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -x -m gpu tests/test_cuda_ffn_warp.py -k "$k" \
        > "$OUT/sanitizer_$tool.log" 2>&1
      echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')" ) &
    pids+=($!)
  done
fi
if [ -n "${TESTS:-}" ]; then
  b timeout -s INT ${GPU_TEST_SECONDS:-180} python3 -m pytest -q -rf -n ${GPU_TEST_WORKERS:-6} -m gpu $TESTS \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
fi
for p in "${pids[@]}"; do wait $p; done
if [ -n "${CONFIGS:-}" ]; then
  for side in ${SIDES:-b a}; do
    $side timeout ${BENCH_SECONDS:-150} python3 lab/device_backup.py --configs "$CONFIGS" ${ONLY:+--only $ONLY} \
      --out "$OUT/device_backup_$side.json" 2>&1 | grep -v "^WARNING" | tail -8
    [ -f "$OUT/device_backup_$side.json" ] && cp "$OUT/device_backup_$side.json" "$OUT/device_backup_${side}_$(date +%s).json"
  done
fi
for spec in ${TIMELINES:-}; do  # e.g. TIMELINES="auto:16384:uniform forced:2048:uniform"
  IFS=: read -r rule m pattern <<< "$spec"
  for side in ${TIMELINE_SIDES:-b}; do
  $side timeout ${TIMELINE_SECONDS:-90} python3 lab/timeline.py --kernel warp --rule $rule --m $m --pattern ${pattern:-uniform} \
    --out "$OUT/timeline_${side}_${rule}_${m}_${pattern:-uniform}.json" 2>&1 | grep -v "^WARNING" | tail -${TIMELINE_LINES:-30}
  done
done
