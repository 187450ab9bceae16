#!/usr/bin/env bash
# One GPU session for lab/graph_cond_probe.cu (the dense path in a CUDA graph's conditional
# node): build it against the cuBLAS that jax's CUDA plugin installed (or $CUBLAS), run it at
# M=2,048 and M=16,384. JSON lines in $OUT/graph_cond_probe.jsonl, printed as well.
# Usage: [CUBLAS=<folder holding include/cublasLt.h and lib/libcublasLt.so*>] [OUT=gpu-logs]
#        lab/run_graph_cond_probe.sh
set -uo pipefail
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"

if [ -z "${CUBLAS:-}" ]; then  # the wheel's folder: nvidia/cu13 (CUDA 13) or nvidia/cublas (CUDA 12)
  for site in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))'); do
    lib=$(ls -d "$site"/nvidia/*/lib/libcublasLt.so* 2>/dev/null | head -1)
    if [ -n "$lib" ]; then CUBLAS=$(dirname "$(dirname "$lib")"); break; fi
  done
fi
if [ -z "${CUBLAS:-}" ] || [ ! -f "$CUBLAS/include/cublasLt.h" ]; then
  echo "no cuBLAS with include/cublasLt.h found: set CUBLAS" >&2
  exit 1
fi
echo "cuBLAS: $CUBLAS"

build() {
  nvcc -O3 -std=c++17 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -I"$CUBLAS/include" -L"$CUBLAS/lib" \
    -Xlinker -rpath="$CUBLAS/lib" lab/graph_cond_probe.cu "$@" -o "$OUT/graph_cond_probe"
}
# The wheel may ship only libcublasLt.so.13 (no unversioned link): then name that file.
if ! build -lcublasLt 2> "$OUT/graph_cond_probe_build.log"; then
  versioned=$(ls "$CUBLAS"/lib/libcublasLt.so.* 2>/dev/null | head -1)
  if [ -z "$versioned" ] || ! build "-l:$(basename "$versioned")" 2>> "$OUT/graph_cond_probe_build.log"; then
    cat "$OUT/graph_cond_probe_build.log"
    exit 1
  fi
fi

: > "$OUT/graph_cond_probe.jsonl"
rc=0
for m in 2048 16384; do
  timeout 240 "$OUT/graph_cond_probe" "$m" | tee -a "$OUT/graph_cond_probe.jsonl"
  status=${PIPESTATUS[0]}
  if [ "$status" != 0 ]; then echo "graph_cond_probe $m: exit $status"; rc=1; fi
done
exit $rc
