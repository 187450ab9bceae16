#!/usr/bin/env bash
# One short device call: tree B (.carry/b: one conditional a side in the training op and in
# the inference TILES path, more backup buckets) against tree A (.carry/a, the base commit)
# on issue 43's training rows and one TILES row, then the published hybrid op on the same
# operands as far as the time allows. Usage: OUT=dir lab/run_session_c.sh (carry .carry, .anchor)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
T=16384:2048:5632
C=$T:0.005:tail:train,$T:0.005:uniform:train,16384:4096:11008:0.005:uniform:infer
for tree in b a; do
  timeout ${TREE_SECONDS:-110} python3 benchmarks/run_tree.py .carry/$tree benchmarks/bench_floor.py --configs $C \
    --out "$OUT/floor_$tree.json" 2>&1 | grep -v "^WARNING" | tail -6
  echo "$tree rc=${PIPESTATUS[0]}"
done
timeout ${ANCHOR_SECONDS:-150} python3 benchmarks/run_tree.py .carry/a benchmarks/bench_floor.py --configs $T:0.005:uniform:train,$T:0.005:tail:train \
  --anchor .anchor --anchor-seconds 140 --out "$OUT/floor_a_public.json" 2>&1 | grep -v "^WARNING" | tail -6
echo "anchor rc=${PIPESTATUS[0]}"
