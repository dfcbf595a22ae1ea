"""Value checks: one function per kind of config value, each `(value, key) -> typed value` or a
UserError that names the key, what it must be and an example (never a traceback).

They know nothing of Config: `keys.py` attaches one to every key, and the builders call them.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from typing import Any, Callable

from v4flash_kernels.hook.patches import SWITCHES
from v4flash_pd.config.flagwords import meant
from v4flash_pd.errors import UserError

Check = Callable[[Any, str], Any]

# sglang 0.5.13.post1 on sm_120: an extend chunk of more than this many tokens goes to FlashMLA's
# sparse prefill (`flash_mla_sparse_fwd`), whose sglang-kernel 0.4.3 binary has no sm_120 code
# (dsv4/metadata.py `_LARGE_INDEXER_QUERY_THRESHOLD`, compared with `>`), so the worker crashes.
MAX_PREFILL_CHUNK = 11673

# A host name (RFC 1123 labels, plus '_' which some clusters use), an IPv4 literal, or an IPv6 literal
# with an optional zone id (fe80::1%eth0): nothing a shell or a URL would read as syntax. Hosts reach
# argv, URLs and rendered scripts.
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(?:%[A-Za-z0-9_.-]+)?")
# Variables the launcher, the interpreter or the dynamic loader read for themselves: a secret kept in
# one of them is not a secret (PATH is in every `env` dump) or changes what runs (LD_PRELOAD).
_RESERVED_ENV = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "TERM", "TMPDIR", "LANG", "TZ",
                 "HOSTNAME", "IFS", "PS1", "PS4", "ENV", "BASH_ENV", "MAIL", "DISPLAY", "SSH_AUTH_SOCK"}
_RESERVED_ENV_PREFIXES = ("LD_", "LC_", "PYTHON", "CUDA_", "NCCL_", "UCX_", "HF_", "SGLANG_",
                          "TRANSFORMERS_", "TORCH", "TRITON_", "NVIDIA_", "SLURM_", "KUBERNETES_", "DYLD_",
                          "MALLOC_", "GLIBC_", "BASH_FUNC_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The kernel switches' variables (V4FLASH_<PATCH>): the plan writes them from [patches], never an env table.
_SWITCH_OF_ENV = {sw.env: sw for sw in SWITCHES}


class BadValue(UserError):
    """A value of the wrong type or out of range. Its fix names only what the key takes; `keys.Key.parse`,
    which knows the profile's working value of every key, turns it into a `--set KEY=VALUE` that works."""

    def __init__(self, message: str, key: str, what: str) -> None:
        super().__init__(message, f"set {key} to {what}")
        self.key = key
        self.what = what


def want(value: Any, types: type | tuple[type, ...], key: str, what: str) -> Any:
    """`value` itself when it is of `types` (a bool never passes for a number)."""
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        raise BadValue(f"config key {key} must be {what}, got {value!r}", key, what)
    return value


def text(what: str) -> Check:
    def check(value: Any, key: str) -> str:
        return str(want(value, str, key, what))
    return check


def flag(value: Any, key: str) -> bool:
    return bool(want(value, bool, key, "true or false"))


@dataclass(frozen=True)
class Integer:
    """An integer in [low, high] (high None: unbounded). The range is declared here once: a key's flag
    takes it too (`cli/options.py`), so `--set`, a config file and the flag refuse the same values."""

    what: str
    low: int
    high: int | None = None

    def __call__(self, value: Any, key: str) -> int:
        want(value, int, key, self.what)
        if value < self.low:
            raise BadValue(f"config key {key} = {value} must be >= {self.low}", key, self.what)
        if self.high is not None and value > self.high:
            raise BadValue(f"config key {key} = {value} must be <= {self.high}", key, self.what)
        return int(value)


def integer(what: str, minimum: int, maximum: int | None = None) -> Integer:
    return Integer(what, minimum, maximum)


def seconds(strict: bool) -> Check:
    """A finite number of seconds (> 0 when `strict`, else >= 0): nan and inf parse as TOML floats
    but would hang or never stop."""
    def check(value: Any, key: str) -> float:
        want(value, (int, float), key, "a number of seconds")
        v = float(value)
        if not math.isfinite(v) or v < 0 or (strict and v == 0):
            raise UserError(f"config key {key} = {value!r} must be a finite number of seconds {'> 0' if strict else '>= 0'}",
                            "use e.g. ready_timeout = 3600, grace_period = 30")
        return v
    return check


def choice(choices: tuple[str, ...]) -> Check:
    def check(value: Any, key: str) -> str:
        if value not in choices:
            raise UserError(f"config key {key} = {value!r} is not accepted by sglang 0.5.13.post1",
                            f"use one of: {', '.join(choices)}")
        return str(value)
    return check


def on_off(value: Any, key: str) -> bool:
    """A switch: true/false, or the words the CLI and env take (on/off/1/0)."""
    if isinstance(value, str) and value.strip().lower() in ("on", "off", "1", "0", "true", "false"):
        return value.strip().lower() in ("on", "1", "true")
    return flag(value, key)


AUTO = "auto"
AUTO_WORDS = (AUTO, "on", "off")


def on_off_auto(value: Any, key: str) -> str:
    """A switch that is on by default only once verified on the box: auto (off until `up`'s self-check
    passes), on or off (true/false and the CLI's words too)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    return "on" if on_off(value, key) else "off"


def fraction(value: Any, key: str) -> float:
    want(value, (int, float), key, "a fraction between 0 and 1")
    if not 0 < float(value) < 1:
        raise UserError(f"config key {key} = {value} is outside (0, 1)", f"use e.g. --set {key}=0.70")
    return float(value)


def port(value: Any, key: str) -> int:
    want(value, int, key, "a port number (1-65535)")
    if not 1 <= value <= 65535:
        raise BadValue(f"config key {key} = {value} is not a valid port", key, "a port number between 1 and 65535")
    return int(value)


def host(value: Any, key: str) -> str:
    """A host name or IP literal as a listener takes it; IPv6 may be written with brackets."""
    want(value, str, key, "a host name or IP address")
    name = value.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name:
        raise UserError(f"config key {key} is empty, which would listen on every interface",
                        f"set {key} = \"127.0.0.1\" (this box only) or \"0.0.0.0\" (every interface, on purpose)")
    if any(c.isspace() for c in name) or "/" in name or "[" in name or "]" in name:
        raise UserError(f"config key {key} = {value!r} is not a host name or IP address",
                        f"write a bare host, e.g. {key} = \"127.0.0.1\" or \"::1\" (no scheme, port or path)")
    if not _HOST.fullmatch(name):  # no shell metacharacters (`;`, backticks, `$`)
        raise UserError(f"config key {key} = {ascii(value)} is not a host name or IP address (only letters, digits, "
                        "'.', '-', '_' and, for IPv6, ':' and a %zone)",
                        f"write a bare host, e.g. {key.split('[')[0]} = \"node1\" or \"10.0.0.1\" (no scheme, port, "
                        "path, spaces or shell characters)")
    return str(name)


def hosts(value: Any, key: str) -> tuple[str, ...]:
    """Host names, one per box: a list, or one comma-separated string (the --hosts flag)."""
    items = want(value, (list, str), key, "a list of host names, one per box")
    if isinstance(items, str):
        items = [h for h in items.split(",") if h.strip()]
    return tuple(host(h, f"{key}[{i}]") for i, h in enumerate(items))


def env_name(name: str, key: str) -> str:
    if not name or "=" in name or "\0" in name or any(c.isspace() for c in name):
        raise UserError(f"environment variable name {name!r} in {key} is not valid",
                        "names may not be empty or contain '=', NUL or whitespace; use NAME = \"value\"")
    return name


def key_env_name(value: Any, key: str) -> str:
    """The variable that holds a secret (router.api_key_env), or "" for none: a plain name that nothing
    else reads."""
    name = want(value, str, key, "an environment variable name")
    if not name:
        return ""
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
    return str(name)


def env_table(value: Any, key: str) -> tuple[tuple[str, str], ...]:
    """NAME = "value" pairs, in the table's order (booleans become 1/0, numbers their text)."""
    want(value, dict, key, "a table of NAME = \"value\" strings")
    out = []
    for name, val in value.items():
        if isinstance(val, bool):
            val = "1" if val else "0"
        if not isinstance(val, (str, int, float)):
            raise UserError(f"env value {key}.{name} must be a string, got {val!r}", f'write {name} = "..."')
        if "\0" in str(val):
            raise UserError(f"env value {key}.{name} contains a NUL byte",
                            "remove it: the kernel cannot pass it to a process")
        sw = _SWITCH_OF_ENV.get(str(name))
        if sw is not None:
            raise UserError(f"{key} sets {name}, the {sw.name} kernel switch: the launcher sets it on every worker "
                            "from [patches] (and runs no kernel in the router), so this value would be overridden or "
                            "ignored without a word",
                            f"remove {name} from {key} and use {sw.flag} off (or --set patches.{sw.name}=false, "
                            f"[patches] {sw.name} = false in a config file)")
        out.append((env_name(str(name), key), str(val)))
    return tuple(out)


def args(value: Any, key: str) -> tuple[str, ...]:
    """Command-line words: a list, or one shell-quoted string."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise UserError(f"config key {key} = {value!r} cannot be split into arguments ({exc})",
                            "close the quote, or write it as a list: extra_args = [\"--flag\", \"value\"]") from None
    want(value, list, key, "a list of strings (or one shell-quoted string)")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise UserError(f"config key {key} has {v!r}, which is not a command-line word",
                            "write each argument as a string, e.g. [\"--max-running-requests\", \"64\"]")
    return tuple(str(v) for v in value)


def gpu_list(value: Any, key: str) -> tuple[int, ...]:
    """A non-empty list of distinct GPU indices."""
    gpus = want(value, list, key, "a list of GPU indices")
    if not gpus or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise UserError(f"config key {key} = {gpus!r} must be a non-empty list of GPU indices",
                        f"e.g. --set {key}=[0,1,2,3]")
    if len(set(gpus)) != len(gpus):
        raise UserError(f"config key {key} = {gpus!r} lists a GPU twice", "list each GPU once")
    return tuple(gpus)


def slot_gpus(value: Any, key: str) -> tuple[tuple[int, ...], ...]:
    """The GPUs of each NUMA slot of a box: non-empty lists, no GPU in two slots."""
    slots = want(value, list, key, "a list of GPU lists, one per NUMA slot")
    out: list[tuple[int, ...]] = []
    for i, g in enumerate(slots):
        if not isinstance(g, list) or not g or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                       for x in g):
            raise UserError(f"config key {key}[{i}] = {g!r} must be a non-empty list of GPU indices",
                            f"e.g. {key} = [[0, 1, 2, 3], [4, 5, 6, 7]] (one list per NUMA slot)")
        out.append(tuple(g))
    if not out:
        raise UserError(f"config key {key} is empty", "list the GPUs of each slot of a box, e.g. "
                        "[[0, 1, 2, 3], [4, 5, 6, 7]]")
    flat = [g for s in out for g in s]
    if len(set(flat)) != len(flat):
        raise UserError(f"config key {key} = {slots!r} gives a GPU to two slots",
                        "give every slot its own GPUs, e.g. [[0, 1, 2, 3], [4, 5, 6, 7]]")
    return tuple(out)


def prefill_chunk(value: Any, key: str) -> int:
    """A prefill chunk size sm_120 workers survive (see MAX_PREFILL_CHUNK)."""
    want(value, int, key, "a number of tokens, e.g. 8192")
    check_prefill_chunk(int(value), key.rsplit(".", 1)[0] + ".")
    return int(value)


def check_prefill_chunk(size: int, where: str) -> None:
    if size > MAX_PREFILL_CHUNK or size <= 0:
        what = "disables chunking" if size <= 0 else f"is larger than {MAX_PREFILL_CHUNK}"
        raise UserError(
            f"{where} chunked_prefill_size = {size} {what}: on sm_120, SGLang 0.5.13.post1 hands prefill "
            f"chunks of more than {MAX_PREFILL_CHUNK} tokens to FlashMLA's sparse prefill, which has no "
            "sm_120 code in sglang-kernel 0.4.3, and the worker crashes on the first long prompt",
            f"use --set engine.chunked_prefill_size=8192 (the profile's value; at most {MAX_PREFILL_CHUNK}) "
            "and drop --chunked-prefill-size from extra_args",
        )


def api_key_flag(argv: tuple[str, ...], flag_name: str = "--api-key") -> str:
    """The word of `argv` that argparse would read as `flag_name` (the flag, `flag=V`, or any prefix
    argparse expands to it, e.g. `--api-ke`), or ''. sglang-router 0.3.2's parser allows abbreviations,
    and its only other option starting with `--a` is `--assignment-mode`, so every prefix from `--ap`
    on is unambiguous; `--a` is ambiguous there and refused too (it never helps)."""
    return next((a for a in argv if meant(a, (flag_name,))), "")


def arg_value(argv: tuple[str, ...], flag_name: str) -> str | None:
    """The last value given for a flag in an argv tail (`--flag V` or `--flag=V`), as argparse takes it."""
    found = None
    for i, a in enumerate(argv):
        if a == flag_name and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(flag_name + "="):
            found = a.split("=", 1)[1]
    return found


def check_extra_chunk(argv: tuple[str, ...], key: str) -> None:
    """extra_args may not smuggle in the prefill chunk that `engine.chunked_prefill_size` refuses."""
    given = arg_value(argv, "--chunked-prefill-size")
    if given is None:
        return
    try:
        size = int(given)
    except ValueError:
        raise UserError(f"{key} has --chunked-prefill-size {given!r}, which is not an integer",
                        "use engine.chunked_prefill_size = 8192 instead of extra_args") from None
    check_prefill_chunk(size, f"{key} (--chunked-prefill-size)")


# Speculative decoding (issue 22): the pinned DeepSeek-V4 hook (arg_groups/deepseek_v4_hook.py,
# run from ServerArgs.__post_init__ before SGLang resolves algorithm aliases or upper-cases the name)
# asserts speculative_algorithm == "EAGLE" and speculative_eagle_topk == 1.
SPEC_ALGORITHM = "EAGLE"


def spec_algorithm(value: Any, key: str) -> str:
    """The speculative algorithm: exactly "EAGLE" (NEXTN, the same MTP draft, fails the pinned hook)."""
    want(value, str, key, f'"{SPEC_ALGORITHM}"')
    if value != SPEC_ALGORITHM:
        why = ("NEXTN names the same MTP draft, but the pinned DeepSeek-V4 hook compares the name before "
               "SGLang resolves that alias" if value.upper() == "NEXTN" else
               "SGLang upper-cases it only after the DeepSeek-V4 hook has compared it" if value.upper() == SPEC_ALGORITHM
               else "DeepSeek-V4-Flash's draft is its own MTP (NextN) layer, which runs as EAGLE")
        raise UserError(f"config key {key} = {value!r}: sglang 0.5.13.post1 accepts only \"{SPEC_ALGORITHM}\" for "
                        f"DeepSeek-V4 (arg_groups/deepseek_v4_hook.py asserts it; {why}), so every worker would stop "
                        "at start",
                        f"set {key} = \"{SPEC_ALGORITHM}\" (the default: leave it out) and turn speculative decoding "
                        "on with --mtp N")
    return SPEC_ALGORITHM


def spec_topk(value: Any, key: str) -> int:
    """EAGLE's tree width: exactly 1 for DeepSeek-V4 (a chain of draft tokens)."""
    want(value, int, key, "1")
    if value != 1:
        raise UserError(f"config key {key} = {value}: sglang 0.5.13.post1 accepts only eagle_topk = 1 for DeepSeek-V4 "
                        "(arg_groups/deepseek_v4_hook.py asserts it; its MTP drafts a chain, not a tree), so every "
                        "worker would stop at start",
                        f"set {key} = 1 (the default: leave it out)")
    return 1
