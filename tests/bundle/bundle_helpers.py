"""Helpers for bundle tests (conftest.py holds the fixtures): the CLI as a subprocess, podman
command lines, a busybox rootfs tarball, a hand-built wheel, a random model dir, byte flips.

Kept out of conftest.py so test modules import them by a unique name (several test dirs have a
conftest.py, and `from conftest import ...` could pick up another one).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
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


def reseal(bundle: Path, doc: dict) -> None:
    """Write `doc` as MANIFEST.json and re-hash consistently, the way a tamperer would.

    Every `files` entry gets the size and sha256 of what is on disk now (kept as recorded when the
    file is absent), and SHA256SUMS is rewritten to list exactly those files plus MANIFEST.json, so
    only checks beyond "the two lists agree with the bytes" can catch the change.
    """
    for rel, entry in doc["files"].items():
        path = bundle / rel
        if path.is_file():
            entry["size"] = path.stat().st_size
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (bundle / "MANIFEST.json").write_text(json.dumps(doc, indent=1) + "\n")
    digests = {rel: e["sha256"] for rel, e in doc["files"].items()}
    digests["MANIFEST.json"] = hashlib.sha256((bundle / "MANIFEST.json").read_bytes()).hexdigest()
    (bundle / "SHA256SUMS").write_text("".join(f"{digests[p]}  {p}\n" for p in sorted(digests)))


def ssh_key(dest: Path, name: str) -> Path:
    """A fresh unencrypted ed25519 key pair (NAME and NAME.pub) made by the real ssh-keygen."""
    if shutil.which("ssh-keygen") is None:
        pytest.fail("ssh-keygen (Debian package openssh-client) is needed for the bundle signing tests: "
                    "apt-get install openssh-client")
    key = dest / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}@test", "-f", str(key)],
                   check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return key
