"""Options every command spells the same way (import-light: `status` and `eval` load nothing else)."""

from __future__ import annotations

from typing import Any, Callable

import click


def json_option(help: str = "Print JSON (machine-readable) instead of the table.") -> Callable[[Any], Any]:
    """--json, and the one environment switch every command's JSON output answers to: V4FLASH_JSON."""
    return click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_JSON", help=help)
