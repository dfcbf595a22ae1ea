"""Start sglang-router 0.3.2 with client authentication whose secret never appears in argv.

The pinned router takes its key only as `--api-key KEY`, which `ps`, /proc/PID/cmdline, the run
dir's `.command` file and `plan` would all show. The plan therefore starts this wrapper with the
key's *source* (`--api-key-file PATH` or `--api-key-env NAME`); it reads the secret, parses the
remaining router argv with the router's own parser and sets the key on the parsed arguments.
With a key set, the router answers 401 to /generate and the OpenAI routes without
`Authorization: Bearer KEY` (health and readiness stay open for probes).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Mapping, Sequence

from v4flash_pd.errors import UserError

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def read_key(kind: str, where: str, env: Mapping[str, str] | None = None) -> str:
    """The secret from ("file", path) or ("env", NAME): exactly one non-empty line of printable ASCII
    (a trailing newline is fine); anything else is a UserError that never shows the content.

    A second line would go into the `Authorization` header, where the HTTP client refuses it with an
    error that quotes the header (key included) into logs and state; so would a control character."""
    env = os.environ if env is None else env
    if kind == "file":
        try:
            raw = Path(where).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the router API key file {where}: "
                            f"{getattr(exc, 'strerror', None) or type(exc).__name__}",
                            "create it with the key on one line, readable by the launcher only (chmod 600)") from None
        what, fix = f"the router API key file {where}", f"write the key alone on one line into {where}"
    elif kind == "env":
        raw = env.get(where, "")
        what = f"${where} (router.api_key_env)"
        fix = f"export {where}=<key> (one line) before `up`, or use router.api_key_file"
    else:
        raise UserError(f"unknown API key source {kind!r}", "use router.api_key_file or router.api_key_env")
    body = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
    key = body.strip(" ")
    if not key:
        raise UserError(f"{what} is empty" if kind == "file" else
                        f"router.api_key_env names ${where}, which is not set or empty", fix)
    lines = len(_LINE_BREAK.split(body))
    if lines > 1:
        raise UserError(f"{what} holds {lines} lines; the key must be exactly one non-empty line", fix)
    bad = next((c for c in key if not " " <= c <= "~"), None)
    if bad is not None:
        raise UserError(f"{what} holds a character that cannot go into an HTTP header ({_char(bad)}); the key must "
                        "be one line of printable ASCII", fix)
    return key


def _char(c: str) -> str:
    return f"U+{ord(c):04X}" if ord(c) > 0x7E else repr(c)


def auth_headers(router_auth: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Headers a client (the readiness smoke request, eval, bench) sends to a router planned with auth."""
    kind, where = (list(router_auth) + ["", ""])[:2]
    if not kind:
        return {}
    return {"Authorization": f"Bearer {read_key(kind, where, env)}"}


def _split(argv: list[str]) -> tuple[str, str, list[str]]:
    if len(argv) < 3 or argv[0] not in ("--api-key-file", "--api-key-env") or argv[2] != "--":
        raise UserError("usage: python -m v4flash_pd.routerauth (--api-key-file PATH | --api-key-env NAME) -- ROUTER-ARGS",
                        "this wrapper is started by `v4flash-pd up`; see `v4flash-pd plan`")
    return ("file" if argv[0] == "--api-key-file" else "env"), argv[1], argv[3:]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        kind, where, rest = _split(argv)
        key = read_key(kind, where)
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        sys.exit(2)
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(rest)
    args.api_key = key
    launch_router(args)


if __name__ == "__main__":
    main()
