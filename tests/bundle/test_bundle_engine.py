"""create -> verify -> load against a real engine API (podman's Docker-compatible socket), and
corruption of every kind refused before anything reaches the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bundle_helpers import BASE_IMAGE, TEST_IMAGE, Engine, flip_byte, make_model, run_cli

pytestmark = pytest.mark.image


def _image_id(engine: Engine, ref: str) -> str | None:
    import docker

    try:
        return str(engine.client.images.get(ref).id)
    except docker.errors.ImageNotFound:
        return None


def _remove_image(engine: Engine, image_id: str) -> None:
    import docker

    for ref in (TEST_IMAGE, image_id):
        try:
            engine.client.images.remove(ref, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:  # podman may answer 409 yet untag; re-checked below
            if exc.status_code != 409:
                raise
    assert _image_id(engine, image_id) is None, "test setup: could not remove the image from the engine"
    assert _image_id(engine, TEST_IMAGE) is None


@pytest.fixture(scope="module")
def good(engine: Engine, built_image: str, tmp_path_factory: pytest.TempPathFactory):
    """One complete bundle (image + model manifest + wheelhouse), created through the real CLI."""
    import hashlib

    from bundle_helpers import make_wheel

    root = tmp_path_factory.mktemp("good")
    model = make_model(root)
    wheels = root / "wheels"
    wheels.mkdir()
    wheel = make_wheel(wheels)
    lock = root / "stack.lock"
    lock.write_text(f"v4tinypkg==0.1 --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
    out = root / "bundle"
    res = run_cli("bundle", "create", "--out", str(out), "--image", TEST_IMAGE, "--model", str(model),
                  "--wheelhouse", str(wheels), "--lock", str(lock), "--engine", engine.url)
    assert res.returncode == 0, res.stderr
    return out, model, built_image


def _copy(good, tmp_path: Path) -> tuple[Path, Path]:
    out, model, _ = good
    b, m = tmp_path / "bundle", tmp_path / "model"
    shutil.copytree(out, b)
    shutil.copytree(model, m)
    return b, m


def test_round_trip_loads_the_recorded_image(engine: Engine, good, tmp_path: Path) -> None:
    out, model, image_id = good
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["image"]["id"] == image_id
    assert TEST_IMAGE in manifest["image"]["repo_tags"]
    assert manifest["image"]["labels"].get("org.v4flash.test") == "bundle"
    assert sorted(manifest["files"]) == [
        "image/image.tar.zst", "model/manifest.json", "sbom.cdx.json", "stack.lock",
        "wheelhouse/v4tinypkg-0.1-py3-none-any.whl",
    ]
    # The far side with nothing but coreutils can check the transfer too.
    import subprocess
    assert subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=out).returncode == 0

    b, m = _copy(good, tmp_path)
    ver = run_cli("bundle", "verify", str(b), "--model", str(m), "--full")
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert "zstd frame, tar sha256, image ID" in ver.stdout and "FAIL" not in ver.stdout

    _remove_image(engine, image_id)
    (m / ".v4flash-manifest.json").unlink()
    res = run_cli("bundle", "load", str(b), "--engine", engine.url, "--model", str(m))
    assert res.returncode == 0, res.stdout + res.stderr
    assert _image_id(engine, TEST_IMAGE) == image_id
    assert (m / ".v4flash-manifest.json").read_text() == (b / "model/manifest.json").read_text()
    # The loaded image is usable, not just present.
    assert _run_once(engine, TEST_IMAGE, ["cat", "/built.txt"]) == b"built-for-bundle-test\n"


def _run_once(engine: Engine, image: str, cmd: list[str]) -> bytes:
    """Run a container to completion and return its stdout.

    Not `containers.run`: that follows the log stream, and podman's compat endpoint can leave a
    follow stream open after a fast container has already exited (CI hung 300 s on it once).
    Create/start/wait/plain-logs has no open-ended read, and every call is bounded.
    """
    container = engine.client.containers.create(image, cmd, network_mode="host")
    try:
        container.start()
        status = container.wait(timeout=120)
        assert status.get("StatusCode") == 0, f"container exited {status}"
        return bytes(container.logs(stdout=True, stderr=False, stream=False, follow=False))
    finally:
        container.remove(force=True)


def _archive(b: Path, m: Path) -> str:
    flip_byte(b / "image/image.tar.zst")
    return "image/image.tar.zst"


def _truncated_archive(b: Path, m: Path) -> str:
    p = b / "image/image.tar.zst"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return "image/image.tar.zst: truncated"


def _model_manifest(b: Path, m: Path) -> str:
    flip_byte(b / "model/manifest.json")
    return "model/manifest.json"


def _bundle_manifest(b: Path, m: Path) -> str:
    flip_byte(b / "MANIFEST.json", 40)
    return "MANIFEST.json"


def _sums(b: Path, m: Path) -> str:
    """A damaged SHA256SUMS line (one hex digit changed) for stack.lock."""
    text = (b / "SHA256SUMS").read_text()
    start = text.index("  stack.lock") - 64
    digit = "0" if text[start] != "0" else "1"
    (b / "SHA256SUMS").write_text(text[:start] + digit + text[start + 1:])
    return "stack.lock: sha256 mismatch"


def _missing(b: Path, m: Path) -> str:
    (b / "sbom.cdx.json").unlink()
    return "sbom.cdx.json: missing"


def _extra(b: Path, m: Path) -> str:
    (b / "image" / "notes.txt").write_text("hello\n")
    return "image/notes.txt: unexpected file"


def _shard_flipped(b: Path, m: Path) -> str:
    flip_byte(m / "model-00001-of-00003.safetensors")
    return "model-00001-of-00003.safetensors: sha256 mismatch"


def _shard_truncated(b: Path, m: Path) -> str:
    p = m / "model-00002-of-00003.safetensors"
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size - 1000)
    return "model-00002-of-00003.safetensors: truncated"


@pytest.mark.parametrize(
    "corrupt",
    [_archive, _truncated_archive, _model_manifest, _bundle_manifest, _sums, _missing, _extra,
     _shard_flipped, _shard_truncated],
    ids=lambda f: f.__name__.strip("_"),
)
def test_corruption_is_refused_and_nothing_is_loaded(engine: Engine, good, tmp_path: Path, corrupt) -> None:
    _, _, image_id = good
    b, m = _copy(good, tmp_path)
    expected = corrupt(b, m)
    _remove_image(engine, image_id)
    # Sizes-only model check by default; a same-size flipped shard needs --full.
    full = ["--full"] if corrupt is _shard_flipped else []
    res = run_cli("bundle", "load", str(b), "--engine", engine.url, "--model", str(m), *full)
    assert res.returncode == 1, res.stdout + res.stderr
    error = res.stderr.split("\n  fix:")[0]  # the hint mentions SHA256SUMS; match the error only
    assert "failed verification" in error
    assert expected in error, res.stderr
    assert "FAIL" in res.stdout
    assert _image_id(engine, image_id) is None, "a refused bundle must load nothing"
    assert _image_id(engine, TEST_IMAGE) is None


def test_archive_rewritten_with_matching_checksums_is_still_refused(engine: Engine, good, tmp_path: Path) -> None:
    """Someone 'repairs' SHA256SUMS + MANIFEST.json after truncating: the zstd frame check catches it."""
    from v4flash_pd.bundle import sums

    _, _, image_id = good
    b, _m = _copy(good, tmp_path)
    arc = b / "image/image.tar.zst"
    arc.write_bytes(arc.read_bytes()[:-200])
    import hashlib

    digest = hashlib.sha256(arc.read_bytes()).hexdigest()
    man = json.loads((b / "MANIFEST.json").read_text())
    man["files"]["image/image.tar.zst"] = {"size": arc.stat().st_size, "sha256": digest}
    (b / "MANIFEST.json").write_text(json.dumps(man))
    listed = sums.parse_sums((b / "SHA256SUMS").read_text())
    listed["image/image.tar.zst"] = digest
    listed["MANIFEST.json"] = hashlib.sha256((b / "MANIFEST.json").read_bytes()).hexdigest()
    (b / "SHA256SUMS").write_text(sums.format_sums(listed))
    _remove_image(engine, image_id)
    res = run_cli("bundle", "load", str(b), "--engine", engine.url)
    assert res.returncode == 1
    assert "image/image.tar.zst: the zstd frame ends early" in res.stderr, res.stderr
    assert _image_id(engine, image_id) is None


def test_unreachable_engine_is_a_clear_error(tmp_path: Path, good) -> None:
    b, _ = _copy(good, tmp_path)
    res = run_cli("bundle", "load", str(b), "--engine", f"unix://{tmp_path}/nothing.sock")
    assert res.returncode == 1
    assert "cannot reach the container engine" in res.stderr and "Traceback" not in res.stderr


def test_image_built_from_another_lock_is_refused(engine: Engine, built_image: str, tmp_path: Path) -> None:
    """The image's org.v4flash.stack.lock.sha256 label must name the lock being bundled."""
    import hashlib

    lock = tmp_path / "stack.lock"
    lock.write_text(f"v4tinypkg==0.1 --hash=sha256:{'0' * 64}\n")
    right = hashlib.sha256(lock.read_bytes()).hexdigest()
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for tag, value in (("localhost/v4flash-bundle-wronglock:1", "f" * 64), ("localhost/v4flash-bundle-rightlock:1", right)):
        (ctx / "Containerfile").write_text(f"FROM {BASE_IMAGE}\nLABEL org.v4flash.stack.lock.sha256={value}\n")
        engine.client.images.build(path=str(ctx), dockerfile="Containerfile", tag=tag, rm=True)
    res = run_cli("bundle", "create", "--out", str(tmp_path / "wrong"), "--image", "localhost/v4flash-bundle-wronglock:1",
                  "--lock", str(lock), "--engine", engine.url)
    assert res.returncode == 2, res.stderr
    assert "built from a different stack lock (org.v4flash.stack.lock.sha256=fff" in res.stderr
    assert not (tmp_path / "wrong").exists()
    res = run_cli("bundle", "create", "--out", str(tmp_path / "right"), "--image", "localhost/v4flash-bundle-rightlock:1",
                  "--lock", str(lock), "--engine", engine.url)
    assert res.returncode == 0, res.stderr


def test_image_path_outside_the_bundle_loads_nothing(engine: Engine, good, tmp_path: Path) -> None:
    """The real archive moved out of the bundle, image.path pointed at it, checksums re-hashed:
    load must not stream a file from outside the bundle into the engine."""
    from bundle_helpers import reseal

    _, _, image_id = good
    b, _m = _copy(good, tmp_path)
    (tmp_path / "evil").mkdir()
    shutil.move(b / "image/image.tar.zst", tmp_path / "evil/image.tar.zst")
    (b / "image").rmdir()
    doc = json.loads((b / "MANIFEST.json").read_text())
    del doc["files"]["image/image.tar.zst"]
    doc["image"]["path"] = "../evil/image.tar.zst"
    reseal(b, doc)
    _remove_image(engine, image_id)
    res = run_cli("bundle", "load", str(b), "--engine", engine.url)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "image.path = '../evil/image.tar.zst' climbs out of the bundle" in res.stderr, res.stderr
    assert _image_id(engine, image_id) is None, "a file outside the bundle reached the engine"


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from bundle_helpers import ssh_key

    d = tmp_path_factory.mktemp("keys")
    return ssh_key(d, "signer"), ssh_key(d, "stranger")


@pytest.mark.parametrize("case", ["signed", "unsigned", "wrong-key"])
def test_load_with_trust_needs_a_good_signature(engine: Engine, good, signer, tmp_path: Path, case: str) -> None:
    from v4flash_pd.bundle import signing

    _, _, image_id = good
    b, _m = _copy(good, tmp_path)
    if case != "unsigned":
        (b / "SHA256SUMS.sig").write_bytes(signing.sign(signer[0], (b / "SHA256SUMS").read_bytes()))
    trusted = signer[1] if case == "wrong-key" else signer[0]
    _remove_image(engine, image_id)
    res = run_cli("bundle", "load", str(b), "--engine", engine.url, "--trust", f"{trusted}.pub")
    if case == "signed":
        assert res.returncode == 0, res.stdout + res.stderr
        assert 'Good "v4flash-bundle" signature' in res.stdout
        assert _image_id(engine, TEST_IMAGE) == image_id
        return
    assert res.returncode == 1, res.stdout + res.stderr
    expected = "SHA256SUMS.sig: missing" if case == "unsigned" else "SHA256SUMS.sig: signed by ED25519 key"
    assert expected in res.stderr and "nothing was loaded into the engine" in res.stderr, res.stderr
    assert _image_id(engine, image_id) is None and _image_id(engine, TEST_IMAGE) is None
