"""Values that travel into a shell script, a manifest or another program's argv: refuse the unsafe ones.

A rendered sbatch script or Kubernetes manifest is read by a shell, sbatch's `#SBATCH` scanner or a
YAML parser, none of which sees our quoting intent: one newline in an image name turns the rest of a
header comment into a command and ends the `#SBATCH` block. So every string that reaches a rendered
file must be free of control characters, and the few values that stand unquoted (host names,
`#SBATCH` values) must also be free of shell metacharacters. Each refusal is a UserError naming the
value and the key it came from, raised before anything is written or started.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

from v4flash_pd.errors import UserError

# A host name (RFC 1123 labels, plus '_' which some clusters use), an IPv4 literal, or an IPv6 literal
# with an optional zone id (fe80::1%eth0): nothing a shell or a URL would read as syntax.
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(?:%[A-Za-z0-9_.-]+)?")
# What sbatch directives take (partition lists, times like 1-00:00:00, accounts, job names).
_SBATCH = re.compile(r"[A-Za-z0-9._:,@+%/=-]+")
# Variables the launcher, the interpreter or the dynamic loader read for themselves: a secret kept in
# one of them is not a secret (PATH is in every `env` dump) or changes what runs (LD_PRELOAD).
_RESERVED_ENV = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "TERM", "TMPDIR", "LANG", "TZ",
                 "HOSTNAME", "IFS", "PS1", "PS4", "ENV", "BASH_ENV", "MAIL", "DISPLAY", "SSH_AUTH_SOCK"}
_RESERVED_ENV_PREFIXES = ("LD_", "LC_", "PYTHON", "CUDA_", "NCCL_", "UCX_", "HF_", "SGLANG_",
                          "TRANSFORMERS_", "TORCH", "TRITON_", "NVIDIA_", "SLURM_", "KUBERNETES_", "DYLD_",
                          "MALLOC_", "GLIBC_", "BASH_FUNC_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


def check_host(value: str, key: str) -> str:
    """A bare host name or IP literal; shell metacharacters (`;`, backticks, `$`) are refused."""
    if not _HOST.fullmatch(value):
        raise UserError(f"config key {key} = {ascii(value)} is not a host name or IP address (only letters, digits, "
                        "'.', '-', '_' and, for IPv6, ':' and a %zone)",
                        f"write a bare host, e.g. {key.split('[')[0]} = \"node1\" or \"10.0.0.1\" (no scheme, port, "
                        "path, spaces or shell characters)")
    return value


def check_sbatch(name: str, value: str) -> str:
    """A value written after `#SBATCH --name=`: one word of the characters sbatch options take."""
    if value and not _SBATCH.fullmatch(value):
        raise UserError(f"{name} {ascii(value)} has characters an #SBATCH directive does not take (whitespace, quotes, "
                        "';', '|', '&', '$', backticks or control characters)",
                        f"pass a plain {name} value, e.g. {name} gpu (letters, digits and . _ : , @ + % / = -)")
    return value


def check_key_env(name: str, key: str) -> str:
    """The name of the variable holding the router's API key: a plain name that nothing else reads."""
    if not _ENV_NAME.fullmatch(name):
        raise UserError(f"config key {key} = {ascii(name)} is not an environment variable name",
                        f"use letters, digits and '_' (not starting with a digit), e.g. {key} = \"ROUTER_API_KEY\"")
    upper = name.upper()
    if upper in _RESERVED_ENV or upper.startswith(_RESERVED_ENV_PREFIXES):
        raise UserError(f"config key {key} = {name!r} names a variable the system or the serving stack reads for "
                        "itself: its value is no secret (PATH is in every environment dump) or it changes what runs "
                        "(LD_*, PYTHON*)",
                        f"keep the key in a variable of its own, e.g. {key} = \"ROUTER_API_KEY\", or use "
                        "router.api_key_file")
    return name


def api_key_flag(args: Iterable[str], flag: str = "--api-key") -> str:
    """The argument in `args` that argparse would read as `flag` (the flag itself, `flag=V`, or any
    prefix argparse expands to it, e.g. `--api-ke`), or ''. sglang-router 0.3.2's parser allows
    abbreviations, and its only other option starting with `--a` is `--assignment-mode`, so every
    prefix from `--ap` on is unambiguous; `--a` is ambiguous there and refused too (it never helps)."""
    for a in args:
        opt = a.split("=", 1)[0]
        if len(opt) >= 3 and opt.startswith("--") and flag.startswith(opt):
            return a
    return ""
