"""stacklock: parsing, lookup by normalised name, and where the lock is found."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from v4flash_pd import stacklock
from v4flash_pd.errors import UserError

LOCK = """\
# python: 3.12
# platform: x86_64-manylinux_2_34
aiohttp==3.12.15 \\
    --hash=sha256:{a} \\
    --hash=sha256:{b}
    # via sglang-router
Flashinfer_Python[cu13]==0.6.12 \\
    --hash=sha256:{c}
sglang-router==0.3.2 --hash=sha256:{d}
""".format(a="a" * 64, b="b" * 64, c="c" * 64, d="d" * 64)


def test_parse_lock_entries_and_header(tmp_path: Path) -> None:
    path = tmp_path / "stack.lock"
    path.write_text(LOCK)
    lock = stacklock.load_lock(path)
    assert lock.header == {"python": "3.12", "platform": "x86_64-manylinux_2_34"}
    assert [p.name for p in lock.packages] == ["aiohttp", "flashinfer-python", "sglang-router"]
    aio = lock.get("AIOHTTP")
    assert aio is not None and aio.version == "3.12.15"
    assert aio.hashes == ("sha256:" + "a" * 64, "sha256:" + "b" * 64)
    fi = lock.get("flashinfer_python")
    assert fi is not None and fi.extras == ("cu13",) and fi.requirement == "flashinfer-python[cu13]==0.6.12"
    assert lock.get("nope") is None
    assert lock.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "bad",
    ["torch>=2.11 --hash=sha256:" + "e" * 64, "torch==2.11.0", "torch==2.11.0 --hash=sha256:e\ntorch==2.11.0"],
)
def test_malformed_lock_is_user_error(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "stack.lock"
    path.write_text(bad + "\n")
    with pytest.raises(UserError) as exc:
        stacklock.load_lock(path)
    assert "make lock" in exc.value.hint


def test_find_lock_path_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "other.lock"
    path.write_text(LOCK)
    monkeypatch.setenv(stacklock.LOCK_ENV, str(path))
    assert stacklock.find_lock_path() == path
    monkeypatch.setenv(stacklock.LOCK_ENV, str(tmp_path / "missing"))
    with pytest.raises(UserError):
        stacklock.find_lock_path()


def test_find_lock_path_falls_back_to_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stacklock.LOCK_ENV, raising=False)
    root = Path(stacklock.__file__).resolve().parents[2]
    if (root / "stack.lock").is_file():
        assert stacklock.find_lock_path() == root / "stack.lock"
    monkeypatch.setattr(stacklock, "_repo_root", lambda: None)
    monkeypatch.setattr(stacklock, "_packaged", lambda name: None)
    with pytest.raises(UserError) as exc:
        stacklock.find_lock_path()
    assert stacklock.LOCK_ENV in exc.value.hint


def test_load_pins_from_repo_stack_toml() -> None:
    pins = stacklock.load_pins()
    assert pins["sglang"] == "0.5.13.post1"
    assert pins["nixl-cu13"] == "1.5.1"
    assert "nixl" not in pins
    assert "flashinfer-python[cu13]==0.6.12" in stacklock.pin_requirements()


def _as_python_310(monkeypatch: pytest.MonkeyPatch) -> None:
    """This interpreter as a Python 3.10 host: no tomllib, only the tomli backport (the stdlib's own
    tomllib stands in for it: tomllib is tomli, vendored)."""
    import sys

    import tomllib

    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", tomllib)


def test_pins_on_python_310_read_a_hash_in_a_quoted_value_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """A '#' inside a quoted value is text, not a comment (the hand-written 3.10 parser cut the value there)."""
    _as_python_310(monkeypatch)
    text = '[pins]\nsglang = "0.5.13.post1" # the pinned one\nlocal = "1.0+local#2"\n[extras]\nx = ["a#b", "c"]\n'
    assert stacklock.parse_pins_toml(text) == {"pins": {"sglang": "0.5.13.post1", "local": "1.0+local#2"},
                                               "extras": {"x": ["a#b", "c"]}}


def test_pins_on_python_310_match_tomllib(monkeypatch: pytest.MonkeyPatch) -> None:
    """The repo's stack.toml reads the same through the 3.10 path as through tomllib."""
    import tomllib

    text = (Path(stacklock.__file__).resolve().parents[2] / "stack.toml").read_text()
    want = tomllib.loads(text)
    _as_python_310(monkeypatch)
    assert stacklock.parse_pins_toml(text) == want


def test_wheel_ships_lock_pins_and_kernel_hook(tmp_path: Path) -> None:
    """setup.py's build_py hook: an installed wheel finds its own stack.lock (no checkout needed),
    and the kernel hook .pth lands at the site-packages root."""
    import shutil
    import subprocess
    import sys
    import zipfile

    root = Path(stacklock.__file__).resolve().parents[2]
    src = tmp_path / "src"  # a clean tree: pip builds in-tree and would reuse a stale build/
    for rel in ("pyproject.toml", "setup.py", "README.md", "stack.lock", "stack.toml", "launcher", "kernels"):
        if (root / rel).is_dir():
            shutil.copytree(root / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(root / rel, src / rel)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    whl = next((tmp_path / "dist").glob("v4flash_pd-*.whl"))
    names = set(zipfile.ZipFile(whl).namelist())
    assert {"v4flash_pd/_data/stack.lock", "v4flash_pd/_data/stack.toml"} <= names
    if (root / "kernels/v4flash_kernels_hook.pth").is_file():
        assert "v4flash_kernels_hook.pth" in names
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(site), str(whl)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-2000:]
    # -S: no site-packages, so neither the editable checkout nor the .pth interferes
    probe = subprocess.run([sys.executable, "-S", "-c",
                            f"import sys; sys.path.insert(0, {str(site)!r}); from v4flash_pd import stacklock as s; "
                            "l = s.load_lock(); print(l.path); print(l.sha256)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path,
                           env={"PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr
    path, sha = probe.stdout.split()
    assert path == str(site / "v4flash_pd/_data/stack.lock")
    assert sha == stacklock.load_lock(root / "stack.lock").sha256
