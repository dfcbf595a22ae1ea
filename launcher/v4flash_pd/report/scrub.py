"""No secret leaves the box in a report: the pass over every file, and the scan that vouches for the result.

`known_secrets` gathers what to look for (redact.py: the router key, secret-named env values of the
plan and of the report's own environment); `scrub_tree` rewrites every regular file of the report
directory with each spelling of each secret replaced (run after every end-to-end variant and last
before packing); `scan_tree` and `scan_tarball` look again, at the directory and at the finished
archive, and list whatever still holds a secret (a file name too), so the report can refuse to call
itself complete. Files are opened without following links: a link planted in the report directory is
never written through.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from v4flash_pd.errors import UserError
from v4flash_pd.report.redact import Redactor, collect
from v4flash_pd.routerauth import read_key

_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK


def known_secrets(router_auth: Sequence[str], env_pairs: Iterable[tuple[str, str]],
                  env: Mapping[str, str]) -> Redactor:
    """Every secret the report could have picked up: the router key (if it can be read), the
    secret-named values of the plan's processes and of `env` (the report's own environment)."""
    keys: list[str] = []
    kind, where = (list(router_auth) + ["", ""])[:2]
    if kind:
        try:
            keys.append(read_key(kind, where, env))
        except UserError:
            pass
    return Redactor(collect([*env_pairs, *env.items()], keys))


def _files(root: Path) -> Iterator[Path]:
    """Every entry under `root` that is not a directory, links included (never followed), sorted."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames + [d for d in dirnames if (base / d).is_symlink()]):
            yield base / name


def _read(path: Path, write: bool = False) -> tuple[int, bytes] | None:
    """(fd, content) of a regular file opened without following a link, or None for anything else."""
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | _OPEN)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    return fd, b"".join(chunks)


def scrub_tree(root: Path, redactor: Redactor) -> list[str]:
    """Replace every spelling of every secret in every regular file under `root`; the files changed.
    Links and special files are left alone (`scan_tree` names them; the tarball leaves them out)."""
    if not redactor:
        return []
    changed = []
    for path in _files(root):
        got = _read(path, write=True)
        if got is None:
            continue
        fd, data = got
        try:
            new, n = redactor.redact(data)
            if n:
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                view = memoryview(new)
                while view:
                    view = view[os.write(fd, view):]
                changed.append(str(path.relative_to(root)))
        finally:
            os.close(fd)
    return changed


def scan_tree(root: Path, redactor: Redactor) -> list[str]:
    """What under `root` still holds a secret, in its name or its content."""
    found = []
    for path in _files(root):
        rel = str(path.relative_to(root))
        if redactor.find(rel.encode("utf-8", "surrogateescape")):
            found.append(f"{rel} (its name)")
            continue
        got = _read(path)
        if got is None:
            continue
        fd, data = got
        os.close(fd)
        if redactor.find(data):
            found.append(rel)
    return found


def scan_tarball(path: Path, redactor: Redactor) -> list[str]:
    """What in the archive at `path` holds a secret (a member's name or content), or is anything but a
    regular file or a directory (a link would point the reader at a file the report never held)."""
    found = []
    with tarfile.open(path, "r:gz") as tar:
        for m in tar:
            if not (m.isfile() or m.isdir()):
                found.append(f"{m.name} (a {'link' if m.issym() or m.islnk() else 'special file'})")
            elif redactor.find(m.name.encode("utf-8", "surrogateescape")):
                found.append(f"{m.name} (its name)")
            elif m.isfile():
                f = tar.extractfile(m)
                if f is not None and redactor.find(f.read()):
                    found.append(m.name)
    return found
