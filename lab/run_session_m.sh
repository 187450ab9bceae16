#!/usr/bin/env bash
# Device calls for the branch issue-43-half-backup (lab/half_backup.diff: training backups up
# to half the rows, the per-call dense side priced as it runs) against main.
#   PART=ab: lab/diff_ab.sh on the synthetic rows it should move (log-normal at 2.85%, uniform
#     1.5%) and those it should not (tail, uniform and log-normal at 0.5%), two rounds, then
#     the branch's GPU tests of the training op.
#   PART=trained: the 0.5b preset trained as run_session_k.sh's trained part does, then
#     lab/diff_ab.sh on its last layer's operands (the layer that read 0.76x at d161775).
# Usage: OUT=dir PART=ab lab/run_session_m.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
T=16384:2048:5632
case ${PART:-ab} in
  ab)
    OUT=$OUT DIFF=lab/half_backup.diff AB_SECONDS=${AB_SECONDS:-110} \
      ROWS=${ROWS:-$T:0.0285:lognormal:train,$T:0.015:uniform:train,$T:0.005:tail:train,$T:0.005:uniform:train,$T:0.005:lognormal:train} \
      TESTS=tests/test_cuda_train.py TEST_K="public_op or deterministic or gradients_match_dense or backup" TEST_SECONDS=${TEST_SECONDS:-120} \
      bash lab/diff_ab.sh
    ;;
  trained)
    export RUNS=/tmp/e2e
    STAGES=sparse STEPS=${STEPS:-700} TRAIN_SECONDS=${TRAIN_SECONDS:-250} OUT=$OUT \
      bash benchmarks/run_gpu_e2e.sh 2>&1 | grep -v "^WARNING" | grep -E "^step +700|stage|rror" | tail -5
    timeout 120 python3 benchmarks/trained_activations.py --workdir $RUNS/0.5b-sparse --out-dir $RUNS/activations \
      --tokens 16384 2>&1 | grep -v "^WARNING" | tail -4
    OUT=$OUT DIFF=lab/half_backup.diff NPZ="$RUNS/activations/trained_0.5b_L7_m16384.npz" MODES=train ROWS='' \
      AB_SECONDS=${AB_SECONDS:-70} bash lab/diff_ab.sh
    ;;
esac
