#!/usr/bin/env bash
# GPU check: install (building the CUDA library against the local jaxlib), report kernel
# status, run the GPU tests, and run compute-sanitizer over the kernel tests.
# Usage: scripts/gpu_check.sh [pytest -k expression]; logs go to $OUT (default ./gpu-logs).
# The build needs nvidia-cutlass installed (or CUTLASS_DIR set): it runs without isolation.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# JAX_TWELL_CUDA=ON: a build that cannot make the library fails here instead of skipping it.
JAX_TWELL_CUDA=ON python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
grep "jax-twell:" "$OUT/install.log"
grep -E "registers|spill|error" "$OUT/install.log" | head -20
python3 -c "import jax, jax_twell as jt; print(jax.__version__, jax.devices()); print(jt.kernel_status())"
# Test processes share the GPU (no preallocation); compilation and the references dominate,
# so run several. The whole GPU suite (~580 tests) takes ~3.5 minutes with 14 workers on one
# H200 and 16 CPU cores (tests/conftest.py turns XLA's GEMM autotuning off; with it on, ~18
# minutes); GPU_TEST_SECONDS bounds it (default one hour).
workers=${GPU_TEST_WORKERS:-$(( $(nproc) < 14 ? $(nproc) : 14 ))}
timeout -s INT ${GPU_TEST_SECONDS:-3600} python3 -m pytest -q -rf -n $workers -m gpu --durations=10 tests/ ${1:+-k "$1"} 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25
# The other tests state CPU semantics (f32 products in f32, 4 host devices, the CPU
# kernels): in a process of their own on the CPU (CPU_TESTS=0 leaves them out).
if [ "${CPU_TESTS:-1}" != 0 ]; then
  JAX_PLATFORMS=cpu timeout -s INT ${GPU_TEST_SECONDS:-3600} python3 -m pytest -q -rf -n $workers -m "not gpu" tests/ \
    2>&1 | tee "$OUT/cpu_tests.log" | tail -5
fi
for tool in ${SANITIZERS-memcheck racecheck}; do
  # The fused gate's kernel is CUTLASS's device_kernel template.
  for spec in "Twell:tests/test_gpu_pack.py -k adversarial" "Twell:tests/test_cuda_ffn.py -k adversarial_rows" \
              "Warp:tests/test_cuda_ffn_warp.py -k kernel_rows and bfloat16 and not nongated and (37 or 1000)" \
              "device_kernel:tests/test_cuda_gate.py -k exact_activation and bf16 and (77 or 300)"; do
    kernels=${spec%%:*} tests=${spec#*:}
    log="$OUT/sanitizer_${tool}_$(basename ${tests%% *} .py).log"
    file=${tests%% -k *} expr=${tests#* -k }
    XLA_FLAGS="--xla_gpu_autotune_level=0" timeout 150 compute-sanitizer --tool $tool --kernel-name kns=$kernels --print-limit 20 python3 -m pytest -q -x -m gpu $file -k "$expr" > "$log" 2>&1
    echo "compute-sanitizer $tool ${tests}: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$log" | tr '\n' ' ')"
  done
done
