"""Bundle pieces that need no engine: model manifest + preflight, SBOM, SHA256SUMS, wheelhouse,
image-archive reading, and the CLI's refusals."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard
from bundle_helpers import flip_byte, make_model, make_wheel, reseal, run_cli

from v4flash_pd.bundle import image, modelmanifest, preflight, sbom, sums
from v4flash_pd.errors import UserError
from v4flash_pd.stacklock import load_lock

NET_ISOLATED = shutil.which("unshare") is not None and subprocess.run(["unshare", "-n", "true"]).returncode == 0


def _offline(cmd: list[str]) -> list[str]:
    """Run with no network namespace at all when the machine allows it (proves 'no network')."""
    return ["unshare", "-n", *cmd] if NET_ISOLATED else cmd


# --- model manifest + preflight ---------------------------------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> Path:
    m = make_model(tmp_path)
    manifest, stats = modelmanifest.build_manifest(m, workers=2)
    assert stats.hashed_bytes == manifest.total_bytes and stats.reused_bytes == 0
    modelmanifest.write_atomic(m / modelmanifest.IN_DIR_NAME, manifest.to_json())
    return m


def test_manifest_records_every_file_with_its_sha256(model: Path) -> None:
    mm = modelmanifest.load_manifest(model / ".v4flash-manifest.json")
    paths = [f.path for f in mm.files]
    assert paths == sorted(paths) and "sub/tokenizer.json" in paths and ".v4flash-manifest.json" not in paths
    for f in mm.files:
        data = (model / f.path).read_bytes()
        assert f.size == len(data) and f.sha256 == hashlib.sha256(data).hexdigest()


def test_huggingface_bookkeeping_is_not_model_content(model: Path) -> None:
    (model / ".cache/huggingface/download").mkdir(parents=True)
    (model / ".cache/huggingface/download/x.metadata").write_text("etag\n")
    assert preflight.check_model_against_manifest(model) == []


def test_preflight_passes_on_an_intact_model(model: Path) -> None:
    assert preflight.check_model_against_manifest(model) == []
    assert preflight.check_model_against_manifest(model, full=True) == []


def test_preflight_size_check_catches_truncated_missing_and_extra(model: Path) -> None:
    shard = model / "model-00000-of-00003.safetensors"
    with open(shard, "r+b") as fh:
        fh.truncate(100)
    (model / "config.json").unlink()
    (model / "stray.bin").write_bytes(b"x")
    problems = preflight.check_model_against_manifest(model)
    assert problems == [
        "config.json: missing (manifest lists 45 bytes)",
        "model-00000-of-00003.safetensors: truncated: 100 bytes on disk, manifest says 3000000",
        "stray.bin: not in the manifest (unexpected file)",
    ]


def test_same_size_corruption_needs_full(model: Path) -> None:
    flip_byte(model / "model-00001-of-00003.safetensors")
    assert preflight.check_model_against_manifest(model) == []
    assert preflight.check_model_against_manifest(model, full=True) == [
        "model-00001-of-00003.safetensors: sha256 mismatch (content differs from the manifest)"
    ]


def test_find_manifest_lookup_order(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inside = model / ".v4flash-manifest.json"
    assert preflight.find_manifest(model) == inside
    sibling = tmp_path / "model.v4flash-manifest.json"
    inside.rename(sibling)
    assert preflight.find_manifest(model) == sibling
    elsewhere = tmp_path / "elsewhere.json"
    shutil.copy(sibling, elsewhere)
    monkeypatch.setenv("V4FLASH_MODEL_MANIFEST", str(elsewhere))
    assert preflight.find_manifest(model) == elsewhere
    monkeypatch.delenv("V4FLASH_MODEL_MANIFEST")
    sibling.unlink()
    assert preflight.find_manifest(model) is None
    [problem] = preflight.check_model_against_manifest(model)
    assert problem.startswith("no model manifest found")


def test_damaged_manifest_is_a_user_error(model: Path) -> None:
    p = model / ".v4flash-manifest.json"
    p.write_text(p.read_text()[:-40])
    with pytest.raises(UserError) as exc:
        preflight.check_model_against_manifest(model)
    assert ".v4flash-manifest.json" in exc.value.message and "bundle" in exc.value.hint


def test_resume_state_reuses_only_unchanged_files(tmp_path: Path) -> None:
    m = make_model(tmp_path)
    state = tmp_path / "state.jsonl"
    first, s1 = modelmanifest.build_manifest(m, state)
    assert s1.reused_files == 0
    with open(state, "a") as fh:
        fh.write('{"path": "torn')  # a line cut by a kill mid-write is ignored
    (m / "config.json").write_text('{"changed": true}\n')
    second, s2 = modelmanifest.build_manifest(m, state)
    assert s2.reused_files == len(first.files) - 1
    assert s2.hashed_bytes == len('{"changed": true}\n')
    assert second.by_path()["config.json"].sha256 == hashlib.sha256(b'{"changed": true}\n').hexdigest()


# --- SBOM / sums ------------------------------------------------------------------------------


def test_sbom_is_cyclonedx_and_a_pure_function_of_the_lock(tiny_lock) -> None:
    lock = load_lock(tiny_lock[0])
    a = sbom.sbom_from_lock(lock, "2026-01-01T00:00:00Z", "0.1.0")
    b = sbom.sbom_from_lock(lock, "2026-01-01T00:00:00Z", "0.1.0")
    assert a == b and a["bomFormat"] == "CycloneDX" and a["specVersion"] == "1.5"
    [comp] = a["components"]
    assert comp["purl"] == "pkg:pypi/v4tinypkg@0.1"
    assert comp["hashes"] == [{"alg": "SHA-256", "content": lock.packages[0].hashes[0].split(":")[1]}]
    text = sbom.render(a)
    assert sbom.check_sbom(text, lock) == []
    doc = json.loads(text)
    doc["components"][0]["version"] = "0.2"
    assert sbom.check_sbom(json.dumps(doc), lock) == ["components differ from the bundled stack.lock"]


def test_sums_round_trip_and_refusals() -> None:
    digests = {"b/x": "a" * 64, "a": "b" * 64}
    assert sums.parse_sums(sums.format_sums(digests)) == digests
    for bad in ("zz  a\n", f"{'a' * 64}  ../etc/passwd\n", f"{'a' * 64}  /abs\n", f"{'a' * 64}  a\n{'b' * 64}  a\n"):
        with pytest.raises(ValueError):
            sums.parse_sums(bad)


# --- image archive reading (synthetic docker-archive) -------------------------------------------


def _docker_archive(tmp_path: Path) -> tuple[Path, str]:
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": []}}).encode()
    cid = hashlib.sha256(config).hexdigest()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in ((f"{cid}.json", config), ("layer.tar", b"\0" * 300_000),
                           ("manifest.json", json.dumps([{"Config": f"{cid}.json", "RepoTags": ["x:1"],
                                                          "Layers": ["layer.tar"]}]).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    path = tmp_path / "img.tar.zst"
    path.write_bytes(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(buf.getvalue()))
    return path, "sha256:" + cid


def test_read_archive_checks_frame_tar_and_config_id(tmp_path: Path) -> None:
    path, cid = _docker_archive(tmp_path)
    info = image.read_archive(path)
    assert info.config_id == cid and info.repo_tags == ("x:1",)
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    with pytest.raises(ValueError, match="ends early"):
        image.read_archive(path)
    path.write_bytes(good + b"junk")
    with pytest.raises(ValueError, match="after the end"):
        image.read_archive(path)
    data = bytearray(good)
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        image.read_archive(path)


# --- CLI: wheelhouse, refusals ------------------------------------------------------------------


def test_wheelhouse_bundle_installs_offline_with_hash_checking(tiny_lock, tmp_path: Path) -> None:
    lock, wheels = tiny_lock
    out = tmp_path / "b"
    res = run_cli("bundle", "create", "--out", str(out), "--no-image", "--wheelhouse", str(wheels), "--lock", str(lock))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (out / "wheelhouse").iterdir()) == ["v4tinypkg-0.1-py3-none-any.whl"]
    ver = subprocess.run(_offline([sys.executable, "-m", "v4flash_pd", "bundle", "verify", str(out)]),
                         capture_output=True, text=True, timeout=120)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert "hashes in stack.lock" in ver.stdout
    target = tmp_path / "site"
    pip = subprocess.run(
        _offline([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(out / "wheelhouse"),
                  "--require-hashes", "--only-binary", ":all:", "--target", str(target), "-r", str(out / "stack.lock")]),
        capture_output=True, text=True, timeout=120,
    )
    assert pip.returncode == 0, pip.stderr
    assert (target / "v4tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"


def test_wheel_not_in_the_lock_is_refused_by_verify(tiny_lock, tmp_path: Path) -> None:
    lock, wheels = tiny_lock
    out = tmp_path / "b"
    assert run_cli("bundle", "create", "--out", str(out), "--no-image", "--wheelhouse", str(wheels),
                   "--lock", str(lock)).returncode == 0
    # Swap in a rebuilt wheel and "fix" both checksum lists: only the lock comparison can catch it.
    other = make_wheel(tmp_path, version="0.1")
    with open(other, "ab") as fh:
        fh.write(b"\0")
    rel = "wheelhouse/v4tinypkg-0.1-py3-none-any.whl"
    shutil.copy(other, out / rel)
    digest = hashlib.sha256((out / rel).read_bytes()).hexdigest()
    man = json.loads((out / "MANIFEST.json").read_text())
    man["files"][rel] = {"size": (out / rel).stat().st_size, "sha256": digest}
    (out / "MANIFEST.json").write_text(json.dumps(man))
    listed = sums.parse_sums((out / "SHA256SUMS").read_text())
    listed[rel] = digest
    listed["MANIFEST.json"] = hashlib.sha256((out / "MANIFEST.json").read_bytes()).hexdigest()
    (out / "SHA256SUMS").write_text(sums.format_sums(listed))
    ver = run_cli("bundle", "verify", str(out))
    assert ver.returncode == 1
    assert "v4tinypkg-0.1-py3-none-any.whl: sha256 is not in stack.lock" in ver.stderr, ver.stderr


@pytest.mark.parametrize("text", ["[]", "\"CycloneDX\"", '{"metadata": [], "components": []}',
                                  '{"metadata": {"properties": {"a": 1}}}', '{"metadata": {"properties": [1, "x"]}}'],
                         ids=["list", "string", "metadata-list", "properties-object", "properties-not-objects"])
def test_sbom_of_the_wrong_shape_is_a_failed_check_not_a_traceback(text: str, tiny_lock, tmp_path: Path) -> None:
    """A re-hashed bundle whose SBOM parses as JSON but is no CycloneDX object: one failed row, exit 1."""
    lock, _ = tiny_lock
    out = tmp_path / "b"
    assert run_cli("bundle", "create", "--out", str(out), "--no-image", "--lock", str(lock)).returncode == 0
    (out / "sbom.cdx.json").write_text(text)
    reseal(out, json.loads((out / "MANIFEST.json").read_text()))
    res = run_cli("bundle", "verify", str(out), "--no-progress")
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "sbom.cdx.json" in res.stderr and "CycloneDX" in res.stderr, res.stderr


def test_wheelhouse_dir_missing_a_locked_package_is_refused(tiny_lock, tmp_path: Path) -> None:
    lock, wheels = tiny_lock
    (wheels / "v4tinypkg-0.1-py3-none-any.whl").unlink()
    res = run_cli("bundle", "create", "--out", str(tmp_path / "b"), "--no-image", "--wheelhouse", str(wheels),
                  "--lock", str(lock))
    assert res.returncode == 2
    assert "no file with a locked sha256 for: v4tinypkg==0.1" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "b").exists()


def test_create_refuses_existing_out_and_contradictory_flags(tiny_lock, tmp_path: Path) -> None:
    lock, _ = tiny_lock
    (tmp_path / "exists").mkdir()
    res = run_cli("bundle", "create", "--out", str(tmp_path / "exists"), "--no-image", "--lock", str(lock))
    assert res.returncode == 2 and "already exists" in res.stderr
    res = run_cli("bundle", "create", "--out", str(tmp_path / "x"), "--no-image", "--image", "a:b", "--lock", str(lock))
    assert res.returncode == 2 and "contradict" in res.stderr


def test_verify_missing_dir_and_env_vars(tmp_path: Path, tiny_lock) -> None:
    res = run_cli("bundle", "verify", str(tmp_path / "nope"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    lock, _ = tiny_lock
    out = tmp_path / "viaenv"
    res = run_cli("bundle", "create", env={"V4FLASH_BUNDLE_OUT": str(out), "V4FLASH_BUNDLE_NO_IMAGE": "1",
                                           "V4FLASH_STACK_LOCK": str(lock)})
    assert res.returncode == 0, res.stderr
    res = run_cli("bundle", "verify", env={"V4FLASH_BUNDLE_DIR": str(out)})
    assert res.returncode == 0, res.stderr


def test_verify_without_model_flag_says_model_unchecked(tmp_path: Path, tiny_lock) -> None:
    lock, _ = tiny_lock
    m = make_model(tmp_path)
    out = tmp_path / "b"
    created = run_cli("bundle", "create", "--out", str(out), "--no-image", "--model", str(m), "--lock", str(lock))
    assert created.returncode == 0
    res = run_cli("bundle", "verify", str(out))
    assert res.returncode == 0 and "not checked (pass --model PATH)" in res.stdout
    assert preflight.find_manifest(m) == m / ".v4flash-manifest.json"


def test_bundle_of_the_real_stack_lock_has_a_matching_sbom(tmp_path: Path) -> None:
    """Default lock (the repo's stack.lock, all of the pinned serving stack) -> SBOM covers all of it."""
    from v4flash_pd.stacklock import find_lock_path

    lock = load_lock(find_lock_path())
    out = tmp_path / "b"
    res = run_cli("bundle", "create", "--out", str(out), "--no-image", env={"V4FLASH_STACK_LOCK": ""})
    assert res.returncode == 0, res.stderr
    assert (out / "stack.lock").read_bytes() == lock.path.read_bytes()
    doc = json.loads((out / "sbom.cdx.json").read_text())
    assert len(doc["components"]) == len(lock.packages) > 100
    assert {c["name"] for c in doc["components"]} >= {"sglang", "torch", "sglang-router"}
    assert json.loads((out / "MANIFEST.json").read_text())["lock"]["sha256"] == lock.sha256
    ver = run_cli("bundle", "verify", str(out), "--model", str(tmp_path / "absent"))
    assert ver.returncode == 1 and "this bundle was created without --model" in ver.stdout


def test_verify_with_a_missing_model_dir_names_it(tmp_path: Path, tiny_lock) -> None:
    lock, _ = tiny_lock
    m = make_model(tmp_path)
    out = tmp_path / "b"
    created = run_cli("bundle", "create", "--out", str(out), "--no-image", "--model", str(m), "--lock", str(lock))
    assert created.returncode == 0
    res = run_cli("bundle", "verify", str(out), "--model", str(tmp_path / "elsewhere"))
    assert res.returncode == 1
    assert f"{tmp_path / 'elsewhere'}: does not exist or is not a directory" in res.stderr
