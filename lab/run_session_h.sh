#!/usr/bin/env bash
# One device call: the written-out backup old against new in one process (and with sizes at
# half steps), GPU traces of the new training step and of the inference call on the tail family, then the GPU tests of the
# training op under a mesh and the op's gradient tests.
# Usage: OUT=dir lab/run_session_h.sh   (the library built in .carry/main.so)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${AB_SECONDS:-150} python3 lab/backup_ab.py --family tail --fine --out "$OUT/backup_ab_tail.json" 2>&1 | grep -v "^WARNING" | tail -3 | cut -c1-2000
timeout 90 python3 lab/timeline.py --train --rule auto --m 16384 --family tail --out "$OUT/timeline_train_tail.json" 2>&1 \
  | grep -v "^WARNING" | tail -30
[ "${INFER_TIMELINE:-1}" != 0 ] && timeout 80 python3 lab/timeline.py --rule auto --m 16384 --family tail --out "$OUT/timeline_infer_tail.json" 2>&1 \
  | grep -v "^WARNING" | tail -30
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT ${TEST_SECONDS:-120} python3 -m pytest -q -rf -n 8 -m gpu tests/test_gpu_sharded.py \
  tests/test_cuda_train.py -k "sharded_training or public_op or deterministic or gradients_match_dense or union_dx" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -6
