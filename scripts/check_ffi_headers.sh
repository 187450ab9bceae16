#!/usr/bin/env bash
# Compiles the CUDA library and the CPU module against the XLA FFI headers of several jaxlib releases, so a
# header change in a new jaxlib fails here and not in a user's install. No GPU is needed:
# only nvcc, cmake, ninja and network access to the package index.
#
#   scripts/check_ffi_headers.sh                 # the oldest supported jaxlib and the newest
#   scripts/check_ffi_headers.sh 0.11.2 latest   # any list of versions ("latest" resolves)
#
# Each version's headers come from its manylinux x86_64 wheel (only the jaxlib/include
# folder is kept); CUTLASS from the nvidia-cutlass wheel the build requires, or CUTLASS_DIR.
# The library is configured and built by the project's own CMake files (the install's
# flags), one build folder per version under build/ffi-headers/, the builds side by side
# and sharing the cores. Prints one line per version; a failure prints the compiler's log.
set -euo pipefail
cd "$(dirname "$0")/.."

work=$PWD/build/ffi-headers
mkdir -p "$work"
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
jobs=$(nproc)

# The oldest supported jaxlib and the CUTLASS requirement, as pyproject.toml's build
# requirements state them (the isolated build compiles against that oldest jaxlib).
oldest=$(sed -n 's/.*"jaxlib>=\([0-9.]*\).*/\1/p' pyproject.toml | head -1)
cutlass_req=$(sed -n 's/.*"\(nvidia-cutlass[^"]*\)".*/\1/p' pyproject.toml | head -1)
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("$oldest" latest)

# Wheels of any glibc level: pip matches --platform tags exactly.
platforms=()
for glibc in $(seq 17 40); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done

download() {  # download REQUIREMENT FOLDER: the wheel of REQUIREMENT for CPython 3.13, x86_64
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.13 \
    "${platforms[@]}" --dest "$2" "$1" >/dev/null
}

# jaxlib/include of version $1 (or the newest) under $work; prints the include folder.
jaxlib_headers() {
  local req=jaxlib tmp whl version
  [ "$1" = latest ] || req="jaxlib==$1"
  if [ "$1" != latest ] && [ -f "$work/jaxlib-$1/jaxlib/include/xla/ffi/api/ffi.h" ]; then
    echo "$work/jaxlib-$1/jaxlib/include"
    return
  fi
  tmp=$(mktemp -d "$work/download.XXXXXX")
  download "$req" "$tmp"
  whl=$(ls "$tmp"/jaxlib-*.whl)
  version=$(basename "$whl" | cut -d- -f2)
  rm -rf "$work/jaxlib-$version"
  unzip -q "$whl" 'jaxlib/include/*' -d "$work/jaxlib-$version"
  rm -rf "$tmp"
  echo "$work/jaxlib-$version/jaxlib/include"
}

if [ -z "${CUTLASS_DIR:-}" ]; then
  CUTLASS_DIR=$work/cutlass/cutlass_library/source
  if [ ! -f "$CUTLASS_DIR/include/cutlass/cutlass.h" ]; then
    tmp=$(mktemp -d "$work/download.XXXXXX")
    "$python" -m pip download --quiet --no-deps --dest "$tmp" "$cutlass_req" >/dev/null
    rm -rf "$work/cutlass"
    unzip -q "$tmp"/nvidia_cutlass-*.whl 'cutlass_library/source/include/*' \
      'cutlass_library/source/tools/util/include/*' -d "$work/cutlass"
    rm -rf "$tmp"
  fi
fi
CUTLASS_DIR=$(cd "$CUTLASS_DIR" && pwd)

# nanobind for the CPU module (cpu/), which is compiled against the same headers: the
# build requirement's wheel, unpacked under $work where the Python running the check lacks it.
nanobind_path=""
if ! "$python" -c "import nanobind" 2>/dev/null; then
  nanobind_req=$(sed -n 's/.*"\(nanobind[^"]*\)".*/\1/p' pyproject.toml | head -1)
  if [ ! -d "$work/nanobind/nanobind" ]; then
    tmp=$(mktemp -d "$work/download.XXXXXX")
    "$python" -m pip download --quiet --no-deps --dest "$tmp" "$nanobind_req" >/dev/null
    rm -rf "$work/nanobind"
    unzip -q "$tmp"/nanobind-*.whl -d "$work/nanobind"
    rm -rf "$tmp"
  fi
  nanobind_path=$work/nanobind
fi

includes=()
for v in "${versions[@]}"; do
  include=$(jaxlib_headers "$v")
  [[ " ${includes[*]} " == *" $include "* ]] || includes+=("$include")
done

build() {  # build INCLUDE_DIR JOBS: configure and build the library in its own folder
  local include=$1 name dir
  name=$(basename "$(dirname "$(dirname "$include")")")  # jaxlib-X.Y.Z
  dir=$work/build-$name
  {
    PYTHONPATH="$nanobind_path${PYTHONPATH:+:$PYTHONPATH}" \
      cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_TWELL_CUDA=ON \
      -DXLA_FFI_INCLUDE_DIR="$include" -DCUTLASS_DIR="$CUTLASS_DIR" \
      -DPython_EXECUTABLE="$python" &&
      cmake --build "$dir" -j "$2"
  } >"$work/$name.log" 2>&1
}

# One build per header version, side by side: the cores are split between them.
per_build=$(((jobs + ${#includes[@]} - 1) / ${#includes[@]}))
declare -A pids
start=$SECONDS
for include in "${includes[@]}"; do
  build "$include" "$per_build" &
  pids[$include]=$!
done
status=0
for include in "${includes[@]}"; do
  name=$(basename "$(dirname "$(dirname "$include")")")
  api=$(sed -n 's/#define XLA_FFI_API_M[AJINOR]* \([0-9]*\)/\1/p' "$include/xla/ffi/api/c_api.h" | paste -sd.)
  if wait "${pids[$include]}"; then
    echo "ok      $name (XLA FFI API $api)"
  else
    echo "FAILED  $name (XLA FFI API $api); its build log, $work/$name.log, ends:"
    grep -v -e '^ptxas info' -e '^$' "$work/$name.log" | tail -40
    status=1
  fi
done
echo "compiled against ${#includes[@]} header versions in $((SECONDS - start)) s"
exit $status
