"""Read the stack lock (`stack.lock`) and the human-edited pins (`stack.toml`).

The lock is the single source of every version in the serving stack: the image, the dev shell,
the wheelhouse, the bundle SBOM and `doctor`'s version checks all read it through this module so
they cannot disagree about what "the pinned stack" is. It runs on hosts that have nothing but the
launcher installed (Python >= 3.10: TOML through tomllib, or the declared tomli backport on 3.10).

The lock is a pip requirements file (``name[extras]==version --hash=sha256:...`` entries, written
by ``make lock``) so ``pip install --require-hashes -r stack.lock`` consumes it unchanged. Header
comments of the form ``# key: value`` carry metadata (python, platform, the stack.toml hash).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from v4flash_pd.errors import UserError
from v4flash_pd.textfile import toml

LOCK_ENV = "V4FLASH_STACK_LOCK"
PINS_ENV = "V4FLASH_STACK_TOML"
LOCK_NAME = "stack.lock"
PINS_NAME = "stack.toml"

_REQ_RE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(?:\[(?P<extras>[^\]]*)\])?"
    r"\s*==\s*(?P<version>[^\s;\\]+)"
    r"\s*(?:;\s*(?P<marker>[^\\]+?))?\s*$"
)
_HASH_RE = re.compile(r"--hash[= ](?P<algo>sha256):(?P<hex>[0-9a-f]{64})")
_HEADER_RE = re.compile(r"^#\s*(?P<key>[a-z][a-z0-9_-]*)\s*:\s*(?P<value>.*?)\s*$")


def normalize(name: str) -> str:
    """PEP 503 name normalisation, so `Flashinfer_Python` and `flashinfer-python` are one key."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class LockedPackage:
    """One pinned distribution: exact version plus every acceptable wheel/sdist sha256."""

    name: str
    version: str
    hashes: tuple[str, ...]
    extras: tuple[str, ...] = ()
    marker: str = ""

    @property
    def requirement(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{extras}=={self.version}"


@dataclass(frozen=True)
class StackLock:
    """The parsed lock; `sha256` is of the file bytes, the identity the image label carries."""

    path: Path
    sha256: str
    packages: tuple[LockedPackage, ...]
    header: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> LockedPackage | None:
        key = normalize(name)
        for pkg in self.packages:
            if pkg.name == key:
                return pkg
        return None

    def versions(self) -> dict[str, str]:
        return {p.name: p.version for p in self.packages}


def _repo_root() -> Path | None:
    """The checkout this module was imported from, if it is one (editable or PYTHONPATH use)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    return None


def _packaged(name: str) -> Path | None:
    candidate = Path(__file__).resolve().parent / "_data" / name
    return candidate if candidate.is_file() else None


def _find(name: str, env: str) -> Path:
    override = os.environ.get(env)
    if override:
        path = Path(override)
        if not path.is_file():
            raise UserError(
                f"{env}={override} does not name a readable file",
                f"point {env} at a {name} (or unset it to use the one shipped with v4flash-pd)",
            )
        return path
    shipped = _packaged(name)
    if shipped is not None:
        return shipped
    root = _repo_root()
    if root is not None and (root / name).is_file():
        return root / name
    raise UserError(
        f"no {name} found: not in ${env}, not shipped in the installed v4flash-pd package, "
        "and not next to pyproject.toml",
        f"set {env}=/path/to/{name}, or reinstall v4flash-pd from a wheel built with `make wheel`",
    )


def find_lock_path() -> Path:
    """$V4FLASH_STACK_LOCK, else the copy shipped in the package, else the checkout's stack.lock."""
    return _find(LOCK_NAME, LOCK_ENV)


def find_pins_path() -> Path:
    """$V4FLASH_STACK_TOML, else the shipped copy, else the checkout's stack.toml."""
    return _find(PINS_NAME, PINS_ENV)


def parse_lock(text: str) -> tuple[tuple[LockedPackage, ...], dict[str, str]]:
    """Pure parser for the requirements-format lock; raises ValueError naming the bad line."""
    header: dict[str, str] = {}
    # Join backslash continuations into logical lines, keeping the first physical line number.
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf:
            start = lineno
            stripped = line.strip()
            if not stripped:
                continue
            if stripped.startswith("#"):
                m = _HEADER_RE.match(stripped)
                if m and not logical:
                    header.setdefault(m.group("key"), m.group("value"))
                continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        logical.append((start, buf.split(" #", 1)[0].strip()))
        buf = ""
    if buf:
        logical.append((start, buf.strip()))

    packages: list[LockedPackage] = []
    seen: set[str] = set()
    for lineno, line in logical:
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):  # pip options such as --index-url: not packages
            continue
        spec = _HASH_RE.sub("", line).strip()
        m = _REQ_RE.match(spec)
        if m is None:
            raise ValueError(f"line {lineno}: not a `name==version --hash=...` entry: {line[:120]}")
        hashes = tuple(f"{h.group('algo')}:{h.group('hex')}" for h in _HASH_RE.finditer(line))
        if not hashes:
            raise ValueError(f"line {lineno}: {m.group('name')} has no --hash (the lock must be hashed)")
        name = normalize(m.group("name"))
        if name in seen:
            raise ValueError(f"line {lineno}: {name} is listed twice")
        seen.add(name)
        extras = tuple(sorted(e.strip() for e in (m.group("extras") or "").split(",") if e.strip()))
        packages.append(
            LockedPackage(name, m.group("version"), hashes, extras, (m.group("marker") or "").strip())
        )
    return tuple(packages), header


def load_lock(path: Path | str | None = None) -> StackLock:
    """Parse the lock; malformed files are a UserError (someone hand-edited it: regenerate)."""
    lock_path = Path(path) if path is not None else find_lock_path()
    try:
        data = lock_path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {lock_path}: {exc.strerror}", "check the path and permissions") from exc
    try:
        packages, header = parse_lock(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{lock_path} is not a valid stack lock: {exc}",
            "regenerate it with `make lock` (never edit stack.lock by hand; edit stack.toml)",
        ) from exc
    return StackLock(lock_path, hashlib.sha256(data).hexdigest(), packages, header)


# --- stack.toml -------------------------------------------------------------------------------


def parse_pins_toml(text: str) -> dict[str, dict[str, object]]:
    """stack.toml as tables (TOML through the one reader: tomllib, or tomli on Python 3.10)."""
    data: dict[str, dict[str, object]] = toml().loads(text)
    return data


def load_stack_toml(path: Path | str | None = None) -> dict[str, dict[str, object]]:
    pins_path = Path(path) if path is not None else find_pins_path()
    try:
        return parse_pins_toml(pins_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {pins_path}: {exc.strerror}", "check the path") from exc
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise UserError(f"{pins_path} is not valid TOML: {exc}", "fix the file (see docs/environment.md)") from exc


def load_pins(path: Path | str | None = None) -> dict[str, str]:
    """The human-chosen top-level pins, {normalised name: version}, from stack.toml's [pins]."""
    pins_path = Path(path) if path is not None else find_pins_path()
    data = load_stack_toml(pins_path)
    pins = data.get("pins")
    if not isinstance(pins, dict) or not pins:
        raise UserError(f"{pins_path} has no [pins] table", 'add `[pins]` with `name = "version"` lines')
    return {normalize(k): str(v) for k, v in pins.items()}


def pin_extras(path: Path | str | None = None) -> dict[str, tuple[str, ...]]:
    """Extras requested for pins (e.g. flashinfer-python -> ("cu13",)), from stack.toml's [extras]."""
    data = load_stack_toml(path)
    extras = data.get("extras") or {}
    return {normalize(k): tuple(v) for k, v in dict(extras).items()}  # type: ignore[arg-type]


def pin_requirements(path: Path | str | None = None) -> list[str]:
    """The pins as requirement strings (`flashinfer-python[cu13]==0.6.12`), for the resolver."""
    pins, extras = load_pins(path), pin_extras(path)
    out = []
    for name, version in pins.items():
        ex = extras.get(name, ())
        out.append(f"{name}{'[' + ','.join(ex) + ']' if ex else ''}=={version}")
    return out
