#!/usr/bin/env bash
# devshell-venv.sh: materialise the dev shell's venv from stack.lock (called by flake.nix's shellHook).
#
# The same lock and the same hash checking as the image: `uv pip install --require-hashes`, from
# $V4FLASH_WHEELHOUSE (default ./wheelhouse) with --no-index when that directory exists, else from
# the index. The venv remembers the lock's sha256 and is rebuilt only when the lock changes; a
# venv this script did not make (e.g. `make venv`'s test venv) is never touched.
#
#   V4FLASH_PYTHON        interpreter for the venv (the flake passes its python3.12)
#   V4FLASH_VENV          venv path (default .venv)
#   V4FLASH_STACK_SUBSET  install only these locked packages + their deps (e.g. "sglang-router click")
set -euo pipefail
root="${V4FLASH_ROOT:-$PWD}"
venv="${V4FLASH_VENV:-.venv}"
python="${V4FLASH_PYTHON:-python3}"
wheelhouse="${V4FLASH_WHEELHOUSE:-$root/wheelhouse}"
lock="$root/stack.lock"
marker="$venv/.v4flash-stack-lock-sha256"
want="$(sha256sum "$lock" | cut -d' ' -f1)${V4FLASH_STACK_SUBSET:+ subset: $V4FLASH_STACK_SUBSET}"

if [ -e "$venv" ] && [ ! -f "$marker" ]; then
    echo "v4flash: $venv exists but was not made from stack.lock; leaving it alone (set V4FLASH_VENV=.venv-stack)" >&2
    exit 0
fi
if [ "$(cat "$marker" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
echo "v4flash: materialising $venv from stack.lock ($want)" >&2
rm -rf "$venv"
uv venv --quiet --python "$python" "$venv"
req="$lock"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if [ -n "${V4FLASH_STACK_SUBSET:-}" ]; then
    # shellcheck disable=SC2086
    "$python" "$root/tools/lock.py" subset --lock "$lock" $V4FLASH_STACK_SUBSET > "$tmp/subset.txt"
    req="$tmp/subset.txt"
fi
src=()
if [ -d "$wheelhouse" ]; then
    src=(--no-index --find-links "$wheelhouse")
fi
uv pip install --quiet --python "$venv/bin/python" --require-hashes --only-binary :all: "${src[@]}" -r "$req"
uv pip install --quiet --python "$venv/bin/python" --no-deps "${src[@]}" -e "$root"
echo "$want" > "$marker"
