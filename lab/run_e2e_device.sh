#!/usr/bin/env bash
# The whole-model stages on one GPU, split over several short jobs (each under its own time
# limit): installs the project (a prebuilt library may be given as JAX_TWELL_CUDA_LIB), then
# runs benchmarks/run_gpu_e2e.sh with the environment given, and copies the runs' metrics
# and the bench outputs to $OUT. Usage: OUT=dir STAGES="..." [GROW=1.5b] lab/run_e2e_device.sh
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Compiled programs kept between the jobs (the machine keeps ignored folders while it is
# held): a bench that ran out of its job's time starts the next job with them compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/runs/jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-2}
if [ -n "${JAX_TWELL_CUDA_LIB:-}" ]; then export JAX_TWELL_CUDA=OFF; fi
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
start=$(date +%s)
OUT="$OUT/bench" bash benchmarks/run_gpu_e2e.sh 2>&1 | grep -v "^WARNING" | tee "$OUT/e2e.log" | \
  grep -E "step +[0-9]+ \||eval|corpus|error|Error|rc=|held-out|saved|grow|tokens/s|ratio|->|Traceback" | tail -60
rc=${PIPESTATUS[0]}
echo "e2e rc=$rc in $(( $(date +%s) - start )) s"
for run in runs/e2e/*/; do
  name=$(basename "$run")
  [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$OUT/${name}_metrics.jsonl"
  [ -f "$run/config.json" ] && cp "$run/config.json" "$OUT/${name}_config.json"
  [ -f "$run/grow.json" ] && cp "$run/grow.json" "$OUT/${name}_grow.json"
done
ls -la runs/e2e/ 2>/dev/null | head; df -h . | tail -1
exit $rc
