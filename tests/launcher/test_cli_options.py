"""Options every command shares are spelled one way: --json answers to V4FLASH_JSON everywhere."""

from __future__ import annotations

import importlib

import click

from v4flash_pd.cli.main import COMMANDS


def _commands() -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = []
    for name, mod in COMMANDS.items():
        cmd = importlib.import_module(f"v4flash_pd.cli.{mod}").command
        if isinstance(cmd, click.Group):
            out += [(f"{name} {sub}", c) for sub, c in cmd.commands.items()]
        out.append((name, cmd))
    return out


def test_every_json_flag_answers_to_one_variable() -> None:
    found = {}
    for name, cmd in _commands():
        for p in cmd.params:
            if isinstance(p, click.Option) and "--json" in p.opts:
                found[name] = p.envvar
    assert {"plan", "status", "topology", "doctor", "eval", "bench"} <= set(found)
    assert set(found.values()) == {"V4FLASH_JSON"}, found
