"""`bundle create --sign KEY` and `verify --trust KEY.pub`: a detached OpenSSH signature over
SHA256SUMS, made and checked by the real ssh-keygen. No engine needed (image-less bundles; the
engine tests load a signed bundle)."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest
from bundle_helpers import reseal, run_cli, ssh_key

from v4flash_pd.bundle import signing


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "keys"
    d.mkdir()
    return ssh_key(d, "signer"), ssh_key(d, "stranger")


def _create(tiny_lock, out: Path, *extra: str) -> subprocess.CompletedProcess:
    lock, wheels = tiny_lock
    return run_cli("bundle", "create", "--out", str(out), "--no-image", "--wheelhouse", str(wheels),
                   "--lock", str(lock), "--no-progress", *extra)


@pytest.fixture
def signed(tiny_lock, keys, tmp_path: Path) -> Path:
    out = tmp_path / "signed"
    res = _create(tiny_lock, out, "--sign", str(keys[0]))
    assert res.returncode == 0, res.stderr
    return out


def _verify(b: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("bundle", "verify", str(b), "--no-progress", *extra)


def _error(res) -> str:
    return res.stderr.split("\n  fix:")[0]


def test_signed_round_trip_and_a_hand_check_with_ssh_keygen(signed: Path, keys) -> None:
    signer, _ = keys
    assert (signed / "SHA256SUMS.sig").read_bytes().startswith(b"-----BEGIN SSH SIGNATURE-----")
    res = _verify(signed, "--trust", f"{signer}.pub")
    assert res.returncode == 0, res.stdout + res.stderr
    assert 'Good "v4flash-bundle" signature' in res.stdout and "FAIL" not in res.stdout
    # The operator's own check, with nothing but OpenSSH (docs/bundle.md shows this command).
    allowed = signed.parent / "allowed_signers"
    allowed.write_text(f'bundle namespaces="v4flash-bundle" {Path(f"{signer}.pub").read_text()}')
    with open(signed / "SHA256SUMS", "rb") as fh:
        hand = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", "bundle", "-n", "v4flash-bundle",
                               "-s", str(signed / "SHA256SUMS.sig")], stdin=fh, capture_output=True, timeout=60)
    assert hand.returncode == 0, hand.stderr
    # Without --trust a signed bundle still verifies, and says the signature was not checked.
    plain = _verify(signed)
    assert plain.returncode == 0 and "present, not checked (pass --trust PUBKEY)" in plain.stdout


def test_unsigned_bundle_is_refused_when_trust_is_required(tiny_lock, keys, tmp_path: Path) -> None:
    out = tmp_path / "unsigned"
    assert _create(tiny_lock, out).returncode == 0
    assert not (out / "SHA256SUMS.sig").exists()
    res = _verify(out, "--trust", f"{keys[0]}.pub")
    assert res.returncode == 1, res.stdout
    assert "SHA256SUMS.sig: missing: the bundle is not signed, and --trust requires a signature" in _error(res)
    assert "bundle create --sign KEY" in res.stderr.split("\n  fix:")[1]


def test_signature_by_another_key_is_refused(signed: Path, keys) -> None:
    res = _verify(signed, "--trust", f"{keys[1]}.pub")
    assert res.returncode == 1
    assert "SHA256SUMS.sig: signed by ED25519 key SHA256:" in _error(res)
    assert f"which is not a key in {keys[1]}.pub" in _error(res)


def test_damaged_signature_is_refused(signed: Path, keys) -> None:
    sig = signed / "SHA256SUMS.sig"
    lines = sig.read_text().splitlines()
    body = lines[2]
    lines[2] = body[:10] + ("A" if body[10] != "A" else "B") + body[11:]
    sig.write_text("\n".join(lines) + "\n")
    res = _verify(signed, "--trust", f"{keys[0]}.pub")
    assert res.returncode == 1
    assert f"SHA256SUMS.sig: does not verify with the key in {keys[0]}.pub" in _error(res), res.stderr


def test_signature_for_another_purpose_is_refused(signed: Path, keys) -> None:
    """The same key's signature over the same bytes, but made for another namespace (e.g. files)."""
    with open(signed / "SHA256SUMS", "rb") as fh:
        other = subprocess.run(["ssh-keygen", "-Y", "sign", "-f", str(keys[0]), "-n", "file"],
                               stdin=fh, capture_output=True, timeout=60, check=True).stdout
    (signed / "SHA256SUMS.sig").write_bytes(other)
    res = _verify(signed, "--trust", f"{keys[0]}.pub")
    assert res.returncode == 1 and "namespace does not match" in _error(res), res.stderr


def test_resealed_bundle_fails_the_signature(signed: Path, keys) -> None:
    """A consistent re-hash (what passed before signing existed) no longer passes with --trust."""
    doc = json.loads((signed / "MANIFEST.json").read_text())
    doc["created"] = "2000-01-01T00:00:00Z"
    reseal(signed, doc)
    assert _verify(signed).returncode == 0  # the checksums alone agree...
    res = _verify(signed, "--trust", f"{keys[0]}.pub")  # ...the signature does not
    assert res.returncode == 1
    assert "incorrect signature" in _error(res), res.stderr


@pytest.mark.parametrize("what", ["private", "absent", "garbage", "dir"])
def test_bad_trust_argument_is_a_usage_error(signed: Path, keys, tmp_path: Path, what: str) -> None:
    arg = {
        "private": keys[0],
        "absent": tmp_path / "nope.pub",
        "garbage": tmp_path / "garbage.pub",
        "dir": tmp_path,
    }[what]
    (tmp_path / "garbage.pub").write_text("ssh-ed25519 AAAA-not-base64 x\n")
    res = _verify(signed, "--trust", str(arg))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr  # refused before any check ran
    assert f"--trust {arg}" in res.stderr and "fix: pass the signer's OpenSSH public key file" in res.stderr
    if what == "private":
        assert "it is a private key" in res.stderr


def test_bad_sign_key_fails_before_any_work(tiny_lock, tmp_path: Path) -> None:
    not_a_key = tmp_path / "notakey"
    not_a_key.write_text("hello\n")
    for key in (not_a_key, tmp_path / "absent"):
        out = tmp_path / "b"
        res = _create(tiny_lock, out, "--sign", str(key))
        assert res.returncode == 2, res.stderr
        assert f"--sign {key} is not" in res.stderr and "fix:" in res.stderr and "Traceback" not in res.stderr
        assert not out.exists() and not (tmp_path / ".b.partial").exists()


def test_parse_public_keys() -> None:
    blob = base64.b64encode(b"\0\0\0\x0bssh-ed25519\0\0\0\x20" + b"\1" * 32).decode()
    assert signing.parse_public_keys(f"# comment\nssh-ed25519 {blob} me@host\n") == (f"ssh-ed25519 {blob}",)
    private = "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    for bad in ("", "# only a comment\n", f"ssh-rsa {blob}\n", "ssh-ed25519\n", private):
        with pytest.raises(ValueError):
            signing.parse_public_keys(bad)
    assert signing.allowed_signers((f"ssh-ed25519 {blob}",)) == (
        f'v4flash-bundle-signer namespaces="v4flash-bundle" ssh-ed25519 {blob}\n'
    )


def test_missing_ssh_keygen_is_named_with_its_package(signed: Path, keys, tmp_path: Path) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    for args in (("bundle", "verify", str(signed), "--trust", f"{keys[0]}.pub"),
                 ("bundle", "create", "--out", str(tmp_path / "x"), "--no-image", "--sign", str(keys[0]))):
        res = run_cli(*args, env={"PATH": str(empty)})
        assert res.returncode == 2, res.stderr
        assert "needs ssh-keygen, which is not on PATH" in res.stderr
        assert "apt-get install openssh-client" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / ".x.partial").exists()
