"""Start an SGLang worker (or the rehearsal stand-in) with the router's API key as its own `--api-key`,
without the key appearing in argv, a .command file, the plan or the worker's log.

sglang-router 0.3.2 started with `--api-key KEY` sends `Authorization: Bearer KEY` to every worker
request it makes (/generate, the OpenAI routes, /server_info, /model_info; /health needs none). A
worker given the same key then refuses anyone else with 401, so the router's key protects the
worker ports too, not just the router's. SGLang takes the key only as `--api-key KEY`, so this
wrapper reads it from its source (`--api-key-file PATH` / `--api-key-env NAME`), drops the variable
from its environment (SGLang's own subprocesses, which run the model's code, do not inherit it),
masks the key in everything the worker writes to stdout/stderr (SGLang logs its server_args,
api_key included), and runs the worker module as `python -m MODULE ARGS --api-key KEY` would, in
this process: the key lives in sys.argv, never in /proc/PID/cmdline.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from typing import Any, Sequence

from v4flash_pd.errors import UserError
from v4flash_pd.routerauth import read_key

MODULE = "v4flash_pd.workerauth"
MASK = "<api-key>"


def entry(module: str, auth: Sequence[str]) -> tuple[str, ...]:
    """What follows `python -m` for a worker: the module itself, or this wrapper around it."""
    kind, where = (list(auth) + ["", ""])[:2]
    if not kind:
        return (module,)
    return (MODULE, f"--api-key-{kind}", where, "--", module)


class _Masked:
    """A text stream that writes everything through, with every occurrence of the secret masked."""

    def __init__(self, stream: Any, secret: str) -> None:
        self._stream = stream
        self._secret = secret

    def write(self, text: str) -> int:
        self._stream.write(text.replace(self._secret, MASK) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def _split(argv: list[str]) -> tuple[str, str, str, list[str]]:
    if len(argv) < 4 or argv[0] not in ("--api-key-file", "--api-key-env") or argv[2] != "--":
        raise UserError("usage: python -m v4flash_pd.workerauth (--api-key-file PATH | --api-key-env NAME) -- MODULE "
                        "ARGS", "this wrapper is started by `v4flash-pd up` for workers behind a router with an API key")
    return argv[0][len("--api-key-"):], argv[1], argv[3], argv[4:]


def check_module(module: str) -> None:
    """The worker module must exist before the key is read and the streams are masked: `runpy` would
    end in an ImportError traceback (a typo in a profile's module, a missing serving stack)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, an empty or relative name
        found = False
    if not found:
        raise UserError(f"no module named {module!r} in {sys.executable} (python -m {MODULE} was asked to run it)",
                        "install the serving stack for this interpreter (pip install '.[serve]'), or check the "
                        "module name; this wrapper is started by `v4flash-pd up`, see `v4flash-pd plan`")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        kind, where, module, rest = _split(argv)
        check_module(module)
        key = read_key(kind, where)
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        sys.exit(2)
    if kind == "env":
        os.environ.pop(where, None)  # SGLang's subprocesses (TP schedulers, compilers) never see it
    sys.stdout = _Masked(sys.stdout, key)
    sys.stderr = _Masked(sys.stderr, key)
    sys.argv = [module, *rest, "--api-key", key]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
