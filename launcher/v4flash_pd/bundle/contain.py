"""Paths inside a bundle: which names are allowed, and proof that a name stays inside the bundle.

A bundle arrives from the other side of an air gap, so every name in it (SHA256SUMS lines, the
paths MANIFEST.json declares) is untrusted input. A name is accepted only if it is a plain
relative POSIX path (no `..`, no `.`, no empty part, nothing absolute) and, once resolved on
disk, still lies under the bundle root: a symlinked directory cannot redirect it. The walk never
follows a link and never opens anything that is not a regular file; a FIFO would block the
reader forever, and a device or socket is never something `create` wrote.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

# SHA256SUMS is one path per line; coreutils escapes a name with a backslash or newline, and a
# name we cannot round-trip through that format is not one `create` ever writes.
_FORBIDDEN_CHARS = ("\0", "\n", "\r", "\\")
# Top-level files (SHA256SUMS, its signature, MANIFEST.json) are read whole; a bundle's are KBs.
SMALL_FILE_LIMIT = 64 << 20


def rel_problem(rel: str) -> str | None:
    """Why `rel` is not an acceptable bundle-relative name, or None when it is. Pure."""
    if not rel:
        return "is empty"
    if any(c in rel for c in _FORBIDDEN_CHARS):
        return "contains a backslash, newline or NUL"
    if rel.startswith("/"):
        return "is an absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return "climbs out of the bundle with `..`"
    if "." in parts or "" in parts:
        return "is not a normalized path (`.` or an empty part)"
    return None


def inside(root: Path, rel: str) -> Path:
    """`root/rel` resolved, after proving it stays under `root`; ValueError says why it does not."""
    problem = rel_problem(rel)
    if problem is not None:
        raise ValueError(f"{rel!r} {problem}")
    base = root.resolve()
    target = (base / rel).resolve()
    if target != base and base not in target.parents:
        raise ValueError(f"{rel!r} resolves to {target}, outside the bundle (through a symlink)")
    if target != base / rel:
        raise ValueError(f"{rel!r} goes through a symlink (resolves to {target})")
    return target


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


@dataclass(frozen=True)
class Tree:
    """What is on disk under a bundle root, found without following any link."""

    files: frozenset[str]  # regular files
    refused: tuple[tuple[str, str], ...]  # (path, kind) of symlinks and special files, sorted

    def kind_of(self, rel: str) -> str | None:
        return dict(self.refused).get(rel)


def walk(root: Path) -> Tree:
    """Every regular file under `root` as a relative POSIX path, plus everything that is refused.

    Symlinks (to files or directories) are listed, never descended; directories are only
    traversed, so an empty directory is not an entry.
    """
    files: set[str] = set()
    refused: list[tuple[str, str]] = []
    stack = [""]
    while stack:
        prefix = stack.pop()
        try:
            entries = sorted(os.scandir(root / prefix if prefix else root), key=lambda e: e.name)
        except OSError as exc:  # an unreadable directory hides what is in it: refuse, do not guess
            refused.append((prefix.rstrip("/") or ".", f"an unreadable directory ({exc.strerror})"))
            continue
        for entry in entries:
            rel = f"{prefix}{entry.name}"
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                refused.append((rel, f"unreadable ({exc.strerror})"))
                continue
            if stat.S_ISDIR(mode):
                stack.append(rel + "/")
            elif stat.S_ISREG(mode):
                files.add(rel)
            else:
                refused.append((rel, _kind(mode)))
    return Tree(frozenset(files), tuple(sorted(refused)))


def read_regular(path: Path, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The bytes of `path`, which must be a regular file reached without following a final symlink.

    O_NONBLOCK so that a FIFO swapped in after the walk is refused instead of blocking the read.
    OSError for unreadable files; ValueError for wrong kinds and oversized files.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"is {_kind(st.st_mode)}")
        if st.st_size > limit:
            raise ValueError(f"is {st.st_size} bytes, more than the {limit >> 20} MiB such a file can be")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit + 1)
    finally:
        os.close(fd)
