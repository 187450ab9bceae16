#!/usr/bin/env bash
# One device call for the one-conditional branch: its GPU tests on the ops it changed (the
# training op, the inference dispatch, sharded and model paths), then tree B (.carry/b)
# against tree A (.carry/a, the base commit) on issue 43's training rows and one TILES row,
# then the published hybrid op on the same operands as far as the time allows.
# Usage: OUT=dir lab/run_session_d.sh   (carry .carry and .anchor)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT ${TEST_SECONDS:-150} python3 -m pytest -q -rf -n 8 -m gpu tests/test_cuda_train.py tests/test_cuda_dispatch.py \
  tests/test_gpu_sharded.py tests/test_gpu_models.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
unset XLA_PYTHON_CLIENT_PREALLOCATE
T=16384:2048:5632
C=$T:0.005:tail:train,$T:0.005:uniform:train,16384:4096:11008:0.005:uniform:infer
for tree in b a; do
  timeout ${TREE_SECONDS:-100} python3 benchmarks/run_tree.py .carry/$tree benchmarks/bench_floor.py --configs $C \
    --out "$OUT/floor_$tree.json" 2>&1 | grep -v "^WARNING" | tail -6
  echo "$tree rc=${PIPESTATUS[0]}"
done
timeout ${ANCHOR_SECONDS:-150} python3 benchmarks/run_tree.py .carry/a benchmarks/bench_floor.py --configs $T:0.005:uniform:train,$T:0.005:tail:train \
  --anchor .anchor --anchor-seconds $(( ${ANCHOR_SECONDS:-150} - 15 )) --out "$OUT/floor_a_public.json" 2>&1 | grep -v "^WARNING" | tail -6
echo "anchor rc=${PIPESTATUS[0]}"
