"""Hand the options a command was given on its command line to a child `v4flash-pd` command.

Options that came from the environment reach the child through its (inherited) environment, so
only COMMANDLINE-sourced values are turned back into argv, and only the ones the caller names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import click
from click.core import ParameterSource


def option_names(decorator: Callable[[Callable[..., Any]], Callable[..., Any]]) -> set[str]:
    """The parameter names a click option decorator (e.g. `run_options`) adds."""
    def probe(**_: Any) -> None:
        return None

    decorated = decorator(probe)
    return {p.name for p in getattr(decorated, "__click_params__", []) if p.name}


def forwarded_args(ctx: click.Context, names: Iterable[str]) -> list[str]:
    wanted = set(names)
    out: list[str] = []
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name not in wanted:
            continue
        if ctx.get_parameter_source(p.name) != ParameterSource.COMMANDLINE:
            continue
        flag = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        value = ctx.params[p.name]
        if p.is_flag:
            if value:
                out.append(flag)
        elif p.multiple:
            for item in value:
                out += [flag, str(item)]
        elif value is not None:
            out += [flag, str(value)]
    return out
