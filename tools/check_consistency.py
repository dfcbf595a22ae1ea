#!/usr/bin/env python3
"""Fail when any place that states the serving stack disagrees with stack.toml / stack.lock.

The pins live in one human-edited place (stack.toml); the lock is generated from it. Everything
else either reads them (the Dockerfile installs stack.lock, flake.nix reads both files) or restates
them for a reason (pyproject's `serve` extra, for `pip install v4flash-pd[serve]`). This check
keeps the restatements honest and makes sure the readers really read.

    tools/check_consistency.py [--root DIR] [--no-nix]      exit 1 and list every drift found
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launcher"))
sys.path.insert(0, str(ROOT / "tools"))

from v4flash_pd import stacklock  # noqa: E402

NIX_STUBS = ROOT / "tests/env/fixtures/nix"
# Which python3 a base image's distro ships: the lock's target must be the image's interpreter.
DISTRO_PYTHON = {"ubuntu24.04": "3.12", "ubuntu22.04": "3.10", "ubuntu25.04": "3.13",
                 "bookworm": "3.11", "trixie": "3.13"}
_PIN_RE = re.compile(r"\b([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([0-9][^\s\"',;\\]*)")


def _pins_from_requirements(reqs: list[str]) -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for req in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*==\s*([^\s;]+)\s*", req)
        if m is None:
            out[req] = ("<not an exact pin>", ())
            continue
        extras = tuple(sorted(e.strip() for e in (m.group(2) or "").split(",") if e.strip()))
        out[stacklock.normalize(m.group(1))] = (m.group(3), extras)
    return out


def check_lock(root: Path) -> list[str]:
    from lock import check_pins_in

    toml, lock_path = root / "stack.toml", root / "stack.lock"
    lock = stacklock.load_lock(lock_path)
    problems = [f"stack.lock vs stack.toml: {p}" for p in check_pins_in(lock.packages, toml)]
    want = hashlib.sha256(toml.read_bytes()).hexdigest()
    if lock.header.get("stack-toml-sha256") != want:
        problems.append("stack.lock was not generated from this stack.toml (stack-toml-sha256 differs): run `make lock`")
    tgt = stacklock.load_stack_toml(toml).get("target") or {}
    if lock.header.get("python") != str(dict(tgt).get("python")):
        problems.append(f"stack.lock targets python {lock.header.get('python')}, stack.toml {dict(tgt).get('python')}")
    return problems


def check_dependencies(root: Path) -> list[str]:
    """The launcher's own dependencies (pyproject `dependencies`) that the lock's Python needs are in the
    lock at an allowed version: the image installs our wheel with --no-deps, from the lock alone.
    One for other Pythons only (tomli on 3.10) needs no lock entry."""
    import tomllib
    from packaging.requirements import Requirement

    data = tomllib.loads((root / "pyproject.toml").read_text())
    lock = stacklock.load_lock(root / "stack.lock")
    python = lock.header.get("python", "")
    problems = []
    for text in data.get("project", {}).get("dependencies", []):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"python_version": python,
                                                               "python_full_version": f"{python}.0"}):
            continue
        pkg = lock.get(req.name)
        if pkg is None:
            problems.append(f"pyproject.toml dependency {text!r}: {req.name} is not in stack.lock (python {python})")
        elif not req.specifier.contains(pkg.version, prereleases=True):
            problems.append(f"pyproject.toml dependency {text!r}: stack.lock has {req.name} {pkg.version}")
    return problems


def check_pyproject(root: Path) -> list[str]:
    import tomllib

    data = tomllib.loads((root / "pyproject.toml").read_text())
    serve = data.get("project", {}).get("optional-dependencies", {}).get("serve")
    if serve is None:
        return ["pyproject.toml: no `serve` extra (it must list stack.toml's pins)"]
    have = _pins_from_requirements(list(serve))
    want = _pins_from_requirements(stacklock.pin_requirements(root / "stack.toml"))
    problems = []
    for name, pin in sorted(want.items()):
        if have.get(name) != pin:
            problems.append(f"pyproject.toml serve extra: {name} is {have.get(name, 'missing')}, stack.toml says {pin}")
    for name in sorted(set(have) - set(want)):
        problems.append(f"pyproject.toml serve extra: {name} {have[name]} is not a stack.toml pin")
    # The `kernels` extra (dev installs of the Triton kernels) must pin exactly the lock's versions:
    # another Triton compiles the kernels differently than the configs were measured with.
    kernels = data.get("project", {}).get("optional-dependencies", {}).get("kernels", [])
    locked = stacklock.load_lock(root / "stack.lock").versions()
    for name, (version, _) in sorted(_pins_from_requirements(list(kernels)).items()):
        if version != locked.get(name):
            problems.append(f"pyproject.toml kernels extra: {name} is {version}, "
                            f"stack.lock has {locked.get(name, 'nothing')}")
    return problems


def check_dockerfile(root: Path) -> list[str]:
    text = (root / "docker/Dockerfile").read_text()
    lock = stacklock.load_lock(root / "stack.lock")
    problems = []
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M)
    if base is None or "@sha256:" not in base.group(1):
        problems.append("docker/Dockerfile: the default BASE_IMAGE must be pinned by @sha256 digest")
    else:
        distro = next((d for d in DISTRO_PYTHON if d in base.group(1)), None)
        if distro is None:
            problems.append(f"docker/Dockerfile: cannot tell the python of base {base.group(1)}")
        elif DISTRO_PYTHON[distro] != lock.header.get("python"):
            problems.append(f"docker/Dockerfile: base {distro} ships python {DISTRO_PYTHON[distro]}, "
                            f"stack.lock is for {lock.header.get('python')}")
    if not re.search(r"^COPY stack\.lock\b", text, re.M) or "install-locked.sh /opt/v4flash/stack.lock" not in text:
        problems.append("docker/Dockerfile: must COPY stack.lock and install it with docker/install-locked.sh")
    installer = (root / "docker/install-locked.sh").read_text()
    if "--require-hashes" not in installer:
        problems.append("docker/install-locked.sh: pip must run with --require-hashes")
    for m in _PIN_RE.finditer(text):
        pkg = lock.get(m.group(1))
        if pkg is not None and pkg.version != m.group(3):
            problems.append(f"docker/Dockerfile: pins {m.group(1)}=={m.group(3)}, stack.lock has {pkg.version}")
    return problems


def flake_lib(root: Path, timeout: float = 120) -> dict:
    """Evaluate flake.nix's `lib` with nixpkgs overridden to the offline stub (no network)."""
    with tempfile.TemporaryDirectory() as tmp:
        flake = Path(tmp) / "flake"
        flake.mkdir()
        for name in ("flake.nix", "flake.lock", "stack.toml", "stack.lock"):
            shutil.copy(root / name, flake / name)
        (flake / "launcher/v4flash_pd").mkdir(parents=True)
        shutil.copy(root / "launcher/v4flash_pd/__init__.py", flake / "launcher/v4flash_pd/__init__.py")
        proc = subprocess.run(
            ["nix", "--extra-experimental-features", "nix-command flakes", "--option", "substituters", "",
             "eval", "--json", "--no-write-lock-file",
             "--override-input", "nixpkgs", f"path:{NIX_STUBS / 'stub-nixpkgs'}", f"{flake}#lib"],
            capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"nix eval of flake.nix failed:\n{proc.stderr[-2000:]}")
        return json.loads(proc.stdout)


def check_flake(root: Path, use_nix: bool = True) -> list[str]:
    text = (root / "flake.nix").read_text()
    lock = stacklock.load_lock(root / "stack.lock")
    problems = []
    if "./stack.toml" not in text or "./stack.lock" not in text:
        problems.append("flake.nix: must read ./stack.toml and ./stack.lock (never restate the pins)")
    for m in _PIN_RE.finditer(text):
        pkg = lock.get(m.group(1))
        if pkg is not None and pkg.version != m.group(3):
            problems.append(f"flake.nix: pins {m.group(1)}=={m.group(3)}, stack.lock has {pkg.version}")
    if use_nix:
        lib = flake_lib(root)
        pins = stacklock.load_pins(root / "stack.toml")
        flake_pins = {stacklock.normalize(k): v for k, v in dict(lib.get("stackPins") or {}).items()}
        if flake_pins != pins:
            problems.append(f"flake.nix: lib.stackPins {flake_pins} != stack.toml pins {pins}")
        for name, version in flake_pins.items():
            pkg = lock.get(name)
            if pkg is None or pkg.version != version:
                problems.append(f"flake.nix: {name} {version} disagrees with stack.lock "
                                f"({pkg.version if pkg else 'missing'})")
        if lib.get("pythonVersion") != lock.header.get("python"):
            problems.append(f"flake.nix: python {lib.get('pythonVersion')} != stack.lock python {lock.header.get('python')}")
        if lib.get("lockSha256") != lock.sha256:
            problems.append("flake.nix: lib.lockSha256 is not the sha256 of stack.lock")
    flake_lock = json.loads((root / "flake.lock").read_text())
    for name, node in flake_lock.get("nodes", {}).items():
        locked = node.get("locked")
        if name != "root" and (not locked or not locked.get("rev") or not locked.get("narHash")):
            problems.append(f"flake.lock: input {name} is not pinned to a rev + narHash")
    return problems


def all_problems(root: Path = ROOT, use_nix: bool = True) -> list[str]:
    return (check_lock(root) + check_pyproject(root) + check_dependencies(root) + check_dockerfile(root)
            + check_flake(root, use_nix))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--no-nix", action="store_true", help="skip evaluating flake.nix (no nix installed)")
    args = ap.parse_args(argv)
    use_nix = not args.no_nix and shutil.which("nix") is not None
    problems = all_problems(args.root.resolve(), use_nix)
    if problems:
        print("stack consistency FAILED:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"stack consistent: stack.toml, stack.lock, pyproject.toml, docker/Dockerfile, flake.nix"
          f"{'' if use_nix else ' (flake not evaluated: no nix)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
