"""The lock check: a metadata-only re-resolution of stack.lock for the image platform (uv, no
wheel downloads), which must fail on a wrong hash or a wrong pin; and the real installer (pip,
hash-checking mode) refusing a tampered lock."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lock as locktool
import pytest

from conftest import ROOT, need_tool
from v4flash_pd import stacklock

pytestmark = pytest.mark.timeout(600)


def _check(lock_path: Path, toml_path: Path = ROOT / "stack.toml") -> subprocess.CompletedProcess:
    need_tool("uv")
    return subprocess.run([sys.executable, str(ROOT / "tools/lock.py"), "check", "--lock", str(lock_path),
                           "--toml", str(toml_path)], capture_output=True, text=True, timeout=540)


def test_committed_lock_resolves_for_the_image_platform() -> None:
    proc = _check(ROOT / "stack.lock")
    assert proc.returncode == 0, proc.stderr
    assert "stack.lock OK" in proc.stdout and "3.12 x86_64-manylinux_2_34" in proc.stdout
    lock = stacklock.load_lock(ROOT / "stack.lock")
    assert len(lock.packages) > 150  # the whole transitive closure, not just the pins
    for name, version in {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.8.1",
                          "nvidia-nccl-cu13": "2.28.9", "nixl-cu13": "1.5.1"}.items():
        assert lock.get(name) is not None and lock.get(name).version == version, name
    assert lock.get("nixl") is None and lock.get("nixl-cu12") is None
    assert all(p.hashes for p in lock.packages)


def test_tampered_hash_is_detected(tmp_path: Path) -> None:
    text = (ROOT / "stack.lock").read_text()
    m = re.search(r"^sglang-kernel==0\.4\.3 \\\n    --hash=sha256:([0-9a-f]{64})", text, re.M)
    assert m, "sglang-kernel entry not found"
    bad = m.group(1)[:-4] + ("0000" if not m.group(1).endswith("0000") else "1111")
    (tmp_path / "stack.lock").write_text(text.replace(m.group(1), bad))
    proc = _check(tmp_path / "stack.lock")
    assert proc.returncode == 1
    assert f"sglang-kernel==0.4.3: hash(es) not served by the index: sha256:{bad}" in proc.stderr


def test_wrong_pin_is_detected(tmp_path: Path) -> None:
    """triton 3.5.0 conflicts with torch 2.11.0's `triton==3.6.0`: the resolution must fail."""
    text = (ROOT / "stack.lock").read_text()
    assert "\ntriton==3.6.0 " in text
    (tmp_path / "stack.lock").write_text(text.replace("\ntriton==3.6.0 ", "\ntriton==3.5.0 "))
    proc = _check(tmp_path / "stack.lock")
    assert proc.returncode != 0
    assert "triton" in proc.stderr and ("unsatisfiable" in proc.stderr or "resolution gives" in proc.stderr)


def test_missing_package_is_detected(tmp_path: Path) -> None:
    """Drop a transitive dependency from the lock: the check names it as required but missing."""
    text = (ROOT / "stack.lock").read_text()
    out, skip = [], False
    for line in text.splitlines():
        if line.startswith("filelock=="):
            skip = True
            continue
        if skip and (line.startswith("    ") or not line.strip()):
            continue
        skip = False
        out.append(line)
    (tmp_path / "stack.lock").write_text("\n".join(out) + "\n")
    assert stacklock.load_lock(tmp_path / "stack.lock").get("filelock") is None
    proc = _check(tmp_path / "stack.lock")
    assert proc.returncode == 1
    assert "filelock" in proc.stderr and "missing from the lock" in proc.stderr


def test_pin_not_in_lock_is_detected(tmp_path: Path) -> None:
    toml = tmp_path / "stack.toml"
    toml.write_text((ROOT / "stack.toml").read_text().replace('torch = "2.11.0"', 'torch = "2.10.0"'))
    problems = locktool.check_pins_in(stacklock.load_lock(ROOT / "stack.lock").packages, toml)
    assert problems == ["torch: stack.toml pins 2.10.0, the lock has 2.11.0"]


def test_ci_subset_is_closed_and_hashed() -> None:
    """The CI image installs `subset sglang-router click`; it must carry every dependency."""
    text = locktool.subset(stacklock.load_lock(ROOT / "stack.lock"), ["sglang-router", "click"])
    names = {stacklock.normalize(line.split("==")[0]) for line in text.splitlines() if "==" in line}
    assert {"sglang-router", "click", "fastapi", "uvicorn", "aiohttp", "orjson", "setproctitle"} <= names
    assert "torch" not in names and "sglang" not in names
    assert text.count("--hash=sha256:") >= len(names)


def test_pip_refuses_a_tampered_hash(tmp_path: Path) -> None:
    """The real installer in hash-checking mode (what the Dockerfile runs) rejects a wrong hash.

    Only sglang-router's own wheel is fetched (--no-deps, a few MB)."""
    router = stacklock.load_lock(ROOT / "stack.lock").get("sglang-router")
    assert router is not None

    def req(hashes: tuple[str, ...]) -> str:
        return router.requirement + "".join(f" --hash={h}" for h in hashes) + "\n"

    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
            "--platform", "manylinux_2_17_x86_64", "--python-version", "3.12", "--implementation", "cp",
            "--index-url", "https://pypi.org/simple", "-d", str(tmp_path / "dl"), "-r"]
    bad = tmp_path / "bad.txt"
    bad.write_text(req(tuple("sha256:" + h.split(":")[1][::-1] for h in router.hashes)))
    proc = subprocess.run(args + [str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "DO NOT MATCH THE HASHES" in proc.stderr, proc.stderr[-2000:]
    ok = tmp_path / "ok.txt"
    ok.write_text(req(router.hashes))
    proc = subprocess.run(args + [str(ok)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list((tmp_path / "dl").glob("sglang_router-0.3.2-*.whl"))


def test_the_image_locks_stage_runs_on_just_the_files_it_copies(tmp_path: Path) -> None:
    """The Dockerfile's `locks` stage cuts the sub-locks with tools/lock.py from only the launcher files it
    COPYs; a new import in stacklock's chain once broke the CI image build 25 minutes into CI. Rebuild that
    stage's file tree from its own COPY lines and run its RUN line's commands here, in seconds."""
    text = (ROOT / "docker/Dockerfile").read_text()
    stage = text.split("AS locks", 1)[1].split("\nFROM ", 1)[0]
    copies = [line.split()[1:] for line in stage.replace("\\\n", " ").splitlines() if line.startswith("COPY ")]
    assert copies, "no COPY in the locks stage"
    for *sources, dest in copies:
        assert dest.startswith("/opt/v4flash/src/"), dest
        target = tmp_path / dest.removeprefix("/opt/v4flash/src/")
        for src in sources:
            out = target / Path(src).name if dest.endswith("/") else target
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes((ROOT / src).read_bytes())
    subsets = re.findall(r"lock\.py subset --lock /opt/v4flash/stack\.lock ([\w\- ]+?) >", stage)
    assert subsets, "the locks stage no longer runs `lock.py subset`"
    env = {"PATH": "/usr/bin:/bin"}  # with -I -S: no site-packages (where our editable install lives), as in that stage
    for packages in subsets:
        proc = subprocess.run([sys.executable, "-I", "-S", str(tmp_path / "tools/lock.py"), "subset", "--lock",
                               str(ROOT / "stack.lock"), *packages.split()],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "--hash=sha256:" in proc.stdout
