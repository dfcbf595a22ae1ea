"""Every secret a report could carry, known by value, in every spelling we (or a tool) write it in.

A secret is the router's key and the value of every environment entry whose name says it is one
(`secret_name`: HF_TOKEN, OPENAI_APIKEY, GITHUB_PAT, AWS_SECRET_ACCESS_KEY, db_password, ...), from
the plan's processes (config [env], worker env, --set) and the report's own environment. A value
is written raw, shell-quoted (`.command` files, `shlex.join`), TOML- or JSON-escaped (`--set`
words, plan/state JSON), or as a Python repr (an exception message): `spellings` lists them all,
and one escape inside another (a TOML-escaped value inside a shell-quoted word). A `Redactor`
finds and replaces them in bytes. A value of any length counts; a short one (under `LONG`
characters) only where it stands alone, not inside a longer word (a 3-letter secret is not a leak
in every hash that happens to contain those letters). Values that cannot be secrets (`0`, `1`,
`true`, `off`, ...) are left alone: they are redacted by name only (`redact_env`).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any, Callable, Iterable

REDACTED = "<redacted>"
LONG = 8
# a part of a name (split at `_`, `-`, digits and camelCase) that says the value is a secret: one of these
# words, or a part holding one of the stems (APIKEY, AUTHTOKEN, SECRETKEY), but not the stems' ordinary words
_WORDS = {"AUTH", "PAT", "PWD", "PRIVATE", "COOKIE", "SIGNATURE", "PIN"}
_STEMS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL")
_ORDINARY = {"TOKENS", "TOKENIZER", "TOKENIZERS", "KEYBOARD", "MONKEY"}
# a last part that says the value is where a secret lives, not the secret (API_KEY_FILE, HF_TOKEN_PATH)
_POINTERS = {"FILE", "PATH", "DIR", "ENV", "NAME"}
_NOT_SECRETS = {"", "0", "1", "true", "false", "yes", "no", "on", "off", "none", "null"}
_PARTS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def secret_name(name: object) -> bool:
    """Whether an environment variable (or JSON key) named `name` holds a secret, in any case.

    `PWD` (the shell's working directory) is the one exact name that is not: a path, everywhere."""
    if not isinstance(name, str) or not name or name == "PWD":
        return False
    parts = [p.upper() for p in _PARTS.findall(name)]
    if not parts or parts[-1] in _POINTERS:
        return False
    return any(p in _WORDS or (p not in _ORDINARY and any(stem in p for stem in _STEMS)) for p in parts)


def could_be_secret(value: str) -> bool:
    return value.strip().lower() not in _NOT_SECRETS


def _shell_single(s: str) -> str:  # inside '...': shlex.quote's way and the POSIX '\'' way
    return s.replace("'", "'\"'\"'")


def _shell_single_posix(s: str) -> str:
    return s.replace("'", "'\\''")


def _shell_double(s: str) -> str:  # inside "..."
    return re.sub(r'([\\"$`])', r"\\\1", s)


def _shell_bare(s: str) -> str:  # unquoted, each special character escaped
    return re.sub(r"([^A-Za-z0-9_./:@%+=,-])", r"\\\1", s)


def _json(s: str) -> str:
    return json.dumps(s)[1:-1]


def _json_utf8(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


def _toml(s: str) -> str:  # a TOML basic string's body
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif c in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04X}")
        else:
            out.append(c)
    return "".join(out)


def _repr(s: str) -> str:
    return repr(s)[1:-1]


def _repr_bytes(s: str) -> str:
    return repr(s.encode("utf-8"))[2:-1]


def _url(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _url_plus(s: str) -> str:
    return urllib.parse.quote_plus(s)


ENCODERS: tuple[Callable[[str], str], ...] = (_shell_single, _shell_single_posix, _shell_double, _shell_bare, _json,
                                              _json_utf8, _toml, _repr, _repr_bytes, _url, _url_plus)


def spellings(secret: str, depth: int = 2) -> frozenset[str]:
    """`secret` and every way of writing it: each encoder, and each encoder applied to those (`depth`)."""
    found = {secret}
    layer = {secret}
    for _ in range(depth):
        layer = {enc(s) for s in layer for enc in ENCODERS} - found
        found |= layer
    return frozenset(found)


def collect(env_pairs: Iterable[tuple[str, str]], keys: Iterable[str] = ()) -> tuple[str, ...]:
    """The secrets: `keys` (the router's key) and the values of secret-named pairs; longest first."""
    found = {k for k in keys if k and could_be_secret(k)}
    found |= {v for k, v in env_pairs if secret_name(k) and isinstance(v, str) and could_be_secret(v)}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


class Redactor:
    """Finds and replaces every spelling of `secrets` in bytes (utf-8).

    Each secret is looked for through its `_core` first (one fast substring search): every spelling
    contains it, so the secret's own pattern of spellings runs only over data that may hold one."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = tuple(sorted(set(secrets), key=lambda s: (-len(s), s)))
        self._each: list[tuple[bytes, re.Pattern[bytes]]] = []
        for secret in self.secrets:
            needles = sorted(spellings(secret), key=lambda n: (-len(n), n))
            self._each.append((_core(secret), re.compile(b"|".join(_pattern(n) for n in needles))))

    def __bool__(self) -> bool:
        return bool(self._each)

    def find(self, data: bytes) -> bool:
        return any(core in data and rx.search(data) is not None for core, rx in self._each)

    def redact(self, data: bytes) -> tuple[bytes, int]:
        """`data` with every spelling replaced by REDACTED, and how many were."""
        total = 0
        for core, rx in self._each:
            if core in data:
                data, n = rx.subn(REDACTED.encode(), data)
                total += n
        return data, total


def _core(secret: str) -> bytes:
    """The longest run of characters no encoder changes (letters, digits, `_`, `.`, `-`): in every spelling."""
    runs = re.findall(r"[A-Za-z0-9_.-]+", secret)
    return max(runs, key=len).encode() if runs else b""


def _pattern(needle: str) -> bytes:
    raw = re.escape(needle.encode("utf-8"))
    if len(needle) >= LONG:
        return raw
    before = rb"(?<![A-Za-z0-9])" if needle[0].isalnum() else b""
    after = rb"(?![A-Za-z0-9])" if needle[-1].isalnum() else b""
    return before + raw + after


def redact_env(obj: Any) -> Any:
    """A copy with the values of secret-named entries replaced (dict keys and [name, value] pairs alike)."""
    if isinstance(obj, dict):
        return {k: REDACTED if secret_name(k) and isinstance(v, str) and v else redact_env(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if len(obj) == 2 and secret_name(obj[0]) and isinstance(obj[1], str):
            return [obj[0], REDACTED]
        return [redact_env(v) for v in obj]
    return obj
