#!/usr/bin/env bash
# One device call: the mended GPU tests of the training op (the sparse side traced once per
# backup size), then GPU traces of the default training step on uniform and tail rows
# (d=2048, f=5632, M=16,384), to see where the tail's extra time goes.
# Usage: OUT=dir lab/run_session_e.sh   (carry .carry)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip show jax_twell > /dev/null 2>&1 || python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s INT 90 python3 -m pytest -q -rf -n 4 -m gpu tests/test_cuda_train.py -k "union_dx_match_dense or train_gradients or public_op" 2>&1 | tail -4
for fam in uniform tail; do
  timeout 100 python3 lab/timeline.py --train --rule auto --m 16384 --family $fam --out "$OUT/timeline_train_$fam.json" 2>&1 | grep -v "^WARNING" | tail -24
done
