#!/usr/bin/env bash
# Whole-model figures on one GPU (docs/status.md, "Whole models"): train a sparse model of a
# paper shape with the L1 recipe until its FFNs are sparse, train a dense-ReLU model of the
# same shape on the same tokens, then `jax-twell bench` the sparse checkpoint against SwiGLU
# and dense-ReLU models of its shape in one process.
#
# Usage: STAGES="sparse relu bench" benchmarks/run_gpu_e2e.sh
#   STAGES   any of: sparse (train the sparse model), relu (train the dense-ReLU baseline on
#            the same tokens: same data, seed, batches and schedule, no L1), bench (the benchmark of
#            the sparse run), stats (print both runs' last metrics); default: all four
#   PRESET   model shape (default 0.5b); STEPS, BATCH, SEQ, LR, WARMUP, L1: the recipe
#            (defaults below: 1,400 steps of 16 x 2,048 tokens at L1 2e-4, ten times the
#            paper's 2e-5, so that the FFNs pass 99% sparsity in about five minutes on one
#            H200; L1 1e-3 left 0.05% active and up to 60% of the neurons dead)
#   RUNS     where the runs go (default runs/e2e); OUT: where the JSON and PNG go
#   TRAIN_ARGS  key=value overrides of both training runs (default: dead_reinit=true)
#   CORPUS   data.source of both runs (default: the preset's, the Python standard library);
#            a model of the 0.5b shape memorises the standard library alone within 1,400 steps,
#            so its held-out cross-entropy says little: give it more text (comma-separated
#            folders of text files)
#   TOKENIZER  data.tokenizer of both runs (a tokenizer.json: both runs then read the same
#            tokens without training a BPE each; default: the preset's)
#   BENCH_ARGS  extra `jax-twell bench` options
# The training runs record their own steps, tokens, per-layer sparsity and max non-zeros a
# token (metrics.jsonl); the bench JSON records the commit it measured.
set -uo pipefail
PRESET=${PRESET:-0.5b}
STEPS=${STEPS:-1400} BATCH=${BATCH:-16} SEQ=${SEQ:-2048}
LR=${LR:-1e-3} WARMUP=${WARMUP:-60} L1=${L1:-2e-4}
RUNS=${RUNS:-runs/e2e} OUT=${OUT:-bench}
STAGES=${STAGES:-sparse relu bench stats}
mkdir -p "$RUNS" "$OUT"
export PYTHONUNBUFFERED=1
cli() { python3 -m jax_twell.cli "$@"; }
recipe=(steps=$STEPS batch_size=$BATCH seq_len=$SEQ optim.lr=$LR optim.warmup_steps=$WARMUP
        l1_coef=$L1 log_every=25 eval_every=$STEPS eval_batches=16 checkpoint_every=$STEPS keep_checkpoints=1
        ${TRAIN_ARGS:-dead_reinit=true})
[ -n "${CORPUS:-}" ] && recipe+=("data.source=$CORPUS")
[ -n "${TOKENIZER:-}" ] && recipe+=("data.tokenizer=$TOKENIZER")
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    sparse) cli train --preset "$PRESET" --fresh workdir="$RUNS/$PRESET-sparse" "${recipe[@]}" || exit $? ;;
    relu)   cli train --preset "$PRESET" --fresh workdir="$RUNS/$PRESET-relu" "${recipe[@]}" model.ffn=dense_relu l1_coef=0 || exit $? ;;
    bench)  cli bench --workdir "$RUNS/$PRESET-sparse" --out "$OUT/bench_$PRESET.json" ${BENCH_ARGS:-} || exit $? ;;
    stats)
      python3 - "$RUNS/$PRESET-sparse" "$RUNS/$PRESET-relu" <<'EOF'
import json, sys
for run in sys.argv[1:]:
    try:
        rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    except OSError:
        continue
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    last = train[-1]
    keep = {k: last.get(k) for k in ("step", "ce", "active_fraction", "nnz_mean", "nnz_max", "dead_fraction", "tokens_per_s", "mfu")}
    print(run, json.dumps(keep))
    if evals:
        print(run, "held-out", json.dumps(evals[-1]))
EOF
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  echo "stage $stage: $(( $(date +%s) - start )) s"
done
