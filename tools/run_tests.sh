#!/usr/bin/env bash
# `make test`: the CPU suite as two pytest processes running at once.
#
#   tools/run_tests.sh PYTHON [PYTEST_ARGS...]
#
# Why two: the kernel tests (Triton's CPU interpreter, the sm_120 cross-compile) keep one core busy,
# the rest (the hook on the real wheel, podman builds, Slurm daemons, launcher subprocesses, HTTP on
# 127.0.0.1) wait on other processes much of the time; one after the other they took ~30 minutes on a
# 2-core CI machine, side by side about two thirds of that. The two groups share only read-only inputs
# and caches that are locked or written atomically (the pinned wheel is fetched and the sglang layer
# built under an flock, Triton renames its cache entries into place).
#
# The rest streams to the terminal; the kernel group's output follows it, then one summary line. Any
# PYTEST_ARGS that name tests (not starting with '-') run as one pytest over just those.
set -u
PY=${1:?usage: tools/run_tests.sh PYTHON [PYTEST_ARGS...]}
shift
for arg in "$@"; do
  case $arg in -*) ;; *) exec "$PY" -m pytest -m 'not gpu' "$@" ;; esac
done
log=$(mktemp "${TMPDIR:-/tmp}/v4flash-kernel-tests.XXXXXX")
t0=$(date +%s)
# the two heaviest hook files go with the kernels: side by side the two groups then end within ~1 minute
HEAVY_HOOK="tests/hook/test_hook_verify.py tests/hook/test_hook_moe.py"
# shellcheck disable=SC2086
"$PY" -m pytest -m 'not gpu' "$@" tests/kernels $HEAVY_HOOK >"$log" 2>&1 &
kpid=$!
# never leave the kernel group running if this script is stopped
trap 'kill "$kpid" 2>/dev/null; rm -f "$log"; exit 130' INT TERM
"$PY" -m pytest -m 'not gpu' "$@" --ignore=tests/kernels $(printf -- '--ignore=%s ' $HEAVY_HOOK) tests
rest=$?
wait "$kpid"
kern=$?
trap - INT TERM
echo
echo "================ tests/kernels + $HEAVY_HOOK (ran alongside the above) ================"
cat "$log"
rm -f "$log"
echo "suite: tests/kernels exit $kern, the rest exit $rest, $(( $(date +%s) - t0 )) s wall"
[ "$rest" -eq 0 ] && [ "$kern" -eq 0 ]
