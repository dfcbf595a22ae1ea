"""The report directory as one .tar.gz next to it (what the operator sends), written safely.

- Only the directory's own files go in: each opened without following a link and packed as what
  it is (a regular file); a link inside the directory is packed as the file it points at only when
  that file is inside the directory too, and left out (and named) otherwise; FIFOs, sockets and
  devices are left out.
- The archive is written to a fresh temporary name (`.<name>.<random>.tmp`, created exclusively, no
  link followed: nothing planted there is written through), synced, then published under its name
  without replacing what is there (unless `force`): an older report is never silently lost.
- A write that fails (a full disk) removes the temporary file and says what to do.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

from v4flash_pd.errors import RuntimeFailure, UserError

_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK


def target(directory: Path) -> Path:
    return directory.with_name(directory.name + ".tar.gz")


def check_target(directory: Path, force: bool) -> None:
    """Refuse up front to overwrite an older tarball (anything at the name: a file, a link, a directory)."""
    out = target(directory)
    if os.path.lexists(out) and not force:
        raise UserError(f"{out} already exists (an older report?); the report's tarball would replace it",
                        f"move it away, pass another --out, or pass --force to replace {out.name}")
    if force and out.is_dir() and not out.is_symlink():
        raise UserError(f"{out} is a directory; --force replaces a tarball, not a directory",
                        "move it away or pass another --out")


@dataclass(frozen=True)
class Packed:
    path: Path
    left_out: tuple[str, ...]  # "name (why)" of what the directory held that the archive does not


def pack(directory: Path, force: bool = False) -> Packed:
    """Pack `directory` (resolved by the caller) into `target(directory)`; RuntimeFailure on a failed write."""
    out = target(directory)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise _write_failure(exc, out, directory) from None
    try:
        with os.fdopen(fd, "wb") as f:
            with tarfile.open(fileobj=f, mode="w:gz") as tar:
                left_out = _add_tree(tar, directory)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, out, force)
    except OSError as exc:
        _unlink(tmp)
        raise _write_failure(exc, out, directory) from None
    except BaseException:
        _unlink(tmp)
        raise
    return Packed(out, tuple(left_out))


def _write_failure(exc: OSError, out: Path, directory: Path) -> RuntimeFailure:
    why = exc.strerror or str(exc)
    fix = (f"free space on that filesystem (df -h {out.parent}) or run the report again with --out on one with room; "
           if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "")
    return RuntimeFailure(f"cannot write the report's tarball {out}: {why}; the report directory {directory} is "
                          "complete and scrubbed, but there is no tarball to send",
                          f"{fix}or pack the directory yourself: tar -C {directory.parent} -czf {out} {directory.name}")


def _publish(tmp: Path, out: Path, force: bool) -> None:
    if force:
        os.replace(tmp, out)  # replaces a link at `out` itself, never what it points at
        return
    try:
        os.link(tmp, out, follow_symlinks=False)  # fails if anything is at `out`: no silent replace
    except FileExistsError:
        raise UserError(f"{out} appeared while the report was written; it was left as it is",
                        "move it away and pack the directory again, or run the report with --force") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(out):  # a filesystem without hard links: check, then rename
            raise UserError(f"{out} appeared while the report was written; it was left as it is",
                            "move it away and run the report again, or pass --force") from None
        os.rename(tmp, out)
        return
    _unlink(tmp)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _add_tree(tar: tarfile.TarFile, directory: Path) -> list[str]:
    root = os.path.realpath(directory)
    left_out: list[str] = []
    info = tar.gettarinfo(root, arcname=directory.name)
    tar.addfile(info)

    def walk(d: Path, arc: str) -> None:
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            name, rel = f"{arc}/{entry.name}", os.path.relpath(entry.path, root)
            if entry.is_symlink():
                real = os.path.realpath(entry.path)
                if not _inside(real, root) or not os.path.isfile(real):
                    left_out.append(f"{rel} (a link to {'outside the report' if not _inside(real, root) else 'no file'})")
                    continue
                _add_file(tar, Path(real), name, left_out, rel)
            elif entry.is_dir(follow_symlinks=False):
                tar.addfile(tar.gettarinfo(entry.path, arcname=name))
                walk(Path(entry.path), name)
            else:
                _add_file(tar, Path(entry.path), name, left_out, rel)

    walk(Path(root), directory.name)
    return left_out


def _add_file(tar: tarfile.TarFile, path: Path, name: str, left_out: list[str], rel: str) -> None:
    if not stat.S_ISREG(os.lstat(path).st_mode):  # never open a FIFO, socket or device
        left_out.append(f"{rel} (not a regular file)")
        return
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            left_out.append(f"{rel} (changed into a link or special file while packing)")
            return
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            left_out.append(f"{rel} (changed into a special file while packing)")
            return
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), stat.S_IMODE(st.st_mode)
        tar.addfile(info, f)  # exactly st_size bytes: a file that grew since is cut there
