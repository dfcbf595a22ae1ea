"""Fixtures for the real-Slurm tests: one two-node localhost cluster per session (slurm_harness.py).

The cluster is never skipped: without the Debian packages the fixture FAILS with the install line,
because a skipped cluster test would read as a passing Slurm integration on CI.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.slurm_harness import INSTALL_HINT, SlurmCluster, SlurmHarnessError, missing_binaries


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A started cluster (nodes n1, n2 idle); stopped at session end, also when tests failed."""
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm/munge not installed (missing {', '.join(missing)}): {INSTALL_HINT}")
    workdir = tmp_path_factory.mktemp("slurm")
    if len(str(workdir)) > 60:  # slurmstepd's unix sockets live under it (108-byte sun_path)
        workdir = Path(tempfile.mkdtemp(prefix="v4f-slurm-", dir="/tmp"))
    try:
        cluster = SlurmCluster.start(workdir)
    except SlurmHarnessError as e:
        pytest.fail(f"could not start the test Slurm cluster in {workdir}:\n{e}")
    try:
        yield cluster
    finally:
        cluster.stop()
    left = cluster.leftovers()
    if left:
        pytest.fail(f"Slurm harness left processes behind after stop(): {left}")
