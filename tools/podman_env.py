#!/usr/bin/env python3
"""Rootful podman without a Docker engine, in a private state dir: the CI image build and run.

Why the flags (shared/reference/ci-recipes.md §1): hybrid cgroups make crun refuse to start
containers (runc works); podman's default rlimits exceed what the CI kernel lets us set; no
container registry resolves, so the base is a local debootstrap tarball; pip inside RUN needs the
host CA bundle behind the TLS-intercepting proxy (passed as the build secret `extra_ca`, never
baked in); and the network is always the host's (never podman's bridge).

    tools/podman_env.py base  [--state DIR]                       import the debootstrap base
    tools/podman_env.py build [--state DIR] --target ci|full -t TAG [-- extra podman build args]
    tools/podman_env.py podman [--state DIR] -- ARGS...           run podman with this state
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_TAG = "localhost/v4flash-base:bookworm"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def podman_env(state: Path) -> dict[str, str]:
    """Environment that points podman at private conf/storage under `state` (created if needed)."""
    state.mkdir(parents=True, exist_ok=True)
    for sub in ("tmp", "run", "storage", "libpod"):
        (state / sub).mkdir(exist_ok=True)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = hard if hard != resource.RLIM_INFINITY else 65536
    (state / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\nrunroot = "{state}/run"\ngraphroot = "{state}/storage"\n'
    )
    (state / "containers.conf").write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
        'netns = "host"\n'
        "[engine]\n"
        'runtime = "runc"\n'
        f'tmp_dir = "{state}/libpod"\n'
        'events_logger = "file"\n'
    )
    env = dict(os.environ)
    env.update(
        CONTAINERS_CONF=str(state / "containers.conf"),
        CONTAINERS_STORAGE_CONF=str(state / "storage.conf"),
        TMPDIR=str(state / "tmp"),
    )
    return env


def podman(env: dict[str, str], *args: str, timeout: float = 600, check: bool = True,
           capture: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], env=env, text=True, timeout=timeout,
                          capture_output=capture)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} failed ({proc.returncode}):\n"
                           f"{(proc.stderr or '')[-4000:]}")
    return proc


def apt_mirror() -> str:
    src = Path("/etc/apt/sources.list.d/debian.sources")
    if src.is_file():
        for line in src.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    return "http://deb.debian.org/debian"


def debootstrap_tar(out: Path, suite: str = "bookworm", timeout: float = 900) -> Path:
    """A minbase rootfs tarball (cached: reused when `out` exists)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", suite, str(rootfs), apt_mirror()],
                       check=True, capture_output=True, timeout=timeout)
        subprocess.run(["chroot", str(rootfs), "apt-get", "clean"], check=True, timeout=60)
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
        part = out.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "--exclude=./dev/*", "--exclude=./proc/*",
                        "--exclude=./sys/*", "-cf", str(part), "."], check=True, timeout=300)
        part.rename(out)
    return out


def ensure_base(env: dict[str, str], tarball: Path, tag: str = BASE_TAG) -> str:
    if podman(env, "image", "exists", tag, check=False).returncode != 0:
        debootstrap_tar(tarball)
        podman(env, "import", str(tarball), tag)
    return tag


def lock_sha256() -> str:
    return hashlib.sha256((ROOT / "stack.lock").read_bytes()).hexdigest()


def version() -> str:
    sys.path.insert(0, str(ROOT / "launcher"))
    from v4flash_pd import __version__

    return __version__


def revision() -> str:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def build_args(env: dict[str, str], target: str, tag: str, base: str, extra: list[str],
               context: Path = ROOT) -> list[str]:
    """The podman build argv for the real docker/Dockerfile (chroot isolation, host network)."""
    args = [
        "build", "--isolation", "chroot", "--network", "host", "--pull=never", "--layers", "--format", "docker",
        "-f", str(context / "docker/Dockerfile"), "--target", target, "-t", tag,
        "--build-arg", f"BASE_IMAGE={base}",
        "--build-arg", f"VERSION={version()}",
        "--build-arg", f"REVISION={revision()}",
        "--build-arg", f"LOCK_SHA256={lock_sha256()}",
    ]
    if HOST_CA.is_file():
        args += ["--secret", f"id=extra_ca,src={HOST_CA}"]
    return args + extra + [str(context)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["base", "build", "podman"])
    ap.add_argument("--state", type=Path, default=ROOT / ".cache/podman")
    ap.add_argument("--base-tar", type=Path, default=ROOT / ".cache/env/bookworm-minbase.tar")
    ap.add_argument("--target", default="ci")
    ap.add_argument("-t", "--tag", default="localhost/v4flash-pd:ci")
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    env = podman_env(args.state.resolve())
    if args.command == "podman":
        return subprocess.call(["podman", *rest], env=env)
    base = ensure_base(env, args.base_tar.resolve())
    if args.command == "base":
        print(base)
        return 0
    return subprocess.call(["podman", *build_args(env, args.target, args.tag, base, rest)], env=env)


if __name__ == "__main__":
    sys.exit(main())
