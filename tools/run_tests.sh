#!/usr/bin/env bash
# `make test`: the CPU suite as three pytest processes running at once.
#
#   tools/run_tests.sh PYTHON [PYTEST_ARGS...]
#
# Why three: the kernel tests (Triton's CPU interpreter, the sm_120 cross-compile) keep one core busy;
# the hook tests (subprocesses importing the real wheel) and the system tests (podman image builds, Slurm
# and munge daemons, the bundle's engine), one directory after another, and the rest (launcher
# subprocesses, HTTP on 127.0.0.1) wait on other processes much of the time. One after the other they
# took well over 30 minutes on a 2-core CI machine; as two groups 1,827 s there (2026-12-02); as these
# three about 23 minutes on this project's 2-core dev machine. The groups share only read-only inputs
# and caches that are locked or written atomically (the pinned wheel is fetched and the sglang layer
# built under an flock, Triton renames its cache entries into place), and every test takes its own free
# ports and temp dirs.
#
# The rest streams to the terminal; the other groups' output follows it, then one summary line. Any
# PYTEST_ARGS that name tests (not starting with '-') run as one pytest over just those.
set -u
PY=${1:?usage: tools/run_tests.sh PYTHON [PYTEST_ARGS...]}
shift
for arg in "$@"; do
  case $arg in -*) ;; *) exec "$PY" -m pytest -m 'not gpu' "$@" ;; esac
done
klog=$(mktemp "${TMPDIR:-/tmp}/v4flash-kernel-tests.XXXXXX")
slog=$(mktemp "${TMPDIR:-/tmp}/v4flash-system-tests.XXXXXX")
t0=$(date +%s)
SYSTEM="tests/hook tests/cluster tests/env tests/bundle"
"$PY" -m pytest -m 'not gpu' "$@" tests/kernels >"$klog" 2>&1 &
kpid=$!
# one pytest per directory: their test modules import names from their own conftest.py, which one
# pytest over several such directories resolves to whichever conftest it imported first
(
  st=0
  for d in $SYSTEM; do
    "$PY" -m pytest -m 'not gpu' "$@" "$d" || st=1
  done
  exit $st
) >"$slog" 2>&1 &
spid=$!
# never leave a group running if this script is stopped
trap 'kill "$kpid" "$spid" 2>/dev/null; rm -f "$klog" "$slog"; exit 130' INT TERM
# shellcheck disable=SC2046
"$PY" -m pytest -m 'not gpu' "$@" --ignore=tests/kernels $(printf -- '--ignore=%s ' $SYSTEM) tests
rest=$?
wait "$spid"
sys=$?
wait "$kpid"
kern=$?
trap - INT TERM
echo
echo "================ $SYSTEM (ran alongside the above) ================"
cat "$slog"
echo
echo "================ tests/kernels (ran alongside the above) ================"
cat "$klog"
rm -f "$klog" "$slog"
echo "suite: tests/kernels exit $kern, hook + system tests exit $sys, the rest exit $rest, $(( $(date +%s) - t0 )) s wall"
[ "$rest" -eq 0 ] && [ "$sys" -eq 0 ] && [ "$kern" -eq 0 ]
