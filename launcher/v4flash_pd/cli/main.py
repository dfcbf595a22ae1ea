"""The `v4flash-pd` click group.

Subcommands live one per module (`cmd_<name>.py`, vLLM/click-complex style) and are imported
lazily, so `v4flash-pd plan` does not pay for importing the supervisor or the bundle code.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from v4flash_pd import __version__
from v4flash_pd.errors import UserError

# command name -> module under v4flash_pd.cli (each module exposes `command`)
COMMANDS: dict[str, str] = {
    "plan": "cmd_plan",
    "up": "cmd_up",
    "down": "cmd_down",
    "status": "cmd_status",
    "logs": "cmd_logs",
    "topology": "cmd_topology",
    "doctor": "cmd_doctor",
    "bench": "cmd_bench",
    "eval": "cmd_eval",
    "bundle": "cmd_bundle",
    "render": "cmd_render",
    "selfcheck": "cmd_selfcheck",
    "report": "cmd_report",
}


def _available() -> list[str]:
    import importlib.util  # imported here: `plan` and `up` never list commands (start-up time)

    names = []
    for name, mod in COMMANDS.items():
        if importlib.util.find_spec(f"v4flash_pd.cli.{mod}") is not None:
            names.append(name)
    return names


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_available())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        mod = COMMANDS.get(cmd_name)
        if mod is None:
            return None
        try:
            module = importlib.import_module(f"v4flash_pd.cli.{mod}")
        except ModuleNotFoundError as exc:  # a command left out of this install (not a broken import inside it)
            if exc.name != f"v4flash_pd.cli.{mod}":
                raise
            return None
        command: click.Command = module.command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's whole one-line summary: click would cut it at ~45 characters with '...'."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(__version__, prog_name="v4flash-pd")
@click.option("--debug", is_flag=True, envvar="V4FLASH_DEBUG", help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Serve DeepSeek-V4-Flash with SGLang prefill/decode disaggregation on 8-GPU boxes (one, or a Slurm/k8s cluster)."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one paragraph and exit 2 (usage) or 1 (runtime)."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:]) or \
        os.environ.get("V4FLASH_DEBUG", "").lower() in ("1", "true", "yes", "on")
    try:
        cli.main(args=argv, prog_name="v4flash-pd", standalone_mode=False)
    except UserError as exc:
        if debug:
            raise
        click.echo(exc.render(), err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # a bad option value: the same one-paragraph form as every other error
        where = exc.ctx.command_path if exc.ctx is not None else "v4flash-pd"
        message = " ".join(exc.format_message().split())
        click.echo(UserError(message, f"see `{where} --help` for the accepted values").render(), err=True)
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
