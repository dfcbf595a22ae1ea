"""Typed options back as a command line, for a child `v4flash-pd` command (`report` runs `doctor`
and one `up` per variant with the options it was given).

The child inherits this process's environment, so a config key's option that came from its
V4FLASH_<OPTION> variable (`Options.env_flags`) reaches the child there, at the same layer below
`--set`; it is not repeated as argv, where it would outrank `--set`. Everything else is written out:
a key given on the command line as its own flag, and every other option that has a value as the
option it was parsed from (an environment-given `--config` or `--rehearse` says to the child what
its environment already says). Option names come from the click decorators themselves, so a new
option needs no entry here.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Collection

import click

from v4flash_pd.cli.options import Options, RunOptions, run_options
from v4flash_pd.config.keys import KEY


def _option_flags() -> dict[str, str]:
    """click parameter name -> its long option (`config_file` -> `--config`), for `up`'s options."""
    def probe(**_: Any) -> None:
        return None

    params = getattr(run_options(probe), "__click_params__", [])
    return {p.name: next(o for o in p.opts if o.startswith("--")) for p in params
            if isinstance(p, click.Option) and p.name}


def _words(flag: str, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, tuple):
        return [w for item in value for w in (flag, str(item))]
    return [flag, str(value)]


def _key_words(path: str, value: Any) -> list[str]:
    flag = KEY[path].flag
    assert flag is not None, f"{path} has no option"
    if isinstance(value, bool):
        return [flag.name, "on" if value else "off"]
    return [flag.name, str(value)]


def command_line(opts: Options, how: RunOptions | None = None, run_fields: Collection[str] = (),
                 leave_out: Collection[str] = ()) -> list[str]:
    """`opts` (and the `run_fields` of `how`) as argv that makes a child with this environment
    resolve the same options; `leave_out`: config keys (dotted) the caller sets itself."""
    flag_of = _option_flags()
    out: list[str] = []
    for f in fields(Options):
        if f.name not in ("flags", "env_flags"):
            out += _words(flag_of[f.name], getattr(opts, f.name))
    for path, value in opts.flags:
        if path not in leave_out:
            out += _key_words(path, value)
    if how is not None:
        for name in run_fields:
            out += _words(flag_of[name], getattr(how, name))
    return out
