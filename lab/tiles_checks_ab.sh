#!/usr/bin/env bash
# The TwELL path's operand checks on its sparse side only (branch issue-43-tiles-checks-in-branch,
# its diff in tiles_checks_in_branch.diff) against main, tree against tree in one device call:
# ROUNDS rounds of main then the branch (the editable install reads the edited source), each
# bench_floor.py on ROWS; then the branch's GPU tests of the dispatch and the blocked kernel.
# Usage: OUT=dir [ROWS=M:d:f:density:family:mode,...] [ROUNDS=2] lab/tiles_checks_ab.sh
set -uo pipefail
D=lab/tiles_checks_in_branch.diff
ROWS=${ROWS:-16384:4096:11008:1.0:uniform:infer,16384:4096:11008:0.005:uniform:infer,16384:4096:11008:0.005:tail:infer}
for r in $(seq 1 ${ROUNDS:-2}); do
  for side in main branch; do
    [ $side = branch ] && git apply $D
    timeout ${AB_SECONDS:-100} python3 benchmarks/bench_floor.py --configs "$ROWS" --out "$OUT/tiles_ab_${side}_$r.json" \
      2>&1 | grep -v "^WARNING" | grep -E "^(infer|train|\[)" | tail -6 | cut -c1-220 | sed "s/^/$side $r: /"
    [ $side = branch ] && git apply -R $D
  done
done
git apply $D
timeout ${TEST_SECONDS:-200} python3 -m pytest -q -x tests/test_cuda_dispatch.py tests/test_cuda_ffn_blocked.py 2>&1 | tail -4
git apply -R $D
