"""Every name in a bundle stays inside it: MANIFEST.json's declared paths, SHA256SUMS lines, links
and special files. Each case is a bundle "repaired" so that its checksums agree (a tamperer's
re-hash), so only the containment and coverage checks can refuse it. No engine needed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest
from bundle_helpers import reseal, run_cli

from v4flash_pd.bundle import contain, sums


@pytest.fixture
def bundle(tiny_lock, tmp_path: Path) -> Path:
    lock, wheels = tiny_lock
    out = tmp_path / "b"
    res = run_cli("bundle", "create", "--out", str(out), "--no-image", "--wheelhouse", str(wheels),
                  "--lock", str(lock), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert run_cli("bundle", "verify", str(out), "--no-progress").returncode == 0
    return out


def _manifest(b: Path) -> dict:
    return json.loads((b / "MANIFEST.json").read_text())


def _error(res) -> str:
    """The `error:` paragraph only (the fix line may mention file names too)."""
    return res.stderr.split("\n  fix:")[0]


def _image_doc(path: str) -> dict:
    return {"path": path, "id": "sha256:" + "1" * 64, "repo_tags": ["x:1"], "tar_sha256": "2" * 64,
            "tar_size": 1, "labels": {}, "compression": "zstd"}


@pytest.mark.parametrize("where", ["../evil/image.tar.zst", "ABS"])
def test_image_path_outside_the_bundle_is_refused(bundle: Path, tmp_path: Path, where: str) -> None:
    evil = tmp_path / "evil" / "image.tar.zst"
    evil.parent.mkdir()
    evil.write_bytes(b"not what create wrote\n")
    doc = _manifest(bundle)
    doc["image"] = _image_doc(str(evil) if where == "ABS" else where)
    reseal(bundle, doc)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress")
    assert res.returncode == 1, res.stdout + res.stderr
    err = _error(res)
    assert "MANIFEST.json: image.path" in err and "every path must stay inside the bundle" in err, res.stderr
    assert "climbs out of the bundle" in err if where != "ABS" else "is an absolute path" in err
    assert "Traceback" not in res.stderr


def test_manifest_file_entry_outside_the_bundle_is_refused(bundle: Path) -> None:
    """A `files` entry with `..` is refused by name (today's cross-check only saw 'disagree')."""
    doc = _manifest(bundle)
    doc["files"]["../outside.txt"] = {"size": 1, "sha256": "3" * 64}
    with pytest.raises(ValueError, match=r"files\['../outside.txt'\] = '../outside.txt' climbs out"):
        sums.parse_manifest(json.dumps(doc))


def test_declared_image_that_is_missing_fails_verify(bundle: Path) -> None:
    """image.path inside the bundle, but no such file and neither list mentions it."""
    doc = _manifest(bundle)
    doc["image"] = _image_doc("image/image.tar.zst")
    reseal(bundle, doc)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress")
    assert res.returncode == 1, res.stdout
    assert ("image/image.tar.zst: MANIFEST.json declares the image here, but SHA256SUMS does not list it"
            in _error(res)), res.stderr


def test_declared_lock_elsewhere_must_be_covered(bundle: Path) -> None:
    doc = _manifest(bundle)
    doc["lock"]["path"] = "other.lock"
    reseal(bundle, doc)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress")
    assert res.returncode == 1
    assert "other.lock: MANIFEST.json declares the lock here, but SHA256SUMS does not list it" in _error(res)


def test_manifest_section_of_the_wrong_type_is_an_error_not_a_traceback(bundle: Path) -> None:
    doc = _manifest(bundle)
    doc["image"] = "image/image.tar.zst"
    reseal(bundle, doc)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "MANIFEST.json: missing or malformed field (image is a str, expected an object)" in _error(res)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the socket file stays


@pytest.mark.parametrize(
    ("make", "rel", "kind"),
    [(_fifo, "wheelhouse/extra.pipe", "a FIFO"), (_fifo, "SHA256SUMS", "a FIFO"), (_socket, "ctl.sock", "a socket")],
    ids=["unlisted-fifo", "fifo-as-sums", "unlisted-socket"],
)
def test_special_files_are_refused_without_blocking(bundle: Path, make, rel: str, kind: str) -> None:
    """An unlisted FIFO used to be ignored; a FIFO as SHA256SUMS used to block verify forever."""
    if (bundle / rel).exists():
        (bundle / rel).unlink()
    make(bundle / rel)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress", timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{rel}: is {kind} (refused: a bundle holds only regular files)" in _error(res), res.stderr


def test_sums_as_a_symlink_out_of_the_bundle_is_refused(bundle: Path, tmp_path: Path) -> None:
    """SHA256SUMS itself must be a file in the bundle, not a link to a copy somewhere else."""
    outside = tmp_path / "outside-sums"
    shutil.move(bundle / "SHA256SUMS", outside)
    (bundle / "SHA256SUMS").symlink_to(outside)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress")
    assert res.returncode == 1, res.stdout
    assert "SHA256SUMS: is a symlink" in _error(res), res.stderr


def test_directory_symlink_escape_is_refused(bundle: Path, tmp_path: Path) -> None:
    """The wheelhouse dir swapped for a link to an outside copy: never followed, named as a link."""
    outside = tmp_path / "outside-wheels"
    shutil.move(bundle / "wheelhouse", outside)
    (bundle / "wheelhouse").symlink_to(outside, target_is_directory=True)
    res = run_cli("bundle", "verify", str(bundle), "--no-progress")
    assert res.returncode == 1
    err = _error(res)
    assert "wheelhouse: is a symlink" in err and "wheelhouse/v4tinypkg-0.1-py3-none-any.whl: missing" in err, err


# --- the pure pieces --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["", "/etc/passwd", "../x", "a/../../x", "./a", "a//b", "a/./b", "a/", "a\\b", "a\nb", "a\0b"]
)
def test_names_that_are_not_plain_relative_paths(bad: str) -> None:
    assert contain.rel_problem(bad) is not None
    if bad and "\n" not in bad:  # (an empty or multi-line name cannot even be written as one line)
        with pytest.raises(ValueError, match="outside the bundle"):
            sums.parse_sums(f"{'a' * 64}  {bad}\n")


def test_plain_names_are_accepted() -> None:
    for good in ("a", "image/image.tar.zst", "wheelhouse/x-1.0-py3-none-any.whl", "..a", "a..", ".hidden"):
        assert contain.rel_problem(good) is None, good
    assert sums.parse_sums(f"{'a' * 64}  ..a\n") == {"..a": "a" * 64}


def test_sums_may_not_list_itself_or_its_signature() -> None:
    for name in ("SHA256SUMS", "SHA256SUMS.sig"):
        with pytest.raises(ValueError, match="cannot cover itself"):
            sums.parse_sums(f"{'a' * 64}  {name}\n")


def test_inside_resolves_and_refuses_symlinked_parents(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "alias").symlink_to(root / "d")
    assert contain.inside(root, "d/f") == (root / "d" / "f").resolve()
    with pytest.raises(ValueError, match="outside the bundle"):
        contain.inside(root, "out/f")
    with pytest.raises(ValueError, match="goes through a symlink"):
        contain.inside(root, "alias/f")
    with pytest.raises(ValueError, match="climbs out"):
        contain.inside(root, "../outside/f")
    # A bundle reached through a link of its own (/xfer/current -> /xfer/2026-11-29) is fine.
    (tmp_path / "current").symlink_to(root)
    assert contain.inside(tmp_path / "current", "d/f") == (root / "d" / "f").resolve()


def test_every_special_file_kind_is_named() -> None:
    kinds = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
             stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symlink"}
    for mode, name in kinds.items():
        assert contain._kind(mode | 0o644) == name


def test_walk_lists_regular_files_and_refuses_the_rest(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "d" / "p")
    (tmp_path / "ln").symlink_to(tmp_path / "d")
    tree = contain.walk(tmp_path)
    assert tree.files == {"d/f"}
    assert tree.refused == (("d/p", "a FIFO"), ("ln", "a symlink"))
    with pytest.raises(ValueError, match="a FIFO"):
        contain.read_regular(tmp_path / "d" / "p")
    with pytest.raises(OSError):
        contain.read_regular(tmp_path / "ln")
