"""Is the serving stack installed where the workers will run? Checked before a real `up` starts.

`pip install .` gives the launcher alone; SGLang, torch and NIXL come with the `[serve]` extra (or the
image). Without them a real `up` started workers that died at once with ModuleNotFoundError, after
the run dir, the ports and the router were set up: refuse first, and say how to install it.
"""

from __future__ import annotations

import json
import subprocess
import sys

# What a worker imports first (module, the package that provides it).
CORE = (("sglang", "sglang==0.5.13.post1"), ("torch", "torch==2.11.0"))
NIXL = ("nixl_cu13", "nixl-cu13==1.5.1")
_PROBE = ("import importlib.util, json, sys; "
          "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]))")


def missing(python: str, nixl: bool) -> list[str] | None:
    """Packages `python` lacks of the serving stack ([] = all there); None when `python` cannot be asked."""
    wanted = CORE + ((NIXL,) if nixl else ())
    modules = [m for m, _ in wanted]
    gone: object
    if python in ("", sys.executable):
        import importlib.util

        gone = [m for m in modules if importlib.util.find_spec(m) is None]
    else:
        try:
            res = subprocess.run([python, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=60)
            gone = json.loads(res.stdout) if res.returncode == 0 else None
        except (OSError, ValueError, subprocess.TimeoutExpired):
            gone = None
    if not isinstance(gone, list):
        return None
    return [pkg for m, pkg in wanted if m in gone]
