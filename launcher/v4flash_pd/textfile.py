"""Text files a user names (config, topology, cluster plan), the one TOML reader, and the one reader
of records in a directory others can write (a run dir: `status` reads what anyone there can forge).

A file that is missing, a directory, unreadable or not UTF-8 is a UserError naming the file and
the fix, never a traceback. TOML is read by the standard library's `tomllib`, or by its backport
`tomli` on Python 3.10 (a dependency there, declared in pyproject.toml).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from v4flash_pd.errors import UserError


def read_text_file(path: Path, what: str, fix_missing: str) -> str:
    """A user-named text file as str, or a UserError naming what is wrong with it."""
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist", fix_missing) from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory, not a file", "pass the path of the file itself") from None
    except PermissionError:
        raise UserError(f"{what} {path} is not readable (permission denied)",
                        f"make it readable for this user (chmod o+r {path}) or copy it somewhere readable") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}", "check the path and its permissions") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})",
                        "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8), or point at the right file") from None


def toml() -> ModuleType:
    """`tomllib`, or `tomli` on Python 3.10; imported on first use (`plan` of a profile alone never
    parses TOML). Both raise `TOMLDecodeError`, a ValueError."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli

    module: ModuleType = tomli
    return module


MAX_RECORD = 16 << 20  # bytes: the largest run dir record we read (a real selfcheck.json is tens of kB)
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_record(path: Path, limit: int = MAX_RECORD) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, else OSError saying what it is instead.

    Opened non-blocking and checked before a byte is read: a FIFO planted under a record's name would
    otherwise block the reader forever, a device or a huge file would never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", str(path))
        chunks: list[bytes] = []
        size = st.st_size
        if size <= limit:  # read one byte past the limit: a file still growing is caught too
            size = 0
            while size <= limit:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"too large ({size} bytes; a record is at most {limit})", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json_record(path: Path, limit: int = MAX_RECORD) -> Any:
    """`read_record` parsed as JSON: OSError for the file, ValueError for its content (not UTF-8, not
    JSON, or nested too deeply for the parser)."""
    data = read_record(path, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply to be a record") from None
