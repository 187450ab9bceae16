#!/usr/bin/env bash
# One GPU session for the inference kernels: build, all GPU tests, compute-sanitizer on the
# fused-kernel tests (row, blocked, tensor-core blocked, decode), then the inference and
# decode benchmarks (JSON under $OUT); short tables last. Step timeouts keep it under 10 minutes.
# Usage: JAX_TWELL_COMMIT=<commit measured> benchmarks/run_gpu.sh [--quick] [--no-sanitizer]
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
quick=""; sanitize=1
for a in "$@"; do
  case $a in --quick) quick=--quick ;; --no-sanitizer) sanitize=0 ;; esac
done
# A library built elsewhere (same nvcc, FFI headers no newer than this jaxlib) can be given
# as JAX_TWELL_CUDA_LIB: then nothing is compiled here.
if [ -n "${JAX_TWELL_CUDA_LIB:-}" ]; then export JAX_TWELL_CUDA=OFF; fi
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
grep -E "spill stores|error" "$OUT/install.log" | sort | uniq -c | head
python3 -c "import jax, jax_twell as jt; print(jax.__version__, jax.devices()); print(jt.kernel_status())"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT ${GPU_TEST_SECONDS:-170} python3 -m pytest -q -rf -n ${GPU_TEST_WORKERS:-6} -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
if [ $sanitize = 1 ]; then
  for tool in memcheck racecheck; do
    for spec in "tests/test_cuda_ffn.py|adversarial_rows" "tests/test_cuda_ffn_blocked.py|over_budget" \
                "tests/test_cuda_ffn_blocked.py|mma_matches_emulation and m77" \
                "tests/test_cuda_decode.py|m77 or gate_kernel and m17"; do
      file=${spec%%|*}; expr=${spec#*|}; log="$OUT/sanitizer_last.log"
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 45 compute-sanitizer --tool $tool \
        --kernel-name kns=Twell --print-limit 20 python3 -m pytest -q -x -m gpu "$file" -k "$expr" > "$log" 2>&1
      echo "compute-sanitizer $tool $file -k '$expr': rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$log" | tr '\n' ' ')"
    done
  done
fi
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 230 python3 benchmarks/bench_inference.py $quick --out "$OUT/inference.json" > "$OUT/bench.log" 2>&1
echo "benchmark rc=$?"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python3 benchmarks/bench_decode.py $quick --out "$OUT/decode.json" > "$OUT/bench_decode.log" 2>&1
echo "decode benchmark rc=$?"
grep -v '^{' "$OUT/bench.log" | tail -45
grep -v '^{' "$OUT/bench_decode.log" | tail -17
