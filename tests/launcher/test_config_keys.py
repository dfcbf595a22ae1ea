"""The key table (config/keys.py) is the one place a config key is declared: every key has a type,
a default its own check accepts (or refuses, for keys that must be set), a check, help, and its flag
(where it has one) on exactly the commands of its group; and build_config reads every key."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import click
import pytest

from v4flash_pd.cli import cmd_doctor, cmd_plan, cmd_render, cmd_up
from v4flash_pd.config import keys
from v4flash_pd.config.build import build_config
from v4flash_pd.config.keys import DEFAULTS, KEY, KEYS, ROLES, WORKER_DEFAULTS, WORKER_KEY, WORKER_KEYS, Key
from v4flash_pd.config.layers import merged_layers
from v4flash_pd.config.values import Integer
from v4flash_pd.errors import UserError

ALL = [(k, False) for k in KEYS] + [(k, True) for k in WORKER_KEYS]
GROUPS = {"config": ("plan", "up", "doctor", "render slurm", "render k8s"),
          "cluster": ("plan", "render slurm", "render k8s"), "hosts": ("plan", "up", "doctor"), "run": ("up", "doctor")}
COMMANDS: dict[str, click.Command] = {"plan": cmd_plan.command, "up": cmd_up.command, "doctor": cmd_doctor.command,
                                      "render slurm": cmd_render.slurm, "render k8s": cmd_render.k8s}


@pytest.mark.parametrize("key, worker", ALL, ids=[("worker." if w else "") + k.path for k, w in ALL])
def test_every_key_has_type_default_check_and_help(key: Key, worker: bool) -> None:
    assert isinstance(key.type, type) and callable(key.check) and key.help.strip()
    if key.required:
        with pytest.raises(UserError):  # a placeholder the check refuses: the key must be set
            key.check(key.default, key.path)
    elif key.default is None:
        assert key.optional, f"{key.path}: only an optional key defaults to None (unset)"
    else:
        assert isinstance(key.check(key.default, key.path), key.type), key.path
    if key.choices:
        assert key.default is None or key.default in key.choices
        with pytest.raises(UserError):
            key.check("no-such-choice", key.path)


def _paths(table: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, value in table.items():
        if isinstance(value, dict) and name != "env" and not name.startswith("router.env"):
            out |= _paths(value, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def test_the_defaults_layer_is_exactly_the_declared_keys() -> None:
    top = {k: v for k, v in DEFAULTS.items() if k not in ROLES}
    assert _paths(top) == {k.path for k in KEYS}
    assert all(DEFAULTS[role] == [] for role in ROLES)
    assert set(WORKER_DEFAULTS) == set(WORKER_KEY)
    assert len(KEY) == len(KEYS) and len(WORKER_KEY) == len(WORKER_KEYS)


@pytest.mark.parametrize("key", [k for k in KEYS if k.flag is not None], ids=lambda k: k.path)
def test_every_flag_is_on_exactly_the_commands_of_its_group(key: Key) -> None:
    flag = key.flag
    assert flag is not None and flag.name.startswith("--") and flag.env.startswith("V4FLASH_") and flag.help
    want = GROUPS[flag.group]
    for name, cmd in COMMANDS.items():
        found = [p for p in cmd.params if isinstance(p, click.Option) and flag.name in p.opts]
        if name in want:
            assert len(found) == 1 and found[0].envvar == flag.env, (name, flag.name)
        else:
            assert not found, f"{flag.name} is on `{name}`, which is not in group {flag.group}"


def _spy(table: dict[str, Key], seen: set[str], prefix: str) -> Callable[[Key], Key]:
    def wrap(key: Key) -> Key:
        def check(value: Any, where: str) -> Any:
            seen.add(prefix + key.path)
            return key.check(value, where)
        return replace(key, check=check)
    return wrap


def test_build_config_reads_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key is declared without a consumer: each one's check runs for some built-in config."""
    seen: set[str] = set()
    for table, prefix in ((KEY, ""), (WORKER_KEY, "worker.")):
        wrap = _spy(table, seen, prefix)
        for path, key in list(table.items()):
            monkeypatch.setitem(table, path, wrap(key))
    for profile, role in (("rtx6000-8x-pd", "decode"), ("rtx6000-tp4", "server")):
        sets = ("sparse_decode=true", f"{role}.0.mem_fraction_static=0.6", "speculative.num_steps=2",
                "speculative.num_draft_tokens=3")
        build_config(*merged_layers(profile=profile, env={}, sets=sets))
    assert seen == {k.path for k in KEYS} | {f"worker.{k.path}" for k in WORKER_KEYS}
    assert keys.KEY is KEY  # the spies sat in the table build_config reads


@pytest.mark.parametrize("item, needle", [
    ("cluster.prefill=abc", "cluster.prefill must be a number of prefill workers"),
    ("prefill.0.tp=abc", "prefill.0.tp must be a positive integer"),
    ("prefill=5", "prefill must be a list of tables"),
    ("cluster=5", "cluster must be a table"),
])
def test_render_k8s_lays_pods_out_from_the_checked_config(tmp_path, cli, item: str, needle: str) -> None:
    """The pod layout reads the checked config, so a bad value is the key's own error, not a traceback."""
    res = cli("render", "k8s", "-o", str(tmp_path / "k.yaml"), "--set", item)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "k.yaml").exists()


@pytest.mark.parametrize("key", [k for k in KEYS if k.flag is not None and k.type is int], ids=lambda k: k.path)
def test_an_integer_flag_takes_the_range_of_its_key(key: Key) -> None:
    """One declaration per bound: the flag refuses above exactly where `--set`/a config file refuse."""
    assert isinstance(key.check, Integer), f"{key.path}: declare its range with values.integer"
    flag = key.flag
    assert flag is not None
    option = next(p for cmd in COMMANDS.values() for p in cmd.params
                  if isinstance(p, click.Option) and flag.name in p.opts)
    assert isinstance(option.type, click.IntRange)
    assert option.type.max == key.check.high
    assert option.type.min == max(key.check.low, flag.low if flag.low is not None else key.check.low)
    if key.check.high is not None:
        key.parse(key.check.high)
        with pytest.raises(UserError, match=f"must be <= {key.check.high}"):
            key.parse(key.check.high + 1)
