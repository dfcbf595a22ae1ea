"""No secret leaves the box in a report: the router key (by value) and secret-looking env values.

`secrets` collects the exact strings to look for (the router key the plan names, and the values of
environment entries whose names say they are secret); `redact_env` blanks such entries in JSON we
copy (plans, configs); `scrub_tree` is the last pass over every file before the tarball: any file
that still contains a secret has it replaced, and the count is reported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from v4flash_pd.errors import UserError
from v4flash_pd.routerauth import read_key

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)(_|$)")
MIN_SECRET_LEN = 6  # shorter values would redact ordinary words


def secret_name(name: object) -> bool:
    """An environment variable name that says its value is a secret (HF_TOKEN, OPENAI_API_KEY, ...)."""
    return isinstance(name, str) and name.isupper() and SECRET_NAME.search(name) is not None


def secrets(router_auth: Sequence[str], env_pairs: Iterable[tuple[str, str]] = (),
            env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    found = []
    kind, where = (list(router_auth) + ["", ""])[:2]
    if kind:
        try:
            found.append(read_key(kind, where, env))
        except UserError:
            pass
    for k, v in env_pairs:
        if secret_name(k) and v and len(v) >= MIN_SECRET_LEN:
            found.append(v)
    return sorted({s for s in found if len(s) >= MIN_SECRET_LEN}, key=len, reverse=True)


def redact_env(obj: Any) -> Any:
    """A copy with the values of secret-named environment entries replaced (pairs and dicts alike)."""
    if isinstance(obj, dict):
        return {k: REDACTED if secret_name(k) and isinstance(v, str) and v else redact_env(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if len(obj) == 2 and secret_name(obj[0]) and isinstance(obj[1], str):
            return [obj[0], REDACTED]
        return [redact_env(v) for v in obj]
    return obj


def scrub_tree(root: Path, values: Sequence[str]) -> list[str]:
    """Replace every occurrence of `values` in every file under `root`; returns the files changed."""
    if not values:
        return []
    needles = [v.encode() for v in values]
    changed = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        data = path.read_bytes()
        new = data
        for n in needles:
            new = new.replace(n, REDACTED.encode())
        if new != data:
            path.write_bytes(new)
            changed.append(str(path.relative_to(root)))
    return changed
