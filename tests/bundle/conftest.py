"""Fixtures for bundle tests: a real engine API (podman's Docker-compatible service on a unix
socket, storage in a tmp dir), a small image built in the test from a local busybox base, and a
tiny stack lock with one real wheel. Helpers live in bundle_helpers.py.

Podman flags are the ones found working on the CI machine kind (docs/environment.md): vfs storage,
runc (crun refuses hybrid cgroups), cgroupfs, and `default_ulimits = []` (no CAP_SYS_RESOURCE).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from bundle_helpers import (
    BASE_IMAGE,
    TEST_IMAGE,
    Engine,
    _busybox_rootfs_tar,
    _podman_base,
    _podman_env,
    make_wheel,
)


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (CI installs it: apt-get install podman runc busybox-static)")
    import docker

    root = tmp_path_factory.mktemp("podman")
    for d in ("storage", "run", "libpod", "tmp"):
        (root / d).mkdir()
    (root / "containers.conf").write_text('[containers]\ndefault_ulimits = []\nnetns = "host"\n')
    env = _podman_env(root)
    base_tar = root / "base.tar"
    base_tar.write_bytes(_busybox_rootfs_tar())
    imp = subprocess.run([*_podman_base(root), "import", str(base_tar), BASE_IMAGE],
                         capture_output=True, text=True, timeout=120, env=env)
    assert imp.returncode == 0, imp.stderr
    sock = root / "api.sock"
    log = open(root / "service.log", "wb")
    proc = subprocess.Popen(
        [*_podman_base(root), "system", "service", "--time=900", f"unix://{sock}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"unix://{sock}"
    client = None
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"podman system service exited {proc.returncode}: {(root / 'service.log').read_text()[-2000:]}")
            if sock.exists():
                try:
                    client = docker.DockerClient(base_url=url, timeout=300)
                    client.version()
                    break
                except docker.errors.DockerException:
                    client = None
            time.sleep(0.2)
        assert client is not None, "podman API socket did not come up within 60 s"
        yield Engine(url, client, root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="session")
def built_image(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small image built through the engine API (FROM the local busybox base, one RUN)."""
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "Containerfile").write_text(
        f"FROM {BASE_IMAGE}\nRUN echo built-for-bundle-test > /built.txt\nLABEL org.v4flash.test=bundle\n"
    )
    image, _logs = engine.client.images.build(path=str(ctx), dockerfile="Containerfile", tag=TEST_IMAGE, rm=True)
    return str(image.id)


@pytest.fixture
def tiny_lock(tmp_path: Path) -> tuple[Path, Path]:
    """(stack.lock with one hash-pinned package, dir holding that wheel plus an unrelated file)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = make_wheel(wheels)
    (wheels / "README.txt").write_text("not a wheel\n")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    lock = tmp_path / "stack.lock"
    lock.write_text(
        "# python: 3.11\n# generated-by: tests/bundle\n"
        f"v4tinypkg==0.1 \\\n    --hash=sha256:{digest}\n"
    )
    return lock, wheels


