"""Text files a user names (config, topology, cluster plan) and the one TOML reader.

A file that is missing, a directory, unreadable or not UTF-8 is a UserError naming the file and
the fix, never a traceback. TOML is read by the standard library's `tomllib`, or by its backport
`tomli` on Python 3.10 (a dependency there, declared in pyproject.toml).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

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
