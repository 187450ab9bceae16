#!/usr/bin/env bash
# Device calls for the lines of the speed issue at main (no kernel changed since the
# library in .carry/main.so was built).
#   PART=synthetic: the default calls, XLA's dense FFN and the published kernels on the same
#     operands in one run (bench_floor.py --anchor), inference and training rows, then a
#     GPU trace of the default inference call on uniform rows, and lab/scatter_ab.py.
#   PART=trained: the 0.5b preset trained sparse with the L1 recipe (STEPS steps, stopped
#     after TRAIN_SECONDS), its first, middle and last layers' FFN inputs and weights on
#     16,384 held-out tokens, and bench_floor.py on them with the published kernels.
#   PART=grid: bench_floor.py's never-below-dense rows not in PART=synthetic, odd shapes,
#     and a GPU trace of the fully active d=4,096 inference call.
# Usage: OUT=dir PART="trained synthetic" lab/run_session_k.sh   (any of synthetic, trained, grid, in order; or auto)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
T=2048:5632:0.005
run_part() {
case $1 in
  synthetic)
    C=${CONFIGS:-16384:$T:tail:train,16384:$T:uniform:train,16384:$T:lognormal:train,65536:$T:uniform:train,16384:$T:tail:infer,16384:$T:uniform:infer,16384:$T:lognormal:infer,2048:$T:uniform:infer,65536:$T:uniform:infer}
    timeout ${FLOOR_SECONDS:-330} python3 benchmarks/bench_floor.py --configs "$C" --anchor .anchor \
      --out "$OUT/floor_public.json" 2>&1 | grep -v "^WARNING" | tail -40
    [ "${TIMELINE:-1}" = 1 ] && timeout 90 python3 lab/timeline.py --rule auto --kernel auto --m 16384 --calls 6 \
      --out "$OUT/timeline_infer_uniform.json" 2>&1 | grep -v "^WARNING" | tail -25
    # the backed-up rows emptied inside each sparse branch (lab/scatter_ab.py) against main
    for fd in ${AB_ROWS-tail:0.005 uniform:0.005 uniform:1.0}; do
      timeout 100 python3 lab/scatter_ab.py --family ${fd%%:*} --density ${fd##*:} \
        --out "$OUT/scatter_ab_${fd%%:*}_${fd##*:}.json" 2>&1 | grep -v "^WARNING" | tail -1 | cut -c1-700
    done
    ;;
  trained)
    export RUNS=/tmp/e2e
    STAGES=sparse STEPS=${STEPS:-1000} TRAIN_SECONDS=${TRAIN_SECONDS:-300} OUT=$OUT \
      bash benchmarks/run_gpu_e2e.sh 2>&1 | grep -v "^WARNING" | grep -E "step|sparse|active|error|Error|stage" | tail -25
    tail -2 $RUNS/0.5b-sparse/metrics.jsonl | cut -c1-1500
    cp $RUNS/0.5b-sparse/metrics.jsonl "$OUT/metrics_0.5b.jsonl"
    timeout 120 python3 benchmarks/trained_activations.py --workdir $RUNS/0.5b-sparse --out-dir $RUNS/activations \
      --tokens 16384 2>&1 | grep -v "^WARNING" | tail -8
    cp $RUNS/activations/*.json "$OUT/"
    timeout ${NPZ_SECONDS:-240} python3 benchmarks/bench_floor.py --configs '' --npz $RUNS/activations/*.npz \
      --anchor .anchor --out "$OUT/floor_trained_0.5b.json" 2>&1 | grep -v "^WARNING" | tail -14
    ;;
  grid)
    # the never-below-dense rows of bench_floor.py's grid not in PART=synthetic, and odd shapes
    G1=1:$T:uniform:infer,4:$T:uniform:infer,64:$T:uniform:infer,512:$T:uniform:infer,4096:$T:uniform:infer,131072:$T:uniform:infer
    G1=$G1,16384:2048:5632:0.0:uniform:infer,16384:2048:5632:0.02:uniform:infer,16384:2048:5632:0.1:uniform:infer
    G1=$G1,16384:2048:5632:0.5:uniform:infer,16384:2048:5632:1.0:uniform:infer,16384:$T:pareto:infer,16384:$T:full16:infer
    G1=$G1,4096:$T:tail:infer,8192:2048:5632:1.0:uniform:infer,2048:2048:5632:1.0:uniform:infer
    G1=$G1,16384:4096:11008:0.005:uniform:infer,16384:4096:11008:0.005:tail:infer,16384:4096:11008:1.0:uniform:infer
    G1=$G1,16384:1000:2728:0.005:uniform:infer,16384:1000:2728:0.005:tail:infer,8192:512:1408:0.005:lognormal:infer
    G1=$G1,12345:2048:5640:0.005:tail:infer,100000:1536:4104:0.005:uniform:infer,3000:2048:5632:0.005:lognormal:infer
    G2=2048:$T:uniform:train,16384:2048:5632:0.05:uniform:train,16384:2048:5632:1.0:uniform:train
    G2=$G2,16384:4096:11008:0.005:tail:train,16384:1000:2728:0.005:uniform:train,12345:2048:5640:0.005:tail:train
    timeout ${GRID_SECONDS:-300} python3 benchmarks/bench_floor.py --configs "${GRID_CONFIGS:-$G1}" \
      --out "$OUT/floor_grid_infer.json" 2>&1 | grep -v "^WARNING" | tail -40
    timeout ${GRID_TRAIN_SECONDS:-150} python3 benchmarks/bench_floor.py --configs "${GRID_TRAIN_CONFIGS:-$G2}" \
      --out "$OUT/floor_grid_train.json" 2>&1 | grep -v "^WARNING" | tail -12
    timeout 80 python3 lab/timeline.py --rule auto --kernel auto --m 16384 --d 4096 --f 11008 --density 1.0 --calls 4 \
      --out "$OUT/timeline_infer_d4096_full.json" 2>&1 | grep -v "^WARNING" | tail -25
    ;;
esac
}
PARTS=${PART:-synthetic}
if [ "$PARTS" = auto ]; then  # the acceptance card's lines where the card is an H200, else the trained layers
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then PARTS=synthetic; else PARTS=trained; fi
fi
for part in $PARTS; do run_part $part; done
