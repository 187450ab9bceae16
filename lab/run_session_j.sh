#!/usr/bin/env bash
# One device call: the training backup's kept rows up to M/32 (the default), M/16 and none,
# on the tail, Pareto and uniform families; then the training op's whole GPU test file.
# Usage: OUT=dir lab/run_session_j.sh   (the library built in .carry/main.so)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
for fam in ${FAMILIES:-tail pareto uniform}; do
  timeout ${AB_SECONDS:-120} python3 lab/backup_fuse_ab.py --family $fam --variants no_keep,new,keep16 \
    --out "$OUT/keep_size_ab_$fam.json" 2>&1 | grep -v "^WARNING" | tail -1 | cut -c1-900
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT ${TEST_SECONDS:-200} python3 -m pytest -q -rf -n 14 -m gpu \
  tests/test_cuda_train.py tests/test_gpu_sharded.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
