#!/usr/bin/env bash
# One device call: run named GPU jobs in order, each under its own time limit, and bring back one
# tarball of their logs and JSON ($OUT/results.tgz) plus a summary line per job ($OUT/summary.txt).
#
#   V4FLASH_COMMIT=<sha> bash kernels/scripts/gpu_session.sh JOB[:SECONDS] ...
#
# A job is a function below; a job that fails or times out never stops the next one, so one broken
# kernel cannot cost the session the other measurements. Run from the repository root.
set -u
. kernels/scripts/gpu_setup.sh
R=$OUT/r
mkdir -p "$R"
export V4FLASH_COMMIT=${V4FLASH_COMMIT:-unknown}
WHEEL=${V4FLASH_SGLANG_WHEEL:-}
py() { python3 "$@"; }
pyt() { python3 -m pytest -q -x -p no:cacheprovider -m gpu "$@"; }

job_env() { nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; }
job_t_fp8() { pyt tests/kernels/test_fp8_gemm_gpu.py; }
job_t_mhc() { pyt tests/kernels/test_mhc_gpu.py; }
job_t_topk() { pyt tests/kernels/test_topk_gpu.py; }
job_t_moe() { pyt tests/kernels/test_moe_gpu.py; }
job_t_attn() { pyt tests/kernels/test_attention_gpu.py tests/kernels/test_indexer_gpu.py; }
job_t_allreduce() { pyt tests/kernels/test_allreduce_gpu.py; }
job_t_verify() { pyt tests/kernels/test_verify_shapes_gpu.py; }
job_t_selfcheck() { V4FLASH_SELFCHECK_GPU_JSON=$R/selfcheck_gpu.json python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/kernels/test_selfcheck_gpu.py; }
# The whole GPU suite in one job (every gpu-marked test lives under tests/kernels: tests/test_gpu_suite_layout.py
# checks it), no -x: every failure shows; the per-test outcome and time go to suite.xml. Test files run in
# parallel processes on the one GPU where pytest-xdist is installed (the machine's image has it): most of a
# GPU test's time is Triton compiling on the CPU; no GPU test asserts a time.
par() { python3 -c "import xdist" 2>/dev/null && echo "-n ${V4FLASH_SUITE_WORKERS:-4} --dist loadfile"; }
job_suite() {
  # shellcheck disable=SC2046
  V4FLASH_SELFCHECK_GPU_JSON=$R/selfcheck_gpu.json python3 -m pytest -q -rfE -p no:cacheprovider -m gpu $(par) \
    --durations=30 --junitxml="$R/suite.xml" tests/kernels
}
# named GPU tests only (V4FLASH_TESTS: node ids or files), no -x: a re-run of what a suite run failed or left unrun
job_tests() {
  # shellcheck disable=SC2086,SC2046
  python3 -m pytest -q -rfE -p no:cacheprovider -m gpu $(par) --durations=10 ${V4FLASH_TESTS:?V4FLASH_TESTS}
}
job_b_fp8() { py -m v4flash_bench.fp8_gemm --json "$R/fp8_gemm.json" --md "$R/fp8_gemm.md"; }
job_b_fp8sweep() { py -m v4flash_bench.fp8_sweep --json "$R/fp8_sweep.json"; }
# the row counts the first sweep never reached (M = 16, then 2: the GEMV's second row), against the shipped plan
job_b_fp8gaps() { py -m v4flash_bench.fp8_sweep --m 16,2 --budget-s 110 --json "$R/fp8_sweep_gaps.json"; }
job_b_mhc() { py -m v4flash_bench.mhc --json "$R/mhc.json"; }
job_b_topk() { py -m v4flash_bench.topk --json "$R/topk.json"; }
job_b_indexer() { py -m v4flash_bench.indexer --batches 1,16 --contexts 128K,1M --actual 4K,128K --json "$R/indexer.json"; }
job_b_attnvar() { py kernels/scripts/attention_variants.py --json "$R/attention_variants.json"; }
job_b_idxvar() { py kernels/scripts/indexer_variants.py --json "$R/indexer_variants.json"; }
job_b_moe() { py -m v4flash_bench.moe --json "$R/moe.json" --md "$R/moe.md"; }
job_b_moesweep() { py -m v4flash_bench.moe --quick --json "$R/moe_sweep.json"; }
job_b_moeprefill() { py -m v4flash_bench.moe --prefill --json "$R/moe_prefill.json"; }
job_b_allreduce() { py -m v4flash_bench.allreduce --json "$R/allreduce.json"; }
job_ncu_fp8() {
  for nk in "1536 4096" "1024 4096"; do set -- $nk
    timeout 120 ncu -k regex:gemv -s 3 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \
      --section Occupancy --section WarpStateStats python3 kernels/scripts/ncu_fp8.py --n "$1" --k "$2" --m 1
  done
}
job_step() { py -m v4flash_bench.step --json "$R/step.json" --md "$R/step.md" ${STEP_ARGS:-}; }

export -f py pyt par $(declare -F | awk '{print $3}' | grep '^job_')
export R
for spec in "$@"; do
  name=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=300
  t0=$(date +%s)
  # timeout signals the job's whole process group (pytest and its compile workers included)
  timeout -k 10 "$limit" bash -c "job_$name" >"$R/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s | $(tail -n 1 "$R/$name.log" | cut -c1-200)" | tee -a "$OUT/summary.txt"
done
tar -C "$OUT" -czf "$OUT/results.tgz" r
