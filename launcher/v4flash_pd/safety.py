"""Values that travel into a shell script, a manifest or another program's argv: refuse the unsafe ones.

A rendered sbatch script or Kubernetes manifest is read by a shell, sbatch's `#SBATCH` scanner or a
YAML parser, none of which sees our quoting intent: one newline in an image name turns the rest of a
header comment into a command and ends the `#SBATCH` block. So every string that reaches a rendered
file must be free of control characters, and `#SBATCH` values, which stand unquoted, must also be
free of shell metacharacters (host names are checked with the config: config/values.py). Each
refusal is a UserError naming the value and the key it came from, raised before anything is written
or started.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from v4flash_pd.errors import UserError

# What sbatch directives take (partition lists, times like 1-00:00:00, accounts, job names).
_SBATCH = re.compile(r"[A-Za-z0-9._:,@+%/=-]+")


def control_chars(text: str) -> list[str]:
    """The control characters (C0, DEL, C1, Unicode line/paragraph separators) in `text`, as escapes;
    lone surrogates (undecodable bytes smuggled through argv) count too: no file format keeps them."""
    bad = []
    for ch in text:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o <= 0x9F or ch in "\u2028\u2029" or 0xD800 <= o <= 0xDFFF:
            esc = ascii(ch)[1:-1]
            if esc not in bad:
                bad.append(esc)
    return bad


def escape_controls(text: str) -> str:
    """`text` with each control character (as `control_chars` counts them) written as its escape: what
    a file others can write says, shown on a terminal without letting it drive the terminal."""
    return "".join(ascii(ch)[1:-1] if control_chars(ch) else ch for ch in text)


def check_text(value: str, what: str, fix: str = "") -> str:
    """`value` unchanged, or a UserError when it holds a control character."""
    bad = control_chars(value)
    if bad:
        raise UserError(f"{what} = {ascii(value)} contains control character(s) {', '.join(bad)}, which would "
                        "break the line it is written on (a newline in a rendered script starts a new command)",
                        fix or f"remove them from {what}")
    return value


def strings(obj: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, string) for every string in a raw config tree, keys included."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            yield f"{sub} (the key itself)", str(k)
            yield from strings(v, sub)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from strings(v, f"{path}.{i}")
    elif isinstance(obj, str):
        yield path, obj


def check_tree(raw: Any, what: str = "config key") -> None:
    """Every string of a raw config tree free of control characters (it is written into a rendered file)."""
    for key, value in strings(raw):
        check_text(value, f"{what} {key}", f"remove the control characters from {key} (--set {key.split(' ')[0]}=...)")


def check_values(items: Iterable[tuple[str, str]]) -> None:
    """(option name, value) pairs that a renderer writes out: free of control characters."""
    for name, value in items:
        check_text(value, name, f"pass {name} without control characters")


def check_sbatch(name: str, value: str) -> str:
    """A value written after `#SBATCH --name=`: one word of the characters sbatch options take."""
    if value and not _SBATCH.fullmatch(value):
        raise UserError(f"{name} {ascii(value)} has characters an #SBATCH directive does not take (whitespace, quotes, "
                        "';', '|', '&', '$', backticks or control characters)",
                        f"pass a plain {name} value, e.g. {name} gpu (letters, digits and . _ : , @ + % / = -)")
    return value
