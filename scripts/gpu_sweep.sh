#!/usr/bin/env bash
# The L1 sweep of the small preset on one GPU: one training process per L1 value, all at
# once (each small run leaves most of an H200 idle), then the sweep table from their logs.
# Usage: scripts/gpu_sweep.sh [seconds allowed for training] [key=value overrides ...]
# Writes $OUT/sweep_runs.tar.gz (configs and metrics of every run) and $OUT/sweep.log.
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
budget=${1:-480}; shift || true
L1S=${L1S:-"0 2e-5 1e-4 3e-4 1e-3 3e-3"}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf runs/sweep runs/sweep_*.log
mkdir -p runs/sweep
pids=()
for l1 in $L1S; do
  python3 -m jax_twell.cli train --preset small --fresh --sample-tokens 0 workdir=runs/sweep/l1_$l1 l1_coef=$l1 \
    model.dtype=bfloat16 checkpoint_every=1000 "$@" > runs/sweep_$l1.log 2>&1 &
  pids+=($!)
done
( sleep "$budget"; pkill -TERM -f "jax_twell.cli train" ) > /dev/null 2>&1 & watchdog=$!
wait "${pids[@]}"
pkill -P $watchdog 2>/dev/null; kill $watchdog 2>/dev/null
for l1 in $L1S; do echo "== l1=$l1"; tail -4 runs/sweep_$l1.log; done > "$OUT/sweep.log"
tar czf "$OUT/sweep_runs.tar.gz" --exclude=checkpoints runs/sweep runs/sweep_*.log
cat "$OUT/sweep.log"
