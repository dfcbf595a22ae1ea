#!/bin/sh
# finalize.sh: install the v4flash-pd wheel built in the `wheel` stage and write the SBOM.
#
# Our wheel is built from the checkout, so its hash cannot be in stack.lock: it is recorded here,
# at image build, next to the lock's hash and `pip freeze`, in /usr/share/v4flash/stack-sbom.txt.
set -eu
whl="$(ls /tmp/dist/v4flash_pd-*.whl)"
pip install --no-cache-dir --no-deps --no-index --no-compile "$whl"
python -c 'import v4flash_pd.stacklock as s; s.load_lock()' >/dev/null
mkdir -p /usr/share/v4flash /var/lib/v4flash/runs /var/cache/v4flash
{
    echo "# v4flash-pd image SBOM (pip freeze of /opt/v4flash/venv + our wheel's sha256)"
    echo "stack.lock sha256: $(sha256sum /opt/v4flash/stack.lock | cut -d' ' -f1)"
    echo "v4flash-pd wheel: $(basename "$whl") sha256 $(sha256sum "$whl" | cut -d' ' -f1)"
    echo "python: $(python -c 'import sys; print(sys.version.split()[0])')"
    echo "stack variant: ${STACK_VARIANT:-unknown}"
    pip freeze --all
} > /usr/share/v4flash/stack-sbom.txt
pip check || { echo "error: pip check failed: the installed set is inconsistent" >&2; exit 1; }
