# Source at the start of a GPU-machine command, from the repository root:
#
#   . kernels/scripts/gpu_setup.sh && python3 -m v4flash_bench.step --json $OUT/step.json --md $OUT/step.md
#
# (the device call carries `.gpu/tilelang`, built here by kernels/scripts/gpu_carry_tilelang.sh, and the
# pinned sglang wheel under `.cache/wheels`). It unpacks the pinned TileLang 0.1.8 + apache-tvm-ffi +
# torch-c-dlpack-ext + libz3 tree into /tmp, puts it and `kernels` on PYTHONPATH, points TileLang at
# this machine's nvcc, finds the sglang wheel, and says in one line whether TileLang imports (the
# launcher is put on PYTHONPATH too: the self-check's GPU test runs the launcher's driver). It never
# exits the caller's shell: without the carry the step bench still runs and labels the mHC rows as
# estimates, saying why.
V4FLASH_TL_TARBALL=${V4FLASH_TL_TARBALL:-.gpu/tilelang/site.tar.xz}
V4FLASH_TL_SITE=${V4FLASH_TL_SITE:-/tmp/v4flash-tilelang}
if [ -f "$V4FLASH_TL_TARBALL" ]; then
  if [ ! -d "$V4FLASH_TL_SITE/site/tilelang" ]; then
    mkdir -p "$V4FLASH_TL_SITE" && tar -C "$V4FLASH_TL_SITE" -xJf "$V4FLASH_TL_TARBALL"
  fi
  # The carry holds only z3's libz3.so (TileLang's native code links it); without this the bare
  # directory imports as a namespace package and torch.compile takes it for the z3 solver.
  if [ -d "$V4FLASH_TL_SITE/site/z3" ] && [ ! -f "$V4FLASH_TL_SITE/site/z3/__init__.py" ]; then
    echo 'raise ImportError("only libz3.so is carried here (for TileLang), not the z3 Python API")' \
      > "$V4FLASH_TL_SITE/site/z3/__init__.py"
  fi
  export PYTHONPATH="$V4FLASH_TL_SITE/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_setup: no $V4FLASH_TL_TARBALL (build it with kernels/scripts/gpu_carry_tilelang.sh and carry .gpu/tilelang)"
fi
# the launcher too: the self-check's GPU test drives the launcher's driver (v4flash_pd.selfcheck)
export PYTHONPATH="launcher:kernels${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  export CUDA_HOME
fi
if [ -z "${V4FLASH_SGLANG_WHEEL:-}" ]; then
  for w in .cache/wheels/sglang-0.5.13.post1-*.whl .gpu/sglang-srt.zip; do
    if [ -f "$w" ]; then export V4FLASH_SGLANG_WHEEL="$w"; break; fi
  done
fi
export PYTHONUNBUFFERED=1
python3 -c "import tilelang, tvm_ffi; print('gpu_setup: tilelang', tilelang.__version__, 'tvm_ffi', tvm_ffi.__version__)" 2>&1 | tail -1
echo "gpu_setup: CUDA_HOME=${CUDA_HOME:-unset} V4FLASH_SGLANG_WHEEL=${V4FLASH_SGLANG_WHEEL:-unset}"
