#!/usr/bin/env bash
# One device call for the written-out backup of the training op: its GPU tests, then tree B
# (.carry/b) against tree A (.carry/a, the base commit) on the training rows, B A B A, then a
# GPU trace of B's step on the tail family.
# Usage: OUT=dir lab/run_session_g.sh   (the library built in .carry/main.so, the trees in .carry/a and .carry/b)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT ${TEST_SECONDS:-120} python3 -m pytest -q -rf -n 8 -m gpu tests/test_cuda_train.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
unset XLA_PYTHON_CLIENT_PREALLOCATE
T=16384:2048:5632
C=${CONFIGS:-$T:0.005:tail:train,$T:0.005:uniform:train}
i=0
for tree in ${TREES:-b a b a}; do
  i=$((i + 1))
  timeout ${TREE_SECONDS:-75} python3 benchmarks/run_tree.py .carry/$tree benchmarks/bench_floor.py --configs $C \
    --out "$OUT/floor_${tree}_$i.json" 2>&1 | grep -v "^WARNING" | tail -4
  echo "$tree rc=${PIPESTATUS[0]}"
done
[ "${TIMELINE:-tail}" != none ] && timeout 90 python3 lab/timeline.py --train --rule auto --m 16384 --family ${TIMELINE:-tail} \
  --out "$OUT/timeline_train_${TIMELINE:-tail}.json" 2>&1 | grep -v "^WARNING" | tail -30
# what the step's conditionals cost: each switch fixed to the branch the rows take
if [ "${PROBE:-1}" != 0 ]; then
  timeout 100 python3 lab/sync_probe.py --family uniform --branch 1 --out "$OUT/sync_uniform.json" 2>&1 | grep -v "^WARNING" | tail -2
  timeout 100 python3 lab/sync_probe.py --family tail --branch 3 --out "$OUT/sync_tail.json" 2>&1 | grep -v "^WARNING" | tail -2
  XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE timeout 100 \
    python3 lab/sync_probe.py --family uniform --branch 1 --out "$OUT/sync_uniform_cmdbuf.json" 2>&1 | grep -v "^WARNING" | tail -2
fi
