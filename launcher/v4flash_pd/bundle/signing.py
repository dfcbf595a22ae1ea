"""Detached signatures over SHA256SUMS with OpenSSH (`ssh-keygen -Y sign` / `-Y verify`).

SHA256SUMS covers every file of a bundle (MANIFEST.json included), so one signature over its
exact bytes vouches for the whole bundle. OpenSSH signatures were chosen because operators
already hold and distribute SSH keys, ssh-keygen is on every machine that has an SSH client, and
a human can check a bundle by hand with the same tool (docs/bundle.md). The namespace binds a
signature to this use: a signature the same key made for git commits or files does not verify
here. The trusted key is given as an ordinary `.pub` file; the allowed_signers file ssh-keygen
wants is built from it in a private temporary directory.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from v4flash_pd.errors import UserError

NAMESPACE = "v4flash-bundle"
PRINCIPAL = "v4flash-bundle-signer"
_VERIFY_TIMEOUT_S = 60
_INSTALL_HINT = "install the OpenSSH client (Debian/Ubuntu: apt-get install openssh-client; it provides ssh-keygen)"
_PRIVATE_MARK = "PRIVATE KEY-----"


class SignatureInvalid(ValueError):
    """The signature is missing, malformed, made by another key, or over other bytes."""


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys `--trust FILE` names (one or more lines of an OpenSSH `.pub` file)."""

    source: Path
    keys: tuple[str, ...]  # "<type> <base64>", comments dropped


def ssh_keygen() -> str:
    exe = shutil.which("ssh-keygen")
    if exe is None:
        raise UserError("signing and checking bundle signatures needs ssh-keygen, which is not on PATH", _INSTALL_HINT)
    return exe


def parse_public_keys(text: str) -> tuple[str, ...]:
    """The keys in an OpenSSH public key file (`<type> <base64> [comment]` per line). Pure.

    ValueError when a non-comment line is not a public key, or the file holds a private key.
    """
    if _PRIVATE_MARK in text:
        raise ValueError("it is a private key")
    keys = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) < 2:
            raise ValueError(f"line {lineno} is not `<key type> <base64 key> [comment]`")
        ktype, blob = fields[0], fields[1]
        try:
            raw = base64.b64decode(blob, validate=True)
        except ValueError as exc:
            raise ValueError(f"line {lineno}: the key is not valid base64") from exc
        n = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else -1
        if n <= 0 or raw[4 : 4 + n] != ktype.encode():
            raise ValueError(f"line {lineno}: the key data does not match its type {ktype!r}")
        keys.append(f"{ktype} {blob}")
    if not keys:
        raise ValueError("it holds no public key")
    return tuple(keys)


def allowed_signers(keys: tuple[str, ...]) -> str:
    """ssh-keygen's allowed_signers text trusting `keys` for this namespace only. Pure."""
    return "".join(f'{PRINCIPAL} namespaces="{NAMESPACE}" {k}\n' for k in keys)


def load_trust(path: Path) -> TrustedKeys:
    """Read `--trust FILE`; UserError (before anything starts) when it is not a public key."""
    fix = "pass the signer's OpenSSH public key file (the `.pub` next to the key given to `bundle create --sign`)"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except IsADirectoryError as exc:
        raise UserError(f"--trust {path} is a directory, not a public key file", fix) from exc
    except OSError as exc:
        raise UserError(f"cannot read --trust {path}: {exc.strerror}", fix) from exc
    except UnicodeDecodeError as exc:
        raise UserError(f"--trust {path} is not an OpenSSH public key (not UTF-8 text)", fix) from exc
    try:
        keys = parse_public_keys(text)
    except ValueError as exc:
        raise UserError(f"--trust {path} is not an OpenSSH public key: {exc}", fix) from exc
    ssh_keygen()
    return TrustedKeys(Path(path), keys)


def key_fingerprint(key: Path) -> str:
    """`ssh-keygen -l` of the signing key (reads only its public half: no passphrase asked).

    Run before `create` does any work, so a wrong --sign path fails in a second, not after
    hashing 300 GB.
    """
    fix = ("pass an OpenSSH private key (e.g. ~/.ssh/id_ed25519; make one with "
           "`ssh-keygen -t ed25519 -f bundle-key`), or its .pub when the key is in ssh-agent")
    if not Path(key).is_file():
        raise UserError(f"--sign {key} is not a file", fix)
    res = subprocess.run([ssh_keygen(), "-l", "-f", str(key)], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=_VERIFY_TIMEOUT_S)
    if res.returncode != 0:
        raise UserError(f"--sign {key} is not an SSH key ({_last_line(res.stderr)})", fix)
    return res.stdout.strip()


def sign(key: Path, data: bytes) -> bytes:
    """A detached signature over `data`. ssh-keygen may ask for the key's passphrase on the tty."""
    res = subprocess.run([ssh_keygen(), "-Y", "sign", "-f", str(key), "-n", NAMESPACE],
                         input=data, capture_output=True)
    if res.returncode != 0 or not res.stdout.startswith(b"-----BEGIN SSH SIGNATURE-----"):
        raise UserError(
            f"ssh-keygen could not sign with --sign {key}: {_last_line(res.stderr.decode(errors='replace'))}",
            "check the key and its passphrase (or add it to ssh-agent and pass its .pub); "
            "ssh-keygen -Y needs OpenSSH 8.1 or later; rerun the same command: the create resumes",
        )
    return res.stdout


def verify(data: bytes, signature: bytes, trusted: TrustedKeys) -> str:
    """ssh-keygen's confirmation line when `signature` is a good one over `data` by a trusted key.

    SignatureInvalid names what ssh-keygen found wrong (parse error, wrong key, changed data).
    """
    with tempfile.TemporaryDirectory(prefix="v4flash-sig-") as tmp:
        signers = Path(tmp) / "allowed_signers"
        signers.write_text(allowed_signers(trusted.keys))
        sig = Path(tmp) / "SHA256SUMS.sig"
        sig.write_bytes(signature)
        base = [ssh_keygen(), "-Y"]
        ns = ["-n", NAMESPACE, "-s", str(sig)]
        res = _run([*base, "verify", "-f", str(signers), "-I", PRINCIPAL, *ns], data)
        if res.returncode == 0:
            return _last_line(res.stdout.decode(errors="replace"))
        # Why it failed: a well-formed signature over these bytes by some other key, or a broken one.
        probe = _run([*base, "check-novalidate", *ns], data)
    if probe.returncode == 0:
        by = _last_line(probe.stdout.decode(errors="replace")).rpartition(" with ")[2] or "another key"
        raise SignatureInvalid(f"signed by {by}, which is not a key in {trusted.source}")
    why = _first_line(probe.stderr.decode(errors="replace")) or "Could not verify signature"
    raise SignatureInvalid(f"does not verify with the key in {trusted.source}: {why}")


def _run(argv: list[str], data: bytes) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(argv, input=data, capture_output=True, timeout=_VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SignatureInvalid(f"ssh-keygen did not answer within {_VERIFY_TIMEOUT_S} s") from exc


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""
