"""Fixtures for bundle tests: a real engine API (podman's Docker-compatible service on a unix
socket, storage in a tmp dir), a small image built in the test from a local busybox base, a tiny
stack lock with one real wheel, and a model dir of random shards.

Podman flags are the ones ci-recipes.md §6 found working on this machine kind: vfs storage,
runc (crun refuses hybrid cgroups), cgroupfs, and `default_ulimits = []` (no CAP_SYS_RESOURCE).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST_IMAGE = "localhost/v4flash-bundle-test:1"
BASE_IMAGE = "localhost/v4flash-bundle-base:1"


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (exit codes and stderr exactly as a user sees them)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "v4flash_pd", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO,
    )


@dataclass(frozen=True)
class Engine:
    url: str
    client: object
    root: Path

    def podman(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*_podman_base(self.root), *args], capture_output=True, text=True, timeout=120, env=_podman_env(self.root)
        )


def _podman_base(root: Path) -> list[str]:
    return [
        "podman", "--storage-driver", "vfs", "--root", str(root / "storage"), "--runroot", str(root / "run"),
        "--tmpdir", str(root / "libpod"), "--runtime", "runc", "--cgroup-manager", "cgroupfs",
    ]


def _podman_env(root: Path) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(root / "containers.conf"), "TMPDIR": str(root / "tmp")}


def _busybox_rootfs_tar() -> bytes:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.fail("busybox (Debian package busybox-static) is needed to build the test image's base: "
                    "apt-get install busybox-static")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for d in ("bin", "tmp", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
        tf.add(busybox, "bin/busybox")
        for name in ("sh", "echo", "cat"):
            link = tarfile.TarInfo(f"bin/{name}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tf.addfile(link)
    return buf.getvalue()


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


def make_wheel(dest: Path, name: str = "v4tinypkg", version: str = "0.1") -> Path:
    """A real (tiny) pure-Python wheel pip can install; built by hand so no network is needed."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: v4flash-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record_lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{path},sha256={digest},{len(data)}")
    record_lines.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record_lines) + "\n").encode()
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


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


def make_model(root: Path, shards: int = 3, shard_bytes: int = 3_000_000) -> Path:
    model = root / "model"
    (model / "sub").mkdir(parents=True)
    for i in range(shards):
        (model / f"model-{i:05d}-of-{shards:05d}.safetensors").write_bytes(os.urandom(shard_bytes))
    (model / "config.json").write_text('{"architectures": ["DeepseekV4ForCausalLM"]}\n')
    (model / "sub" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return model


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    pos = len(data) // 2 if offset is None else offset
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
