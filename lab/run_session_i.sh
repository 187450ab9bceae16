#!/usr/bin/env bash
# One device call: the training backup's gathered gate and fused adds on and off (tail and
# log-normal families), the training op's GPU tests, and the trace of the inference call
# on the tail family.
# Usage: OUT=dir lab/run_session_i.sh   (the library built in .carry/main.so)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
for fam in ${FAMILIES:-tail lognormal uniform}; do
  timeout ${AB_SECONDS:-170} python3 lab/backup_fuse_ab.py --family $fam --out "$OUT/backup_fuse_ab_$fam.json" 2>&1 \
    | grep -v "^WARNING" | tail -2 | cut -c1-1500
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT ${TEST_SECONDS:-120} python3 -m pytest -q -rf -n 8 -m gpu \
  tests/test_cuda_train.py -k "public_op or deterministic or gradients_match_dense or union_dx" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -6
[ "${INFER_TIMELINE:-1}" != 0 ] && timeout 90 python3 lab/timeline.py --rule auto --kernel auto --m 16384 --family tail \
  --out "$OUT/timeline_infer_tail.json" 2>&1 | grep -v "^WARNING" | tail -40
