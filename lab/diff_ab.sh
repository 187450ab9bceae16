#!/usr/bin/env bash
# A branch's package change against main, tree against tree in one device call: DIFF (a
# unified diff of the branch's package files against main, applied to this tree by `git
# apply`) on and off in ROUNDS alternating rounds (the editable install reads the edited
# sources), each `bench_floor.py` on ROWS; then, with the diff applied, the GPU tests in
# TESTS. Made for the TwELL checks' A/B (6c3ad80), whose script it generalises.
# Usage: OUT=dir DIFF=lab/x.diff ROWS=M:d:f:density:family:mode,... [NPZ="a.npz b.npz"] [MODES=train]
#        [ROUNDS=2] [AB_SECONDS=90] [TESTS="tests/a.py tests/b.py"] [TEST_K="pytest -k expression"]
#        [TEST_SECONDS=150] lab/diff_ab.sh
# (NPZ: operands from files, as bench_floor.py --npz takes them, in MODES; ROWS may then be empty.)
set -uo pipefail
: "${DIFF:?DIFF: the diff of the branch}"
[ -n "${ROWS:-}${NPZ:-}" ] || { echo "ROWS or NPZ: what to run"; exit 2; }
git apply --check "$DIFF" || { echo "$DIFF does not apply to this tree"; exit 2; }
for r in $(seq 1 ${ROUNDS:-2}); do
  for side in main branch; do
    [ $side = branch ] && git apply "$DIFF"
    timeout ${AB_SECONDS:-90} python3 benchmarks/bench_floor.py --configs "${ROWS:-}" ${NPZ:+--npz $NPZ --modes ${MODES:-infer,train}} --out "$OUT/ab_${side}_$r.json" \
      2>&1 | grep -v "^WARNING" | grep -E "^(infer|train|\[)" | cut -c1-220 | sed "s/^/$side $r: /"
    [ $side = branch ] && git apply -R "$DIFF"
  done
done
if [ -n "${TESTS:-}" ]; then
  git apply "$DIFF"
  timeout ${TEST_SECONDS:-150} python3 -m pytest -q -p no:cacheprovider $TESTS ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -6
  git apply -R "$DIFF"
fi
