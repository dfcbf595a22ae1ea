"""Turn a planned SGLang worker command into the rehearsal command (pure).

The plan is the single place that assembles argv; `--rehearse` must change nothing but the
program, so this swaps exactly the `-m sglang.launch_server` module and keeps every prefix
(numactl, env wrappers, the interpreter) and every SGLang flag as planned.
"""

from __future__ import annotations

from typing import Sequence

from v4flash_pd.rehearsal import ENGINE_MODULE

SGLANG_MODULE = "sglang.launch_server"


def standin_argv(argv: Sequence[str], python: str | None = None) -> list[str]:
    """`[..., PY, "-m", "sglang.launch_server", *flags]` -> `[..., PY', "-m", ENGINE_MODULE, *flags]`.

    `python` replaces the interpreter in front of `-m` when given (e.g. sys.executable when the
    planned interpreter lacks this package). Raises ValueError when argv does not run SGLang's
    server module, so a plan change cannot silently start a real engine in a rehearsal.
    """
    out = list(argv)
    for i in range(1, len(out) - 1):
        if out[i] == "-m" and out[i + 1] == SGLANG_MODULE:
            out[i + 1] = ENGINE_MODULE
            if python is not None:
                out[i - 1] = python
            return out
    raise ValueError(f"not an SGLang server command (no '-m {SGLANG_MODULE}'): {list(argv)!r}")
