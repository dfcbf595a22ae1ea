#!/usr/bin/env bash
# Build the TileLang carry for the GPU machine (which has no package index), here on the dev machine.
#
#   bash kernels/scripts/gpu_carry_tilelang.sh [OUT_DIR]     # default: .gpu/tilelang (git-ignored)
#
# Downloads the pinned wheels of stack.lock (tilelang, apache-tvm-ffi, torch-c-dlpack-ext, z3-solver;
# CPython 3.12, manylinux x86_64: what the GPU machine runs), checks each against stack.lock's hashes,
# unpacks them into one site-packages tree, drops what a CUDA run never reads (ROCm's
# composable_kernel, TVM's and TileLang's C++ sources already compiled into their .so files, the
# libbacktrace sources, z3's Python bindings and binary: only libz3.so is linked, through
# libtvm.so's RUNPATH $ORIGIN/../../z3/lib), and packs it as one xz tarball. The wheels themselves
# (~47 MB + 29 MB) do not fit the 64 MiB the device tool carries next to the repo and the sglang wheel.
# kernels/scripts/gpu_setup.sh unpacks it on the GPU machine.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/.gpu/tilelang}
PY=${PYTHON:-python3}
PINS="tilelang==0.1.8 apache-tvm-ffi==0.1.9 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0"
for pin in $PINS; do
  grep -q "^${pin} " "$ROOT/stack.lock" || { echo "error: $pin is not the version stack.lock pins" >&2; exit 1; }
done
mkdir -p "$OUT/wheels"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT/wheels" $PINS
for w in "$OUT"/wheels/*.whl; do
  h=$(sha256sum "$w" | cut -d' ' -f1)
  grep -q "sha256:$h" "$ROOT/stack.lock" || { echo "error: $(basename "$w") sha256 $h is not in stack.lock" >&2; exit 1; }
done
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
SITE=$STAGE/site
mkdir -p "$SITE/z3/lib"
for w in "$OUT"/wheels/tilelang-*.whl "$OUT"/wheels/apache_tvm_ffi-*.whl "$OUT"/wheels/torch_c_dlpack_ext-*.whl; do
  (cd "$SITE" && unzip -q -o "$w")
done
unzip -q -j -o "$OUT"/wheels/z3_solver-*.whl 'z3/lib/libz3.so' -d "$SITE/z3/lib"
rm -rf "$SITE/tilelang/3rdparty/composable_kernel" "$SITE/tilelang/3rdparty/tvm/src" \
       "$SITE/tvm_ffi/3rdparty/libbacktrace" "$SITE/build_backend.py"
mkdir -p "$SITE/tilelang/3rdparty/composable_kernel/include"  # env.py warns when the folder is missing
find "$SITE/tilelang/src" -mindepth 1 -maxdepth 1 ! -name tl_templates -exec rm -rf {} +
find "$SITE" -name '__pycache__' -prune -exec rm -rf {} +
tar -C "$STAGE" -cf - site | xz -9 -T0 > "$OUT/site.tar.xz.tmp"
mv "$OUT/site.tar.xz.tmp" "$OUT/site.tar.xz"
(cd "$OUT/wheels" && sha256sum *.whl) > "$OUT/SOURCES.sha256"
rm -rf "$OUT/wheels"
ls -l "$OUT"
