#!/usr/bin/env bash
# One device call: issue 43's training rows on tree A (.carry/a, the base commit) with the
# published hybrid op on the same operands, then on tree B (.carry/b: the training op with
# one conditional a side and more backup buckets; the inference TILES path's one switch), each tree's package run by run_tree.py.
# Usage: OUT=dir lab/run_session_a.sh   (carry .carry and .anchor)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
T=16384:2048:5632
timeout 170 python3 benchmarks/run_tree.py .carry/b benchmarks/bench_floor.py --configs $T:0.005:tail:train,$T:0.005:uniform:train,16384:4096:11008:0.005:uniform:infer \
  --out "$OUT/train_b.json" 2>&1 | grep -v "^WARNING" | tail -12
echo "B rc=${PIPESTATUS[0]}"
timeout 270 python3 benchmarks/run_tree.py .carry/a benchmarks/bench_floor.py --configs $T:0.005:tail:train,$T:0.005:uniform:train,16384:4096:11008:0.005:uniform:infer \
  --anchor .anchor --anchor-seconds 150 --out "$OUT/train_a.json" 2>&1 | grep -v "^WARNING" | tail -25
echo "A rc=${PIPESTATUS[0]}"
