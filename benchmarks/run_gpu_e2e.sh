#!/usr/bin/env bash
# Whole-model figures on one GPU (docs/status.md, "Whole models"): train a sparse model of a
# paper shape with the L1 recipe until its FFNs are sparse, train a dense-ReLU model of the
# same shape on the same tokens, then `jax-twell bench` the sparse checkpoint against SwiGLU
# and dense-ReLU models of its shape in one process.
#
# Usage: STAGES="corpus sparse relu bench stats" benchmarks/run_gpu_e2e.sh
#   STAGES   any of: corpus (gather the training text and train the BPE once, below), sparse
#            (train the sparse model), relu (train the dense-ReLU baseline on the same tokens:
#            same data, tokenizer, seed, batches and schedule, no L1), bench (the benchmark of
#            the sparse run), stats (print both runs' last metrics and held-out CE),
#            activations (the sparse run's FFN inputs and weights at its first, middle and
#            last layer on ACT_TOKENS held-out tokens, default 16,384, by
#            benchmarks/trained_activations.py, then benchmarks/bench_floor.py on them: the
#            default calls against XLA, inference and training step, and the published
#            kernels on the same operands where ANCHOR names their folder); default: the
#            first five
#   PRESET   model shape (default 0.5b); STEPS, BATCH, SEQ, LR, WARMUP, L1: the recipe
#            (defaults below: 1,400 steps of 16 x 2,048 tokens at L1 2e-4, ten times the
#            paper's 2e-5, so that the FFNs pass 99% sparsity in about five minutes on one
#            H200; L1 1e-3 left 0.05% active and up to 60% of the neurons dead);
#            L1_TARGET: the layers' active-fraction ceiling (default 0.005: a layer above
#            it gets a heavier L1 term; at L1 2e-4 alone the last layer stayed at 1.8%)
#   RUNS     where the runs go (default runs/e2e); OUT: where the JSON and PNG go
#   TRAIN_ARGS  key=value overrides of both training runs (default: dead_reinit=true)
#   CORPUS   data.source of both runs. Default: what the corpus stage gathered, if it ran:
#            the standard library plus the `.py` sources of the installed Python packages
#            (files of at most 500 KB, in path order, up to CORPUS_MB, default 100 MB; about
#            29M BPE tokens on a machine with JAX and PyTorch). The standard library alone
#            (the preset's default) is learnt by heart by a 0.5b model within 1,400 steps,
#            which leaves its held-out cross-entropy meaningless.
#   TOKENIZER  data.tokenizer of both runs (default: the corpus stage's tokenizer.json, if
#            it ran; else each run trains its own BPE on its training split)
#   BENCH_ARGS  extra `jax-twell bench` options
#   GROW     a deeper preset of the same widths (e.g. 1.5b): the stages grow (`jax-twell grow`
#            from the sparse run into $RUNS/$GROW-grown: quiet copies, so every FFN sees its
#            trained layer's activations and the model computes the sparse run's function;
#            it continues the sparse run's step, optimizer state and layer sides;
#            GROW_STEPS > 0 fine-tunes it that many more steps under the same recipe at
#            peak learning rate GROW_LR, default 0 and 3e-4) and bench-grown (its
#            benchmark, written as bench_${GROW}_grown.json: a grown model's figures, to be
#            labelled so)
#   TRAIN_SECONDS  stop a training stage after this many seconds (SIGTERM: the run saves a
#            checkpoint and the script exits 143); RESUME=1 continues the stage's run from
#            its newest checkpoint instead of starting afresh. Together they split a long
#            training run over several shorter jobs.
# The training runs record their own steps, tokens, per-layer sparsity and max non-zeros a
# token (metrics.jsonl); the bench JSON records the commit it measured.
set -uo pipefail
PRESET=${PRESET:-0.5b}
STEPS=${STEPS:-1400} BATCH=${BATCH:-16} SEQ=${SEQ:-2048}
LR=${LR:-1e-3} WARMUP=${WARMUP:-60} L1=${L1:-2e-4} L1_TARGET=${L1_TARGET:-0.005}
RUNS=${RUNS:-runs/e2e} OUT=${OUT:-bench}
STAGES=${STAGES:-corpus sparse relu bench stats}
CORPUS_MB=${CORPUS_MB:-100}
GROW=${GROW:-} GROW_STEPS=${GROW_STEPS:-0} GROW_LR=${GROW_LR:-3e-4}
mkdir -p "$RUNS" "$OUT"
export PYTHONUNBUFFERED=1
cli() { python3 -m jax_twell.cli "$@"; }
# A training run: afresh, or continued with RESUME=1 (or always, given --resume first);
# stopped after TRAIN_SECONDS if set.
train_run() {
  local mode=--fresh
  [ "${RESUME:-0}" = 1 ] && mode=--resume
  [ "${1:-}" = --resume ] && { mode=--resume; shift; }
  if [ -n "${TRAIN_SECONDS:-}" ]; then
    timeout --preserve-status -s TERM "$TRAIN_SECONDS" python3 -m jax_twell.cli train "$mode" "$@"
  else
    cli train "$mode" "$@"
  fi
}
recipe=(steps=$STEPS batch_size=$BATCH seq_len=$SEQ optim.lr=$LR optim.warmup_steps=$WARMUP
        l1_coef=$L1 l1_target=$L1_TARGET log_every=25 eval_every=$STEPS eval_batches=16 checkpoint_every=$STEPS keep_checkpoints=1
        ${TRAIN_ARGS:-dead_reinit=true})
# The data options, read when a training stage starts (after the corpus stage).
data_args() {
  local corpus=${CORPUS:-} tok=${TOKENIZER:-}
  [ -z "$corpus" ] && [ -d "$RUNS/corpus" ] && corpus="stdlib,$RUNS/corpus"
  [ -z "$tok" ] && [ -f "$RUNS/tok/tokenizer.json" ] && tok="$RUNS/tok/tokenizer.json"
  [ -n "$corpus" ] && echo "data.source=$corpus"
  [ -n "$tok" ] && echo "data.tokenizer=$tok"
  return 0
}
for stage in $STAGES; do
  start=$(date +%s)
  mapfile -t dargs < <(data_args)
  case $stage in
    corpus)
      python3 - "$RUNS/corpus" "$CORPUS_MB" <<'EOF' || exit $?
import pathlib, shutil, sys, sysconfig
out, budget = pathlib.Path(sys.argv[1]), float(sys.argv[2]) * 1e6
shutil.rmtree(out, ignore_errors=True)
total = files = 0
for root in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
    root = pathlib.Path(root)
    for p in sorted(root.rglob("*.py")):
        size = p.stat().st_size if p.is_file() else 0
        if not 0 < size <= 512_000 or "jax_twell" in p.parts:
            continue
        if total + size > budget:
            break
        dst = out / p.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
        total, files = total + size, files + 1
print(f"corpus: {files} files, {total / 1e6:.1f} MB in {out}")
EOF
      rm -rf "$RUNS/tok"
      python3 - "$PRESET" "stdlib,$RUNS/corpus" "$RUNS/tok" <<'EOF' || exit $?
import dataclasses, sys
from jax_twell.train import data
from jax_twell.train.config import PRESETS
cfg = PRESETS[sys.argv[1]]
if cfg.data.tokenizer == "bpe":  # one BPE for both runs; byte-level presets need none
    corpus = data.load_corpus(dataclasses.replace(cfg.data, source=sys.argv[2]), sys.argv[3], cfg.model.vocab_size)
    print(f"{corpus.description}: {len(corpus.train):,} training and {len(corpus.eval):,} held-out tokens")
EOF
      ;;
    sparse) train_run --preset "$PRESET" workdir="$RUNS/$PRESET-sparse" "${recipe[@]}" "${dargs[@]}" || exit $? ;;
    relu)   train_run --preset "$PRESET" workdir="$RUNS/$PRESET-relu" "${recipe[@]}" "${dargs[@]}" model.ffn=dense_relu l1_coef=0 || exit $? ;;
    activations)
      rm -rf "$RUNS/activations"
      python3 benchmarks/trained_activations.py --workdir "$RUNS/$PRESET-sparse" --out-dir "$RUNS/activations" \
        --tokens "${ACT_TOKENS:-16384}" || exit $?
      cp "$RUNS/activations"/*.json "$OUT/"
      python3 benchmarks/bench_floor.py --configs '' --npz "$RUNS/activations"/*.npz ${ANCHOR:+--anchor "$ANCHOR"} \
        --out "$OUT/floor_trained_$PRESET.json"
      echo "bench_floor rc=$? (1: a row below the floor or one that failed)"
      ;;
    bench)  cli bench --workdir "$RUNS/$PRESET-sparse" --out "$OUT/bench_$PRESET.json" ${BENCH_ARGS:-} || exit $? ;;
    grow)
      [ -n "$GROW" ] || { echo "the grow stage needs GROW=<preset>" >&2; exit 2; }
      if [ "${RESUME:-0}" != 1 ]; then
        rm -rf "$RUNS/$GROW-grown"
        tune=()
        # the grown run continues the sparse run's step and schedule: GROW_STEPS more steps
        [ "$GROW_STEPS" -gt 0 ] && tune=(steps=$((STEPS + GROW_STEPS)) optim.lr=$GROW_LR \
          checkpoint_every=$GROW_STEPS eval_every=$GROW_STEPS)
        cli grow --from "$RUNS/$PRESET-sparse" --preset "$GROW" --workdir "$RUNS/$GROW-grown" "${tune[@]}" || exit $?
        cp "$RUNS/$GROW-grown/grow.json" "$OUT/grow_$GROW.json"
      fi
      if [ "$GROW_STEPS" -gt 0 ]; then train_run --resume workdir="$RUNS/$GROW-grown" || exit $?; fi
      ;;
    bench-grown)
      [ -n "$GROW" ] || { echo "the bench-grown stage needs GROW=<preset>" >&2; exit 2; }
      cli bench --workdir "$RUNS/$GROW-grown" --out "$OUT/bench_${GROW}_grown.json" ${BENCH_ARGS:-} || exit $? ;;
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
