#!/usr/bin/env bash
# One device call: which of the half-backup branch's changes slowed the 0.5% training rows.
#   1. lab/diff_ab.sh with lab/half_backup_sizes.diff (the sizes and the dense side's price,
#      the layout still emptied before the choice) against main, ROUNDS rounds, on the
#      log-normal 2.85%, tail 0.5% and uniform 0.5% training rows;
#   2. the same with lab/dense_side_factor.diff (the dense side's price alone; rows
#      uniform 1.5% and 2%, where it moves the choice, and uniform 0.5%, where it must not);
#   3. lab/timeline.py of the default training step on uniform 0.5% rows, main and then the
#      whole branch (lab/half_backup.diff): where its extra time goes (kernels or idle).
# Usage: OUT=dir lab/run_session_n.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
T=16384:2048:5632
mkdir -p "$OUT/sizes" "$OUT/factor"
OUT=$OUT/sizes DIFF=lab/half_backup_sizes.diff ROUNDS=${ROUNDS:-1} AB_SECONDS=${AB_SECONDS:-75} \
  ROWS=$T:0.0285:lognormal:train,$T:0.005:tail:train,$T:0.005:uniform:train bash lab/diff_ab.sh
OUT=$OUT/factor DIFF=lab/dense_side_factor.diff ROUNDS=${ROUNDS:-1} AB_SECONDS=${AB_SECONDS:-75} \
  ROWS=$T:0.015:uniform:train,$T:0.02:uniform:train,$T:0.005:uniform:train bash lab/diff_ab.sh
for side in main branch; do
  [ $side = branch ] && git apply lab/half_backup.diff
  timeout ${TL_SECONDS:-70} python3 lab/timeline.py --rule auto --kernel auto --m 16384 --density 0.005 --calls 4 \
    --train --out "$OUT/timeline_train_uniform_$side.json" 2>&1 | grep -v "^WARNING" | tail -16 | sed "s/^/$side: /"
  [ $side = branch ] && git apply -R lab/half_backup.diff
done
