"""`cli.forward.command_line`: typed options back to argv that a child `v4flash-pd` (with the same
environment) parses into the same options; what came from a key's V4FLASH_<OPTION> variable stays in
the environment, at its own layer."""

from __future__ import annotations

import os
from typing import Any

import click
from click.testing import CliRunner

from v4flash_pd.cli.forward import command_line
from v4flash_pd.cli.options import Options, RunOptions, pass_options, run_options


def parse(args: list[str], env: dict[str, str] | None = None) -> tuple[Options, RunOptions]:
    got: dict[str, Any] = {}

    @click.command()
    @run_options
    @pass_options(run=True)
    def cmd(opts: Options, how: RunOptions) -> None:
        got["opts"], got["how"] = opts, how

    shell: dict[str, str | None] = {k: None for k in os.environ if k.startswith("V4FLASH_")}  # a developer's shell
    res = CliRunner().invoke(cmd, args, env={**shell, **(env or {})}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return got["opts"], got["how"]


EVERY_OPTION = ["--config", "c.toml", "--profile", "rtx6000-tp4", "--topology", "t.json", "--model", "/m",
                "--numa", "preferred", "--moe", "off", "--sparse-decode", "on", "--set", "a.b=1", "--set", "c=d e",
                "--rehearse", "--cluster-plan", "cp.json", "--box", "0", "--role", "prefill", "--index", "1",
                "--hosts", "h0,h1", "--ready-timeout", "12.5", "--grace", "3", "--verify-model", "full",
                "--eval-questions", "7"]


def test_every_option_round_trips() -> None:
    opts, how = parse(EVERY_OPTION)
    assert opts.flags and opts.sets == ("a.b=1", "c=d e") and opts.box == 0 and not opts.env_flags
    argv = command_line(opts, how, run_fields=("verify_model", "eval_questions"))
    again, how_again = parse(argv)
    assert again == opts
    assert (how_again.verify_model, how_again.eval_questions) == ("full", 7)


def test_only_the_named_run_options_are_forwarded() -> None:
    opts, how = parse(["--run-dir", "r", "--detach", "--eval", "--verify-model", "off"])
    assert command_line(opts, how) == []
    assert command_line(opts, how, run_fields=("verify_model",)) == ["--verify-model", "off"]


def test_an_env_given_key_option_stays_in_the_environment() -> None:
    env = {"V4FLASH_NUMA": "off", "V4FLASH_MOE": "0"}
    opts, how = parse(["--model", "/m"], env)
    assert dict(opts.env_flags) == {"numa": "off", "patches.moe": False}
    argv = command_line(opts, how)
    assert argv == ["--model", "/m"]  # as argv, --numa would outrank a --set numa=... given to the parent
    assert parse(argv, env)[0] == opts


def test_left_out_keys_are_the_callers_to_set() -> None:
    opts, how = parse(["--moe", "off", "--indexer", "on", "--numa", "off"])
    argv = command_line(opts, how, leave_out={"patches.moe", "patches.indexer"})
    assert argv == ["--numa", "off"]
