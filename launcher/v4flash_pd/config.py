"""Config: defaults < profile < config file (TOML) < V4FLASH_* env < CLI flags -> frozen `Config`.

Layers are merged as plain dicts first and typed once at the end, so every layer speaks the
same vocabulary (the keys of a config file) and every error can name the key and its source.
Role lists (`prefill`, `decode`, `server`) merge element-wise by index: a file that sets
`[[decode]] cuda_graph_max_bs = 16` tweaks the profile's decode worker instead of replacing it, and
a second `[[prefill]]` entry adds a second prefill worker (2P1D is a config change, not code).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from v4flash_kernels.hook.patches import SWITCHES
from v4flash_pd.errors import UserError
from v4flash_pd.profiles import DEFAULT_PROFILE, get_profile
from v4flash_pd.safety import api_key_flag, check_host, check_key_env


def _tomllib() -> Any:
    """tomllib, imported on first use: `plan` of a profile alone never parses TOML (start-up time)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 hosts only
        import tomli as tomllib
    return tomllib

# Choices of the pinned sglang 0.5.13.post1 argument parser (tests check them against the real one),
# so `plan` can refuse a bad value in milliseconds instead of importing torch.
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")
MOE_RUNNER_BACKENDS = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
    "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
    "cutlass", "aiter", "marlin",
)
NUMA_MODES = ("bind", "preferred", "off")
# The kernel switches the import hook reads in every worker, from the kernels' one registry (an
# import-free table): (name, env variable). Config key `patches.<name>`; `up --<name>` on/off.
PATCH_SWITCHES: tuple[tuple[str, str], ...] = tuple((s.name, s.env) for s in SWITCHES)
# sglang 0.5.13.post1 on sm_120: an extend chunk of more than this many tokens goes to FlashMLA's
# sparse prefill (`flash_mla_sparse_fwd`), whose sglang-kernel 0.4.3 binary has no sm_120 code
# (dsv4/metadata.py `_LARGE_INDEXER_QUERY_THRESHOLD`, compared with `>`), so the worker crashes.
MAX_PREFILL_CHUNK = 11673
MODES = ("pd", "aggregated")
# UCX transports that cross a box (cuda_ipc and sm only reach GPUs and memory of the same host).
NETWORK_TRANSPORTS = ("tcp", "rc", "rc_x", "rc_v", "dc", "dc_x", "ud", "ud_x", "ud_v")
ROLES = ("prefill", "decode", "server")

DEFAULTS: dict[str, Any] = {
    "mode": "pd",
    "model": {"path": "", "served_name": "", "tokenizer_path": ""},
    "engine": {
        "transfer_backend": "nixl",
        "kv_cache_dtype": "fp8_e4m3",
        "moe_runner_backend": "marlin",
        "mem_fraction_static": None,
        "trust_remote_code": True,
        "enable_metrics": False,
        "context_length": None,
        "chunked_prefill_size": None,
        "extra_args": [],
    },
    "numa": "bind",
    "patches": {name: True for name, _ in PATCH_SWITCHES},
    "sparse_decode": None,  # older spelling of patches.sparse_decode
    "python": "",
    "ready_timeout": 3600.0,
    "grace_period": 30.0,
    "hang_timeout": 60.0,  # seconds without a healthy /health answer before a process counts as hung
    "smoke_prompt": "The capital of France is",
    "env": {},
    "prefill": [],
    "decode": [],
    "server": [],
    # A cluster plan (cluster.py): `boxes` 8-GPU boxes x len(slot_gpus) NUMA slots, `prefill` +
    # `decode` of them TP workers built from [[prefill]]/[[decode]] entry 0, one router on box 0.
    # boxes = 0: one box, the [[prefill]]/[[decode]] lists as written.
    "cluster": {
        "boxes": 0,
        "prefill": 1,
        "decode": 1,
        "slot_gpus": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "http_port": 30000,
        "bootstrap_port": 8998,
        "nccl_port": 30010,
        "port_offset": 0,
        "bind_host": "advertise",  # each box's own cluster.hosts entry (interconnect.py); 0.0.0.0 without hosts
        "network": "tcp",
        "hosts": [],
    },
    "router": {
        "host": "0.0.0.0",
        "port": 8000,
        "metrics_host": "127.0.0.1",
        "metrics_port": 29000,
        "policy": "",
        "api_key_file": "",
        "api_key_env": "",
        "extra_args": [],
        "env": {},
    },
}

WORKER_DEFAULTS: dict[str, Any] = {
    "gpus": [],
    "tp": 1,
    "numa_node": None,
    "host": "127.0.0.1",
    "port": None,
    "bootstrap_port": None,
    "nccl_port": None,
    "cuda_graph_max_bs": None,
    "mem_fraction_static": None,
    "extra_args": [],
    "env": {},
}


@dataclass(frozen=True)
class WorkerSpec:
    """One SGLang server process group (one TP group)."""

    name: str
    role: str
    index: int  # position in its role list: `--set <role>.<index>.key=...` addresses it
    gpus: tuple[int, ...]
    tp: int
    numa_node: int | None
    host: str
    port: int
    bootstrap_port: int | None
    nccl_port: int
    cuda_graph_max_bs: int | None
    mem_fraction_static: float | None
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # Cluster plans only: the box it runs on, the name other boxes reach it by ("" = its own host
    # seen from this box), and whether this process plans it (False: another box starts it).
    box: int | None = None
    advertise: str = ""
    remote: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    """How many boxes, which roles go where, and how workers on different boxes reach each other."""

    boxes: int
    prefill: int
    decode: int
    slot_gpus: tuple[tuple[int, ...], ...]
    http_port: int
    bootstrap_port: int
    nccl_port: int
    port_offset: int
    bind_host: str
    network: str
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class RouterSpec:
    host: str
    port: int
    metrics_host: str
    metrics_port: int
    policy: str
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # Client authentication: the router's `--api-key` guards /generate and the OpenAI routes. The
    # secret is read by our router wrapper at start from this file or variable, never put in argv.
    api_key_file: str = ""
    api_key_env: str = ""

    @property
    def auth(self) -> str:
        if self.api_key_file:
            return f"api key from file {self.api_key_file}"
        if self.api_key_env:
            return f"api key from ${self.api_key_env}"
        return ""


@dataclass(frozen=True)
class Config:
    profile: str
    mode: str
    model_path: str
    served_name: str
    tokenizer_path: str
    transfer_backend: str | None
    kv_cache_dtype: str
    moe_runner_backend: str
    trust_remote_code: bool
    enable_metrics: bool
    context_length: int | None
    chunked_prefill_size: int | None
    engine_extra_args: tuple[str, ...]
    numa: str
    patches: tuple[tuple[str, bool], ...]  # (name, on) in PATCH_SWITCHES order
    python: str  # "" = the interpreter the Host names (this one locally, python3 on another box)
    ready_timeout: float
    grace_period: float
    hang_timeout: float
    smoke_prompt: str
    env: tuple[tuple[str, str], ...]
    workers: tuple[WorkerSpec, ...]
    router: RouterSpec | None
    sources: tuple[str, ...] = field(default=())
    cluster: ClusterSpec | None = None
    # Where the router's API key comes from, ("file", path) / ("env", NAME) or ("", ""). Kept when a
    # cluster part drops the router: its workers take the same key (workerauth.py).
    client_auth: tuple[str, str] = ("", "")

    def role(self, role: str) -> tuple[WorkerSpec, ...]:
        return tuple(w for w in self.workers if w.role == role)

    def local_workers(self) -> tuple[WorkerSpec, ...]:
        """The workers this process plans and starts (all of them, except in a cluster selection)."""
        return tuple(w for w in self.workers if not w.remote)

    def patch_on(self, name: str) -> bool:
        return dict(self.patches)[name]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- merging


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `over` into a copy of `base`: dicts recursively, role lists by index."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key in ROLES and isinstance(value, list):
            cur = list(out.get(key) or [])
            for i, item in enumerate(value):
                if not isinstance(item, Mapping):
                    raise UserError(f"config key {key}.{i} must be a table, got {item!r}",
                                    f"write it as [[{key}]] with keys like gpus = [0, 1] and port = 30000")
                if i < len(cur):
                    cur[i] = deep_merge(cur[i], item)
                else:
                    cur.append(copy.deepcopy(dict(item)))
            out[key] = cur
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict) and key != "env":
            out[key] = deep_merge(out[key], value)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):  # env: union
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_value(text: str) -> Any:
    """A `--set` value: TOML syntax when it parses (numbers, bools, lists), else a plain string.

    TOML dates and times come back as the text typed: no config key takes a date, and
    `--set model.served_name=2026-11-29` means that string, not a `datetime.date`.
    """
    import datetime

    toml = _tomllib()
    try:
        value = toml.loads(f"v = {text}")["v"]
    except toml.TOMLDecodeError:
        return text
    return text if isinstance(value, (datetime.date, datetime.time)) else value


def set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply `a.b.0.c=value` to the raw dict (`prefill.0.port=31000`, `env.UCX_TLS=tcp`)."""
    parts = dotted.split(".")
    if not all(parts):
        raise UserError(f"cannot apply override {dotted!r}: empty key segment",
                        "write dotted keys like router.port=9000 or decode.0.env.UCX_TLS=tcp")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            idx = _index(part, dotted, len(node))
            if idx == len(node):
                node.append({})
            node = node[idx]
        elif isinstance(node, dict):
            if part not in node or node[part] is None:
                node[part] = [] if part in ROLES else {}
            node = node[part]
        else:
            _not_a_table(dotted, parts[:i])
    if not isinstance(node, (list, dict)):
        _not_a_table(dotted, parts[:-1])
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(last, dotted, len(node))
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    else:
        node[last] = value


def _not_a_table(dotted: str, prefix: list[str]) -> None:
    where = ".".join(prefix)
    raise UserError(f"cannot apply override {dotted!r}: {where} is a single value, not a table",
                    f"set {where} itself (--set {where}=VALUE), or use a key that has sub-keys, e.g. router.port")


def _index(part: str, dotted: str, length: int) -> int:
    if not part.isdigit() or int(part) > length:
        raise UserError(f"cannot apply override {dotted!r}: {part!r} is not a valid list index",
                        f"role lists are indexed from 0 and may grow by one, e.g. --set decode.{length}.port=30002")
    return int(part)


def split_set_items(text: str) -> list[str]:
    """Split V4FLASH_SET on whitespace outside quotes and brackets, so TOML values written the
    natural way survive: `prefill.0.extra_args=["--chunked-prefill-size", "8192"] env.X="a b"`."""
    items: list[str] = []
    cur: list[str] = []
    quote = ""
    depth = 0
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch.isspace() and depth == 0:
            if cur:
                items.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if cur:
        items.append("".join(cur))
    return items


def parse_overrides(items: list[str] | tuple[str, ...], source: str) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        if "=" not in item:
            raise UserError(f"{source}: override {item!r} is not KEY=VALUE",
                            "write overrides like --set router.port=9000 or --set decode.0.env.UCX_TLS=tcp")
        key, _, value = item.partition("=")
        out.append((key.strip(), parse_value(value.strip())))
    return out


def read_text_file(path: Path, what: str, fix_missing: str) -> str:
    """A user-named text file as str, or a UserError naming what is wrong with it (never a traceback)."""
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist", fix_missing) from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory, not a file", "pass the path of the file itself") from None
    except PermissionError:
        raise UserError(f"{what} {path} is not readable (permission denied)",
                        f"make it readable for this user (chmod o+r {path}) or copy it somewhere readable") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}", "check the path and its permissions") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})",
                        "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8), or point at the right file") from None


def read_config_file(path: Path) -> dict[str, Any]:
    text = read_text_file(path, "config file",
                          "pass an existing TOML file with --config, or drop --config to use the profile alone")
    toml = _tomllib()
    try:
        return dict(toml.loads(text))
    except toml.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}",
                        "fix the syntax at the line shown (TOML: key = value, [table], [[prefill]])") from None


def merged_layers(
    config_file: Path | str | None = None,
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    sets: tuple[str, ...] = (),
    base: tuple[Mapping[str, Any], str] | None = None,
    rehearsal: bool = False,
) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """Every layer merged into one raw dict (the vocabulary of a config file), not yet validated.

    `base` = (raw, profile) of a cluster plan file: it stands in for defaults < profile < file, so a
    box starts exactly the config that was rendered; env and flags still go on top. `rehearsal`
    adds rehearsal.LOOPBACK over the profile (a one-box rehearsal listens on 127.0.0.1 unless a later
    layer says otherwise); a cluster keeps the profile's addresses.
    """
    env = os.environ if env is None else env
    sources = ["defaults"]
    if base is not None:
        raw = deep_merge(DEFAULTS, base[0])
        prof_name = base[1]
        sources.append("cluster-plan")
    else:
        file_raw: dict[str, Any] = {}
        if config_file:
            file_raw = read_config_file(Path(config_file))
        file_profile = file_raw.pop("profile", None)
        if file_profile is not None and not isinstance(file_profile, str):
            raise UserError(f"config key profile must be a profile name, got {file_profile!r}",
                            f'write profile = "{DEFAULT_PROFILE}" (or drop it)')
        prof_name = profile or file_profile or DEFAULT_PROFILE
        raw = deep_merge(DEFAULTS, get_profile(prof_name))
        sources.append(f"profile:{prof_name}")
        if rehearsal:
            from v4flash_pd.rehearsal.loopback import loopback_layer

            raw = deep_merge(raw, loopback_layer(raw))
            sources.append("rehearsal:loopback")
        if file_raw:
            raw = deep_merge(raw, file_raw)
            sources.append(f"file:{config_file}")
    env_sets = split_set_items(env.get("V4FLASH_SET", ""))
    for key, value in parse_overrides(env_sets, "V4FLASH_SET"):
        set_path(raw, key, value)
    if env_sets:
        sources.append("env:V4FLASH_SET")
    for key, value in (overrides or {}).items():
        if value is not None:
            set_path(raw, key, value)
    for key, value in parse_overrides(list(sets), "--set"):
        set_path(raw, key, value)
    if overrides or sets:
        sources.append("flags")
    if rehearsal and (raw.get("cluster") or {}).get("boxes"):  # other boxes must reach a cluster's listeners
        return merged_layers(config_file, profile, overrides, env, sets, base, rehearsal=False)
    return raw, prof_name, tuple(sources)


def load_config(*args: Any, **kwargs: Any) -> Config:
    """Resolve all layers into a validated Config (the arguments are `merged_layers`'s).

    `overrides` are the typed CLI flags (already dotted keys, e.g. {"model.path": "/m"}); `sets` are
    `--set` items. Env layer: `V4FLASH_SET` (whitespace-separated KEY=VALUE items); the named
    options' V4FLASH_<OPTION> env vars are resolved by click before they arrive here as overrides.
    """
    return build_config(*merged_layers(*args, **kwargs))


# ---------------------------------------------------------------- typing + validation


def _check_keys(table: Mapping[str, Any], allowed: Mapping[str, Any], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise UserError(f"unknown config key {where}{key!r}",
                            f"valid keys here: {', '.join(sorted(allowed))}")


def _example(key: str) -> str:
    """A fix that works: `--set KEY=VALUE` with the value the default profile gives `key` (role
    entries beyond the profile's take entry 0's), or just the advice when it has none."""
    node: Any = deep_merge(DEFAULTS, get_profile(DEFAULT_PROFILE))
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, list):
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else (node[0] if node else None)
            if isinstance(node, dict) and i < len(parts) - 1 and parts[i - 1] in ROLES:
                node = {**WORKER_DEFAULTS, **node}
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            node = None
    if node is None or isinstance(node, (dict, bool)):
        return ""
    text = json.dumps(node, separators=(",", ":")) if isinstance(node, list) else str(node)
    return f"--set {key}={text}"


def _set_hint(key: str, what: str) -> str:
    example = _example(key)
    return f"{example} ({what})" if example else f"set {key} to {what}"


def _want(value: Any, types: type | tuple[type, ...], key: str, what: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise UserError(f"config key {key} must be {what}, got {value!r}", _set_hint(key, what))
    if not isinstance(value, types):
        raise UserError(f"config key {key} must be {what}, got {value!r}", _set_hint(key, what))
    return value


def _int(value: Any, key: str, what: str, minimum: int) -> int:
    _want(value, int, key, what)
    if value < minimum:
        raise UserError(f"config key {key} = {value} must be >= {minimum}", _set_hint(key, what))
    return int(value)


def _seconds(value: Any, key: str, minimum: float, strict: bool) -> float:
    """A finite number of seconds: nan and inf parse as TOML floats but would hang or never stop."""
    _want(value, (int, float), key, "a number of seconds")
    v = float(value)
    if not math.isfinite(v) or v < minimum or (strict and v == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise UserError(f"config key {key} = {value!r} must be a finite number of seconds {bound}",
                        "use e.g. ready_timeout = 3600, grace_period = 30")
    return v


def _choice(value: Any, choices: tuple[str, ...], key: str) -> str:
    if value not in choices:
        raise UserError(f"config key {key} = {value!r} is not accepted by sglang 0.5.13.post1",
                        f"use one of: {', '.join(choices)}")
    return str(value)


def _on_off(value: Any, key: str) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("on", "off", "1", "0", "true", "false"):
        return value.strip().lower() in ("on", "1", "true")
    return bool(_want(value, bool, key, "true or false"))


def _env_name(name: str, key: str) -> str:
    if not name or "=" in name or "\0" in name or any(c.isspace() for c in name):
        raise UserError(f"environment variable name {name!r} in {key} is not valid",
                        "names may not be empty or contain '=', NUL or whitespace; use NAME = \"value\"")
    return name


def _env_pairs(value: Any, key: str) -> tuple[tuple[str, str], ...]:
    _want(value, dict, key, "a table of NAME = \"value\" strings")
    out = []
    for name, val in value.items():
        if isinstance(val, bool):
            val = "1" if val else "0"
        if not isinstance(val, (str, int, float)):
            raise UserError(f"env value {key}.{name} must be a string, got {val!r}", f'write {name} = "..."')
        if "\0" in str(val):
            raise UserError(f"env value {key}.{name} contains a NUL byte",
                            "remove it: the kernel cannot pass it to a process")
        out.append((_env_name(str(name), key), str(val)))
    return tuple(out)


def _args(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        import shlex

        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise UserError(f"config key {key} = {value!r} cannot be split into arguments ({exc})",
                            "close the quote, or write it as a list: extra_args = [\"--flag\", \"value\"]") from None
    _want(value, list, key, "a list of strings (or one shell-quoted string)")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise UserError(f"config key {key} has {v!r}, which is not a command-line word",
                            "write each argument as a string, e.g. [\"--max-running-requests\", \"64\"]")
    return tuple(str(v) for v in value)


def _port(value: Any, key: str) -> int:
    _want(value, int, key, "a port number (1-65535)")
    if not 1 <= value <= 65535:
        raise UserError(f"config key {key} = {value} is not a valid port",
                        _set_hint(key, "a port number between 1 and 65535"))
    return int(value)


def _host(value: Any, key: str) -> str:
    """A host name or IP literal as a listener takes it; IPv6 may be written with brackets."""
    _want(value, str, key, "a host name or IP address")
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise UserError(f"config key {key} is empty, which would listen on every interface",
                        f"set {key} = \"127.0.0.1\" (this box only) or \"0.0.0.0\" (every interface, on purpose)")
    if any(c.isspace() for c in host) or "/" in host or "[" in host or "]" in host:
        raise UserError(f"config key {key} = {value!r} is not a host name or IP address",
                        f"write a bare host, e.g. {key} = \"127.0.0.1\" or \"::1\" (no scheme, port or path)")
    return check_host(host, key)  # no shell metacharacters: hosts reach argv, URLs and rendered scripts


def arg_value(args: tuple[str, ...], flag: str) -> str | None:
    """The last value given for `flag` in an argv tail (`--flag V` or `--flag=V`), as argparse takes it."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def check_prefill_chunk(size: int | None, where: str) -> None:
    if size is None:
        return
    if size > MAX_PREFILL_CHUNK or size <= 0:
        what = "disables chunking" if size <= 0 else f"is larger than {MAX_PREFILL_CHUNK}"
        raise UserError(
            f"{where} chunked_prefill_size = {size} {what}: on sm_120, SGLang 0.5.13.post1 hands prefill "
            f"chunks of more than {MAX_PREFILL_CHUNK} tokens to FlashMLA's sparse prefill, which has no "
            "sm_120 code in sglang-kernel 0.4.3, and the worker crashes on the first long prompt",
            f"use --set engine.chunked_prefill_size=8192 (the profile's value; at most {MAX_PREFILL_CHUNK}) "
            "and drop --chunked-prefill-size from extra_args",
        )


def _extra_chunk(args: tuple[str, ...], key: str) -> None:
    text = arg_value(args, "--chunked-prefill-size")
    if text is None:
        return
    try:
        size = int(text)
    except ValueError:
        raise UserError(f"{key} has --chunked-prefill-size {text!r}, which is not an integer",
                        "use engine.chunked_prefill_size = 8192 instead of extra_args") from None
    check_prefill_chunk(size, f"{key} (--chunked-prefill-size)")


def _worker(role: str, idx: int, raw: Any, engine_mem: float | None) -> WorkerSpec:
    where = f"{role}.{idx}."
    _want(raw, dict, f"{role}.{idx}", "a table (write it as [[" + role + "]])")
    _check_keys(raw, WORKER_DEFAULTS, where)
    w = {**WORKER_DEFAULTS, **raw}
    gpus = _want(w["gpus"], list, where + "gpus", "a list of GPU indices")
    if not gpus or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise UserError(f"config key {where}gpus = {gpus!r} must be a non-empty list of GPU indices",
                        f"e.g. --set {where}gpus=[0,1,2,3]")
    if len(set(gpus)) != len(gpus):
        raise UserError(f"config key {where}gpus = {gpus!r} lists a GPU twice", "list each GPU once")
    tp = _want(w["tp"], int, where + "tp", "a positive integer")
    if tp < 1 or len(gpus) % tp:
        raise UserError(
            f"{role}.{idx} has {len(gpus)} GPUs, which is not divisible by its TP size {tp}",
            f"give {role}.{idx} a multiple of {tp} GPUs, or --set {where}tp=N with N a divisor of {len(gpus)}",
        )
    if w["port"] is None:
        raise UserError(f"{role}.{idx} has no port", f"set it: --set {where}port=N (every port is explicit)")
    if w["nccl_port"] is None:
        raise UserError(f"{role}.{idx} has no nccl_port",
                        f"set it: --set {where}nccl_port=N (implicit NCCL ports race between two servers on one box)")
    if role == "prefill" and w["bootstrap_port"] is None:
        raise UserError(f"{role}.{idx} has no bootstrap_port",
                        f"set it: --set {where}bootstrap_port=8998 (sglang's default); the router passes it to decode")
    numa = w["numa_node"]
    if numa is not None:
        numa = _int(numa, where + "numa_node", "a NUMA node number (or leave it unset to follow the GPUs)", 0)
    cgbs = w["cuda_graph_max_bs"]
    if cgbs is not None:
        cgbs = _int(cgbs, where + "cuda_graph_max_bs", "a positive integer", 1)
    mem = w["mem_fraction_static"] if w["mem_fraction_static"] is not None else engine_mem
    if mem is not None:
        _want(mem, (int, float), where + "mem_fraction_static", "a fraction between 0 and 1")
        if not 0 < float(mem) < 1:
            raise UserError(f"config key {where}mem_fraction_static = {mem} is outside (0, 1)",
                            f"use e.g. --set {where}mem_fraction_static=0.70")
    extra = _args(w["extra_args"], where + "extra_args")
    if role in ("prefill", "server"):
        _extra_chunk(extra, where + "extra_args")
    return WorkerSpec(
        name=f"{role}-{idx}",
        role=role,
        index=idx,
        gpus=tuple(gpus),
        tp=tp,
        numa_node=numa,
        host=_host(w["host"], where + "host"),
        port=_port(w["port"], where + "port"),
        bootstrap_port=_port(w["bootstrap_port"], where + "bootstrap_port") if w["bootstrap_port"] is not None else None,
        nccl_port=_port(w["nccl_port"], where + "nccl_port"),
        cuda_graph_max_bs=cgbs,
        mem_fraction_static=float(mem) if mem is not None else None,
        extra_args=extra,
        env=_env_pairs(w["env"], where + "env"),
    )


def _patches(raw: Mapping[str, Any]) -> tuple[tuple[str, bool], ...]:
    table = _want(raw.get("patches") or {}, dict, "patches", "a table of patch = true/false")
    _check_keys(table, DEFAULTS["patches"], "patches.")
    merged = {**DEFAULTS["patches"], **table}
    if raw.get("sparse_decode") is not None:  # the older top-level key (wins: it is the more specific layer)
        merged["sparse_decode"] = raw["sparse_decode"]
    return tuple((name, _on_off(merged[name], f"patches.{name}")) for name, _ in PATCH_SWITCHES)


def _network(value: Any) -> str:
    if value not in NETWORK_TRANSPORTS:
        raise UserError(f"config key cluster.network = {value!r} is not a UCX transport that crosses boxes",
                        f"use tcp (any Ethernet), or rc/rc_x/dc_x/ud_x where RDMA NICs exist; one of: "
                        f"{', '.join(NETWORK_TRANSPORTS)}")
    return str(value)


def _cluster(raw: Mapping[str, Any], mode: str) -> ClusterSpec | None:
    c = _want(raw.get("cluster") or {}, dict, "cluster", "a table")
    _check_keys(c, DEFAULTS["cluster"], "cluster.")
    c = {**DEFAULTS["cluster"], **c}
    boxes = _int(c["boxes"], "cluster.boxes", "a number of 8-GPU boxes (0 = one box, no cluster plan)", 0)
    if boxes == 0:
        return None
    if mode != "pd":
        raise UserError(f"cluster.boxes = {boxes} needs mode = \"pd\" (a cluster plan places prefill and decode "
                        f"workers), but mode = {mode!r}",
                        "drop cluster.boxes (aggregated serving is one box), or use the rtx6000-8x-pd profile")
    slots = _want(c["slot_gpus"], list, "cluster.slot_gpus", "a list of GPU lists, one per NUMA slot")
    slot_gpus: list[tuple[int, ...]] = []
    for i, g in enumerate(slots):
        if not isinstance(g, list) or not g or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                       for x in g):
            raise UserError(f"config key cluster.slot_gpus[{i}] = {g!r} must be a non-empty list of GPU indices",
                            "e.g. cluster.slot_gpus = [[0, 1, 2, 3], [4, 5, 6, 7]] (one list per NUMA slot)")
        slot_gpus.append(tuple(g))
    if not slot_gpus:
        raise UserError("config key cluster.slot_gpus is empty", "list the GPUs of each slot of a box, e.g. "
                        "[[0, 1, 2, 3], [4, 5, 6, 7]]")
    flat = [g for s in slot_gpus for g in s]
    if len(set(flat)) != len(flat):
        raise UserError(f"config key cluster.slot_gpus = {slots!r} gives a GPU to two slots",
                        "give every slot its own GPUs, e.g. [[0, 1, 2, 3], [4, 5, 6, 7]]")
    hosts = _want(c["hosts"], (list, str), "cluster.hosts", "a list of host names, one per box")
    if isinstance(hosts, str):
        hosts = [h for h in hosts.split(",") if h.strip()]
    hosts = [_host(h, f"cluster.hosts[{i}]") for i, h in enumerate(hosts)]
    return ClusterSpec(
        boxes=boxes,
        prefill=_int(c["prefill"], "cluster.prefill", "a number of prefill workers", 1),
        decode=_int(c["decode"], "cluster.decode", "a number of decode workers", 1),
        slot_gpus=tuple(slot_gpus),
        http_port=_port(c["http_port"], "cluster.http_port"),
        bootstrap_port=_port(c["bootstrap_port"], "cluster.bootstrap_port"),
        nccl_port=_port(c["nccl_port"], "cluster.nccl_port"),
        port_offset=_int(c["port_offset"], "cluster.port_offset", "a port offset per box (0 on a real cluster)", 0),
        bind_host=_host(c["bind_host"], "cluster.bind_host"),
        network=_network(c["network"]),
        hosts=tuple(hosts),
    )


def build_config(raw: Mapping[str, Any], profile: str, sources: tuple[str, ...] = ()) -> Config:
    """Pure: the merged raw layers -> a validated Config. No host facts are read here (the
    interpreter, nixl's UCX dir and the like are the Host's, decided by `build_plan`)."""
    _check_keys(raw, DEFAULTS, "")
    mode = _choice(raw["mode"], MODES, "mode")
    model = _want(raw["model"], dict, "model", "a table")
    _check_keys(model, DEFAULTS["model"], "model.")
    model = {**DEFAULTS["model"], **model}
    engine = _want(raw["engine"], dict, "engine", "a table")
    _check_keys(engine, DEFAULTS["engine"], "engine.")
    engine = {**DEFAULTS["engine"], **engine}
    tb = engine["transfer_backend"]
    if mode == "pd":
        tb = _choice(tb, TRANSFER_BACKENDS, "engine.transfer_backend")
    kv = _choice(engine["kv_cache_dtype"], KV_CACHE_DTYPES, "engine.kv_cache_dtype")
    moe = _choice(engine["moe_runner_backend"], MOE_RUNNER_BACKENDS, "engine.moe_runner_backend")
    numa = _choice(raw["numa"], NUMA_MODES, "numa")
    mem = engine["mem_fraction_static"]
    ctx = engine["context_length"]
    if ctx is not None:
        ctx = _int(ctx, "engine.context_length", "a number of tokens, e.g. 131072", 1)
    chunk = engine["chunked_prefill_size"]
    if chunk is not None:
        _want(chunk, int, "engine.chunked_prefill_size", "a number of tokens, e.g. 8192")
        check_prefill_chunk(chunk, "engine.")
    engine_extra = _args(engine["extra_args"], "engine.extra_args")
    _extra_chunk(engine_extra, "engine.extra_args")

    workers: list[WorkerSpec] = []
    roles = ("prefill", "decode") if mode == "pd" else ("server",)
    for role in ROLES:
        entries = raw.get(role) or []
        _want(entries, list, role, f"a list of tables (write each as [[{role}]])")
        if role not in roles and entries:
            raise UserError(f"config has [[{role}]] workers but mode = {mode!r}",
                            f"{'use [[prefill]] and [[decode]]' if mode == 'pd' else 'use [[server]]'} "
                            f"for mode {mode!r}, or change mode")
        for i, entry in enumerate(entries):
            workers.append(_worker(role, i, entry, mem))
    for role in roles:
        if not any(w.role == role for w in workers):
            raise UserError(f"mode {mode!r} needs at least one [[{role}]] worker",
                            f"add a [[{role}]] table with gpus, tp and port")

    router = None
    if mode == "pd":
        r = _want(raw["router"], dict, "router", "a table")
        _check_keys(r, DEFAULTS["router"], "router.")
        r = {**DEFAULTS["router"], **r}
        key_env = _want(r["api_key_env"], str, "router.api_key_env", "an environment variable name")
        if key_env:
            check_key_env(key_env, "router.api_key_env")
        router = RouterSpec(
            host=_host(r["host"], "router.host"),
            port=_port(r["port"], "router.port"),
            metrics_host=_host(r["metrics_host"], "router.metrics_host"),
            metrics_port=_port(r["metrics_port"], "router.metrics_port"),
            policy=_want(r["policy"], str, "router.policy", "a router policy name or \"\""),
            extra_args=_args(r["extra_args"], "router.extra_args"),
            env=_env_pairs(r["env"], "router.env"),
            api_key_file=_want(r["api_key_file"], str, "router.api_key_file", "a file path"),
            api_key_env=key_env,
        )
        flag = api_key_flag(router.extra_args)  # argparse also takes any prefix (--api-ke) as --api-key
        if flag:
            raise UserError(f"router.extra_args passes {flag.split('=', 1)[0]!r}, which the router reads as --api-key, "
                            "on the command line, where `ps`, the .command file and the logs show it",
                            "put the key in a file (router.api_key_file) or a variable (router.api_key_env) instead")

    env = _env_pairs(raw["env"], "env")
    cluster = _cluster(raw, mode)
    cfg = Config(
        profile=profile,
        mode=mode,
        model_path=_want(model["path"], str, "model.path", "a directory path"),
        served_name=_want(model["served_name"], str, "model.served_name", "a name"),
        tokenizer_path=_want(model["tokenizer_path"], str, "model.tokenizer_path", "a directory path"),
        transfer_backend=tb if mode == "pd" else None,
        kv_cache_dtype=kv,
        moe_runner_backend=moe,
        trust_remote_code=_want(engine["trust_remote_code"], bool, "engine.trust_remote_code", "true or false"),
        enable_metrics=_want(engine["enable_metrics"], bool, "engine.enable_metrics", "true or false"),
        context_length=ctx,
        chunked_prefill_size=chunk,
        engine_extra_args=engine_extra,
        numa=numa,
        patches=_patches(raw),
        python=_want(raw["python"], str, "python", "an interpreter path"),
        ready_timeout=_seconds(raw["ready_timeout"], "ready_timeout", 0.0, strict=True),
        grace_period=_seconds(raw["grace_period"], "grace_period", 0.0, strict=False),
        hang_timeout=_seconds(raw["hang_timeout"], "hang_timeout", 0.0, strict=True),
        smoke_prompt=_want(raw["smoke_prompt"], str, "smoke_prompt", "a string"),
        env=env,
        workers=tuple(workers),
        router=router,
        sources=sources,
        cluster=cluster,
        client_auth=(("file", router.api_key_file) if router is not None and router.api_key_file else
                     ("env", router.api_key_env) if router is not None and router.api_key_env else ("", "")),
    )
    if cluster is None:
        return cfg
    from v4flash_pd.cluster import expand  # the slot layout: imported only for cluster plans

    return expand(cfg, raw)
