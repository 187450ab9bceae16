#!/usr/bin/env bash
# One GPU session for the pattern benchmark: install (a prebuilt library may be given as
# JAX_TWELL_CUDA_LIB), the named GPU tests, compute-sanitizer on the warp kernel, then
# bench_patterns.py over CONFIGS with the published kernels (the anchor folder, when
# present) timed on the same inputs. Results under $OUT.
# Usage: CONFIGS=2048:2048:5632:uniform,... [TESTS="tests/test_cuda_ffn_warp.py"] [SANITIZE=test-file
#        SANITIZE_K=expr] [ANCHOR=.anchor] [EXTRA_CONFIGS=1:2048:5632:uniform,...] [NPZ="file.npz ..."]
#        benchmarks/run_gpu_patterns.sh
# EXTRA_CONFIGS are timed too (patterns_extra.json) but not given to the published kernels
# (shapes they do not take); NPZ inputs (trained-model activations) are timed and given to them.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${JAX_TWELL_CUDA_LIB:-}" ]; then export JAX_TWELL_CUDA=OFF; fi
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import jax, jax_twell as jt; print(jax.__version__, jax.devices()); print(jt.kernel_status())"
if [ -d "${ANCHOR:-.anchor}" ]; then  # the published extension compiles (CPU) while the tests run
  (cd "${ANCHOR:-.anchor}/public/twell_modules" && python3 -c "import twell; twell.get_ext(algorithms=['twell_mlp'])") \
    > "$OUT/anchor_build.log" 2>&1 &
  anchor_build=$!
fi
if [ -n "${TESTS:-}" ]; then
  timeout -s INT ${GPU_TEST_SECONDS:-150} python3 -m pytest -q -rf -x -n ${GPU_TEST_WORKERS:-8} -m gpu $TESTS 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -8
fi
if [ -n "${SANITIZE:-}" ]; then
  for tool in memcheck racecheck; do
    XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 90 compute-sanitizer --tool $tool --kernel-name kns=Warp \
      --print-limit 20 python3 -m pytest -q -x -m gpu $SANITIZE ${SANITIZE_K:+-k "$SANITIZE_K"} > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi
npz=$(mktemp -d)
timeout ${BENCH_SECONDS:-240} python3 benchmarks/bench_patterns.py --configs "$CONFIGS" --npz-dir "$npz" \
  --out "$OUT/patterns.json" 2>&1 | grep -v "^WARNING" | tail -20
if [ -n "${EXTRA_CONFIGS:-}" ]; then
  timeout ${EXTRA_BENCH_SECONDS:-150} python3 benchmarks/bench_patterns.py --configs "$EXTRA_CONFIGS" \
    --out "$OUT/patterns_extra.json" 2>&1 | grep -v "^WARNING" | tail -20
fi
if [ -n "${NPZ:-}" ]; then
  timeout ${NPZ_BENCH_SECONDS:-150} python3 benchmarks/bench_patterns.py --npz $NPZ \
    --out "$OUT/patterns_trained.json" 2>&1 | grep -v "^WARNING" | tail -20
  cp $NPZ "$npz"/
fi
if [ -d "${ANCHOR:-.anchor}" ]; then
  wait $anchor_build; echo "anchor build rc=$?"
  for f in "$npz"/*.npz; do
    timeout ${ANCHOR_SECONDS:-200} python3 "${ANCHOR:-.anchor}/bench_public.py" "$f" --mode ${ANCHOR_MODE:-inference} 2>>"$OUT/anchor.log" \
      | tail -1 >> "$OUT/public.jsonl"
  done
  python3 - "$OUT/public.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    i = r.get("inference", {})
    print(f"{r['inputs']:36s} public {i.get('public_ms', float('nan')):7.3f}ms torch dense {i.get('dense_ms', float('nan')):7.3f}ms "
          f"err {i.get('public_err', float('nan')):.3g} {i.get('public_error', '')}")
EOF
fi
rm -rf "$npz"
