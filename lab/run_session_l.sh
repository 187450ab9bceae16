#!/usr/bin/env bash
# One device call: GPU traces of the tail family's default calls (where their time above the
# uniform rows goes), then the scatter branch against main on the rows it was not measured on.
#   1. lab/timeline.py on the tail family, inference and training step, M=16,384
#   2. lab/scatter_ab.py on AB_ROWS (the training op's backed-up rows emptied in each branch;
#      the tail family measured no change at d161775, the fully active dense side not yet)
# (The TwELL checks' A/B that ran first here at d161775 was merged as 6c3ad80; its script is
# in the history at e9d0a51.)
# Usage: OUT=dir lab/run_session_l.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for mode in infer train; do
  timeout ${TL_SECONDS:-60} python3 lab/timeline.py --rule auto --kernel auto --family tail --m 16384 --calls 4 \
    $([ $mode = train ] && echo --train) --out "$OUT/timeline_${mode}_tail.json" 2>&1 | grep -v "^WARNING" | tail -22
done
for fd in ${AB_ROWS-uniform:1.0}; do
  timeout ${SAB_SECONDS:-95} python3 lab/scatter_ab.py --family ${fd%%:*} --density ${fd##*:} \
    --out "$OUT/scatter_ab_${fd%%:*}_${fd##*:}.json" 2>&1 | grep -v "^WARNING" | tail -1 | cut -c1-700
done
