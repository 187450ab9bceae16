#!/usr/bin/env bash
# One device call: the inference rows of issue 43 with the published kernels on the same
# operands, then GPU traces of the dense-side loss (d=4,096 fully active) and of the
# training step (uniform and heavy-tailed rows). Usage: OUT=dir lab/run_session_b.sh
# (carry .carry and .anchor)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip show jax_twell > /dev/null 2>&1 || python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
S=2048:5632
timeout 300 python3 benchmarks/bench_floor.py --modes infer --configs 2048:$S:0.005:uniform,16384:$S:0.005:uniform,65536:$S:0.005:uniform,16384:$S:0.005:tail,16384:$S:0.005:lognormal,16384:4096:11008:1.0:uniform \
  --anchor .anchor --anchor-seconds 150 --out "$OUT/infer_main.json" 2>&1 | grep -v "^WARNING" | tail -25
echo "infer rc=${PIPESTATUS[0]}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 80 python3 lab/timeline.py --rule auto --kernel auto --m 16384 --d 4096 --f 11008 --density 1.0 --out "$OUT/timeline_d4096_full.json" 2>&1 | grep -v "^WARNING" | tail -22
for p in uniform heavy; do
  timeout 80 python3 lab/timeline.py --train --rule auto --m 16384 --pattern $p --out "$OUT/timeline_train_$p.json" 2>&1 | grep -v "^WARNING" | tail -22
done
