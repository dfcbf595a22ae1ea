#!/bin/sh
# install-locked.sh REQUIREMENTS: pip-install a hash-locked requirements file into the image venv.
#
# Why a script: the same three rules apply to every install step and must not drift apart:
#   1. --require-hashes --only-binary=:all: --no-deps: every file checked against the lock, no sdist
#      builds, and no resolution at all (the lock IS the resolution: `tools/lock.py check` proves it
#      closed, finalize.sh runs `pip check`). Letting pip re-resolve breaks on extras: pip 23/24 in
#      hash mode refuses a dependent's `cuda-tile[tileiras]` although `cuda-tile==1.3.0` is pinned;
#   2. WHEELHOUSE=1 installs from the build context's wheelhouse/ with --no-index (offline rebuild),
#      otherwise from PIP_INDEX_URL (default PyPI);
#   3. an extra CA bundle (TLS-intercepting proxy) comes from the build secret `extra_ca` and is
#      combined with the system bundle in a temp file that is deleted before the layer is committed.
set -eu
req="$1"
ctx="${CTX:-/ctx}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ -s /run/secrets/extra_ca ]; then
    cat /etc/ssl/certs/ca-certificates.crt /run/secrets/extra_ca > "$tmp/ca.pem"
    export PIP_CERT="$tmp/ca.pem"
fi

if [ "${WHEELHOUSE:-0}" = "1" ]; then
    if [ ! -d "$ctx/wheelhouse" ]; then
        echo "error: WHEELHOUSE=1 but the build context has no wheelhouse/ (run: make wheelhouse)" >&2
        exit 2
    fi
    set -- --no-index --find-links "$ctx/wheelhouse"
else
    set -- --index-url "${PIP_INDEX_URL:-https://pypi.org/simple}"
fi

# PIP_NO_CACHE_DIR keeps downloaded wheels out of the layer.
PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    pip install --require-hashes --only-binary=:all: --no-deps --no-compile "$@" -r "$req"
