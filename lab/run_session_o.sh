#!/usr/bin/env bash
# One device call: generate measuring its prompt (branch issue-43-generate-measures,
# lab/generate_measures.diff) against main, on a trained 0.5b model.
#   1. the 0.5b preset trained as run_session_k.sh's trained part does (STEPS steps);
#   2. with the diff applied, the GPU model tests (generate at a decode batch included);
#   3. benchmarks/bench_generate.py on its newest checkpoint at BATCH (default 4, 8 and 64;
#      one row runs the rows kernel either way), 512-token prompt, NEW new tokens, main
#      then the branch, ROUNDS alternations.
# Usage: OUT=dir lab/run_session_o.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_TWELL_CUDA=OFF JAX_TWELL_CUDA_LIB=$PWD/.carry/main.so RUNS=/tmp/e2e
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
STAGES=sparse STEPS=${STEPS:-700} TRAIN_SECONDS=${TRAIN_SECONDS:-200} OUT=$OUT \
  bash benchmarks/run_gpu_e2e.sh 2>&1 | grep -v "^WARNING" | grep -E "^step +[0-9]+ |stage|rror" | tail -3
git apply --check lab/generate_measures.diff || { echo "lab/generate_measures.diff does not apply"; exit 2; }
git apply lab/generate_measures.diff
timeout ${TEST_SECONDS:-120} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_models.py 2>&1 | tail -4
git apply -R lab/generate_measures.diff
for r in $(seq 1 ${ROUNDS:-1}); do
  for side in main branch; do
    [ $side = branch ] && git apply lab/generate_measures.diff
    timeout ${GEN_SECONDS:-120} python3 benchmarks/bench_generate.py --workdir $RUNS/0.5b-sparse --batch ${BATCH:-4,8,64} \
      --prompt 512 --new-tokens ${NEW:-128} --rounds ${GEN_ROUNDS:-5} --out "$OUT/generate_${side}_$r.json" 2>&1 \
      | grep -v "^WARNING" | tail -8 | sed "s/^/$side $r: /"
    [ $side = branch ] && git apply -R lab/generate_measures.diff
  done
done
