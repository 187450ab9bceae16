#!/usr/bin/env bash
# One device call: the two CPU-tested branches of the speed issue against main, and GPU
# traces of the tail family's default calls (where their time above the uniform rows goes).
#   1. lab/tiles_checks_ab.sh on ROWS (the TwELL path's checks on its sparse side; its GPU tests)
#   2. lab/timeline.py on the tail family, inference and training step, M=16,384
#   3. lab/scatter_ab.py on AB_ROWS (the training op's backed-up rows emptied in each branch)
# Usage: OUT=dir lab/run_session_l.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
ROWS=${ROWS:-16384:4096:11008:1.0:uniform:infer,16384:4096:11008:0.005:uniform:infer} AB_SECONDS=${AB_SECONDS:-70} \
  TEST_SECONDS=${TEST_SECONDS:-120} OUT=$OUT bash lab/tiles_checks_ab.sh
for mode in infer train; do
  timeout ${TL_SECONDS:-60} python3 lab/timeline.py --rule auto --kernel auto --family tail --m 16384 --calls 4 \
    $([ $mode = train ] && echo --train) --out "$OUT/timeline_${mode}_tail.json" 2>&1 | grep -v "^WARNING" | tail -22
done
for fd in ${AB_ROWS-tail:0.005}; do
  timeout ${SAB_SECONDS:-95} python3 lab/scatter_ab.py --family ${fd%%:*} --density ${fd##*:} \
    --out "$OUT/scatter_ab_${fd%%:*}_${fd##*:}.json" 2>&1 | grep -v "^WARNING" | tail -1 | cut -c1-700
done
