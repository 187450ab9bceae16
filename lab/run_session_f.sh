#!/usr/bin/env bash
# One device call: the mended union-dx GPU tests, then every GPU test, on the working tree.
# Usage: OUT=dir lab/run_session_f.sh   (carry .carry)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip show jax_twell > /dev/null 2>&1 || python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 60 python3 -m pytest -q -rf -m gpu tests/test_cuda_train.py -k union_dx_match_dense 2>&1 | tail -3
timeout -s INT ${GPU_TEST_SECONDS:-220} python3 -m pytest -q -rf -n 8 -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
