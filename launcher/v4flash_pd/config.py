"""Config: defaults < profile < config file (TOML) < V4FLASH_* env < CLI flags -> frozen `Config`.

Layers are merged as plain dicts first and typed once at the end, so every layer speaks the
same vocabulary (the keys of a config file) and every error can name the key and its source.
Role lists (`prefill`, `decode`, `server`) merge element-wise by index: a file that sets
`[[decode]] cuda_graph_max_bs = 16` tweaks the profile's decode worker instead of replacing it, and
a second `[[prefill]]` entry adds a second prefill worker (2P1D is a config change, not code).
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from v4flash_pd.errors import UserError
from v4flash_pd.profiles import DEFAULT_PROFILE, get_profile

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 hosts only
    import tomli as tomllib

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
MODES = ("pd", "aggregated")
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
        "extra_args": [],
    },
    "numa": "bind",
    "sparse_decode": True,
    "python": "",
    "ready_timeout": 3600.0,
    "grace_period": 30.0,
    "smoke_prompt": "The capital of France is",
    "env": {},
    "prefill": [],
    "decode": [],
    "server": [],
    "router": {
        "host": "0.0.0.0",
        "port": 8000,
        "metrics_host": "127.0.0.1",
        "metrics_port": 29000,
        "policy": "",
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


@dataclass(frozen=True)
class RouterSpec:
    host: str
    port: int
    metrics_host: str
    metrics_port: int
    policy: str
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]


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
    engine_extra_args: tuple[str, ...]
    numa: str
    sparse_decode: bool
    python: str
    ready_timeout: float
    grace_period: float
    smoke_prompt: str
    env: tuple[tuple[str, str], ...]
    workers: tuple[WorkerSpec, ...]
    router: RouterSpec | None
    sources: tuple[str, ...] = field(default=())

    def role(self, role: str) -> tuple[WorkerSpec, ...]:
        return tuple(w for w in self.workers if w.role == role)

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
                    raise UserError(f"config key {key}[{i}] must be a table, got {item!r}",
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
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return text if isinstance(value, (datetime.date, datetime.time)) else value


def set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply `a.b.0.c=value` to the raw dict (`prefill.0.port=31000`, `env.UCX_TLS=tcp`)."""
    parts = dotted.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            idx = _index(part, dotted, len(node))
            if idx == len(node):
                node.append({})
            node = node[idx]
        else:
            if part not in node or node[part] is None:
                node[part] = [] if part in ROLES else {}
            node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(last, dotted, len(node))
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    else:
        node[last] = value


def _index(part: str, dotted: str, length: int) -> int:
    if not part.isdigit() or int(part) > length:
        raise UserError(f"cannot apply override {dotted!r}: {part!r} is not a valid list index",
                        f"role lists are indexed from 0 and may grow by one, e.g. decode.{length}.port=30002")
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


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist",
                        "pass an existing TOML file with --config, or drop --config to use the profile alone") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}", "check the path and its permissions") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}",
                        "fix the syntax at the line shown (TOML: key = value, [table], [[prefill]])") from None


def load_config(
    config_file: Path | str | None = None,
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    sets: tuple[str, ...] = (),
) -> Config:
    """Resolve all layers into a validated Config.

    `overrides` are the typed CLI flags (already dotted keys, e.g. {"model.path": "/m"}); `sets` are
    `--set` items. Env layer: `V4FLASH_SET` (whitespace-separated KEY=VALUE items); the named
    options' V4FLASH_<OPTION> env vars are resolved by click before they arrive here as overrides.
    """
    env = os.environ if env is None else env
    sources = ["defaults"]
    file_raw: dict[str, Any] = {}
    if config_file:
        file_raw = read_config_file(Path(config_file))
    prof_name = profile or file_raw.pop("profile", None) or DEFAULT_PROFILE
    file_raw.pop("profile", None)
    raw = deep_merge(DEFAULTS, get_profile(prof_name))
    sources.append(f"profile:{prof_name}")
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
    return build_config(raw, prof_name, tuple(sources))


# ---------------------------------------------------------------- typing + validation


def _check_keys(table: Mapping[str, Any], allowed: Mapping[str, Any], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise UserError(f"unknown config key {where}{key!r}",
                            f"valid keys here: {', '.join(sorted(allowed))}")


def _want(value: Any, types: type | tuple[type, ...], key: str, what: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise UserError(f"config key {key} must be {what}, got {value!r}", f"set {key} to {what}")
    if not isinstance(value, types):
        raise UserError(f"config key {key} must be {what}, got {value!r}", f"set {key} to {what}")
    return value


def _choice(value: Any, choices: tuple[str, ...], key: str) -> str:
    if value not in choices:
        raise UserError(f"config key {key} = {value!r} is not accepted by sglang 0.5.13.post1",
                        f"use one of: {', '.join(choices)}")
    return value


def _env_pairs(value: Any, key: str) -> tuple[tuple[str, str], ...]:
    _want(value, dict, key, "a table of NAME = \"value\" strings")
    out = []
    for name, val in value.items():
        if isinstance(val, bool):
            val = "1" if val else "0"
        if not isinstance(val, (str, int, float)):
            raise UserError(f"env value {key}.{name} must be a string, got {val!r}", f'write {name} = "..."')
        out.append((str(name), str(val)))
    return tuple(out)


def _args(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        import shlex

        return tuple(shlex.split(value))
    _want(value, list, key, "a list of strings (or one shell-quoted string)")
    return tuple(str(v) for v in value)


def _port(value: Any, key: str) -> int:
    _want(value, int, key, "a port number (1-65535)")
    if not 1 <= value <= 65535:
        raise UserError(f"config key {key} = {value} is not a valid port", "use a port number between 1 and 65535")
    return value


def _worker(role: str, idx: int, raw: Mapping[str, Any], engine_mem: float | None) -> WorkerSpec:
    where = f"{role}[{idx}]."
    _check_keys(raw, WORKER_DEFAULTS, where)
    w = {**WORKER_DEFAULTS, **raw}
    gpus = _want(w["gpus"], list, where + "gpus", "a list of GPU indices")
    if not gpus or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus):
        raise UserError(f"config key {where}gpus = {gpus!r} must be a non-empty list of GPU indices",
                        f"e.g. {where}gpus = [0, 1, 2, 3]")
    if len(set(gpus)) != len(gpus):
        raise UserError(f"config key {where}gpus = {gpus!r} lists a GPU twice", "list each GPU once")
    tp = _want(w["tp"], int, where + "tp", "a positive integer")
    if tp < 1 or len(gpus) % tp:
        raise UserError(
            f"{role}[{idx}] has {len(gpus)} GPUs, which is not divisible by its TP size {tp}",
            f"give {role}[{idx}] a multiple of {tp} GPUs, or set {where}tp to a divisor of {len(gpus)}",
        )
    if w["port"] is None:
        raise UserError(f"{role}[{idx}] has no port", f"set {where}port (every port is explicit)")
    if w["nccl_port"] is None:
        raise UserError(f"{role}[{idx}] has no nccl_port",
                        f"set {where}nccl_port: implicit NCCL ports race between two servers on one box (dynamo#15099)")
    if role == "prefill" and w["bootstrap_port"] is None:
        raise UserError(f"{role}[{idx}] has no bootstrap_port",
                        f"set {where}bootstrap_port (sglang's default is 8998); the router passes it to decode")
    numa = w["numa_node"]
    if numa is not None:
        _want(numa, int, where + "numa_node", "a NUMA node number (or leave unset to follow the GPUs)")
    cgbs = w["cuda_graph_max_bs"]
    if cgbs is not None:
        _want(cgbs, int, where + "cuda_graph_max_bs", "a positive integer")
    mem = w["mem_fraction_static"] if w["mem_fraction_static"] is not None else engine_mem
    if mem is not None:
        _want(mem, (int, float), where + "mem_fraction_static", "a fraction between 0 and 1")
        if not 0 < float(mem) < 1:
            raise UserError(f"config key {where}mem_fraction_static = {mem} is outside (0, 1)", "use e.g. 0.70")
    return WorkerSpec(
        name=f"{role}-{idx}",
        role=role,
        gpus=tuple(gpus),
        tp=tp,
        numa_node=numa,
        host=_want(w["host"], str, where + "host", "a host/IP string"),
        port=_port(w["port"], where + "port"),
        bootstrap_port=_port(w["bootstrap_port"], where + "bootstrap_port") if w["bootstrap_port"] is not None else None,
        nccl_port=_port(w["nccl_port"], where + "nccl_port"),
        cuda_graph_max_bs=cgbs,
        mem_fraction_static=float(mem) if mem is not None else None,
        extra_args=_args(w["extra_args"], where + "extra_args"),
        env=_env_pairs(w["env"], where + "env"),
    )


def resolve_ucx_module_dir() -> str:
    """Where nixl-cu13 bundles UCX's CUDA transports (nixl#1628); '' when nixl is not installed."""
    loaded = sys.modules.get("nixl_cu13")  # find_spec() may raise for an already imported module
    spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec("nixl_cu13")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        cand = root.parent / "nixl_cu13.libs" / "ucx"
        if cand.is_dir():
            return str(cand)
    return ""


def build_config(raw: Mapping[str, Any], profile: str, sources: tuple[str, ...] = ()) -> Config:
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

    workers: list[WorkerSpec] = []
    roles = ("prefill", "decode") if mode == "pd" else ("server",)
    for role in ROLES:
        entries = raw.get(role) or []
        if role not in roles and entries:
            raise UserError(f"config has [[{role}]] workers but mode = {mode!r}",
                            f"{'use [[prefill]] and [[decode]]' if mode == 'pd' else 'use [[server]]'} for mode {mode!r}, or change mode")
        for i, entry in enumerate(entries):
            workers.append(_worker(role, i, entry, mem))
    for role in roles:
        if not any(w.role == role for w in workers):
            raise UserError(f"mode {mode!r} needs at least one [[{role}]] worker", f"add a [[{role}]] table with gpus, tp and port")

    router = None
    if mode == "pd":
        r = _want(raw["router"], dict, "router", "a table")
        _check_keys(r, DEFAULTS["router"], "router.")
        r = {**DEFAULTS["router"], **r}
        router = RouterSpec(
            host=_want(r["host"], str, "router.host", "a host/IP string"),
            port=_port(r["port"], "router.port"),
            metrics_host=_want(r["metrics_host"], str, "router.metrics_host", "a host/IP string"),
            metrics_port=_port(r["metrics_port"], "router.metrics_port"),
            policy=_want(r["policy"], str, "router.policy", "a router policy name or \"\""),
            extra_args=_args(r["extra_args"], "router.extra_args"),
            env=_env_pairs(r["env"], "router.env"),
        )

    env = dict(_env_pairs(raw["env"], "env"))
    if env.get("UCX_MODULE_DIR") == "auto":
        found = resolve_ucx_module_dir()
        if found:
            env["UCX_MODULE_DIR"] = found
        else:
            del env["UCX_MODULE_DIR"]  # nixl not installed here (plan on a laptop, rehearsal)
    ready_timeout = _want(raw["ready_timeout"], (int, float), "ready_timeout", "seconds")
    grace = _want(raw["grace_period"], (int, float), "grace_period", "seconds")
    if ready_timeout <= 0 or grace < 0:
        raise UserError("ready_timeout must be > 0 and grace_period >= 0", "use e.g. ready_timeout = 3600, grace_period = 30")
    return Config(
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
        engine_extra_args=_args(engine["extra_args"], "engine.extra_args"),
        numa=numa,
        sparse_decode=_want(raw["sparse_decode"], bool, "sparse_decode", "true or false"),
        python=_want(raw["python"], str, "python", "an interpreter path") or sys.executable,
        ready_timeout=float(ready_timeout),
        grace_period=float(grace),
        smoke_prompt=_want(raw["smoke_prompt"], str, "smoke_prompt", "a string"),
        env=tuple(env.items()),
        workers=tuple(workers),
        router=router,
        sources=sources,
    )
