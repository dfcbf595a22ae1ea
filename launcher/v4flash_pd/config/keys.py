"""Every config key, declared once: its type, default, check, help and (optional) command-line flag.

In the spirit of SGLang's `ServerArgs` fields: a new key is one `Key` here (plus where `build`
reads it into `Config`), and everything else derives from this table: the defaults layer
(`DEFAULTS`), the unknown-key errors, the typed flags of `plan`/`up`/`doctor`/`render`
(`cli/options.py`), and tests/launcher/test_config_keys.py, which proves every key has all of them.
Keys of a worker table (`[[prefill]]`, `[[decode]]`, `[[server]]`) are `WORKER_KEYS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from v4flash_kernels.hook.patches import SWITCHES, Switch
from v4flash_pd.config import values as v
from v4flash_pd.config.values import BadValue, Check
from v4flash_pd.errors import UserError
from v4flash_pd.profiles import DEFAULT_PROFILE, get_profile

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
# UCX transports that cross a box (cuda_ipc and sm only reach GPUs and memory of the same host).
NETWORK_TRANSPORTS = ("tcp", "rc", "rc_x", "rc_v", "dc", "dc_x", "ud", "ud_x", "ud_v")
ROLES = ("prefill", "decode", "server")
# The kernel switches the import hook reads in every worker, from the kernels' one registry (an
# import-free table): (name, env variable). Config key `patches.<name>`; `up --<name>` on/off.
PATCH_SWITCHES: tuple[tuple[str, str], ...] = tuple((s.name, s.env) for s in SWITCHES)


@dataclass(frozen=True)
class Flag:
    """A typed option that sets one key; it wins over every other layer. `env` is read by the
    command line when the flag is not given. `group` says which commands take it: config (plan,
    up, doctor, render), cluster (plan, render), hosts (plan, up, doctor), run (up, doctor)."""

    name: str
    env: str
    group: str
    help: str
    # An integer flag accepts its key's range (`values.Integer`, declared once with the key's check);
    # `low` raises the floor for the flag alone (`--boxes 0` would only spell "no --boxes").
    low: int | None = None


@dataclass(frozen=True)
class Key:
    path: str  # dotted config key (in WORKER_KEYS: the key inside one worker table)
    type: type  # what `check` returns
    default: Any  # the defaults layer's value (None: unset, only where `optional`)
    check: Check
    help: str
    flag: Flag | None = None
    optional: bool = False  # None stands for "unset" (SGLang's own default, or a fallback)
    choices: tuple[str, ...] = ()  # the accepted words, where `check` is a choice
    required: bool = False  # no usable default: the default is a placeholder `check` refuses

    def parse(self, value: Any, key: str | None = None) -> Any:
        """The checked value of this key (None stays None for an optional key). A value of the wrong
        type or range is refused with a fix that works: the `--set` of the default profile's value."""
        if value is None and self.optional:
            return None
        try:
            return self.check(value, key or self.path)
        except BadValue as exc:
            raise UserError(exc.message, set_hint(exc.key, exc.what)) from None


def _choice(path: str, choices: tuple[str, ...], default: str | None, help: str, *,
            flag: Flag | None = None, optional: bool = False) -> Key:
    return Key(path, str, default, v.choice(choices), help, flag, optional, choices)


def _switch_key(sw: Switch) -> Key:
    """A patch's key. One that is on by default only where verified (`verified_only`) takes auto = off in the
    plan, switched on by `up` once its self-check passed; the others are plain on/off."""
    if not sw.verified_only:
        return Key(f"patches.{sw.name}", bool, sw.default_on, v.on_off, sw.help,
                   Flag(sw.flag, sw.env, "config", sw.help + f" Workers get {sw.env}=1/0."))
    return Key(f"patches.{sw.name}", str, v.AUTO, v.on_off_auto, sw.help,
               Flag(sw.flag, sw.env, "config", sw.help + f" auto (default), on or off; workers get {sw.env}=1/0."),
               choices=v.AUTO_WORDS)


KEYS: tuple[Key, ...] = (
    _choice("mode", MODES, "pd", "pd: prefill + decode workers behind a router; aggregated: one server"),
    Key("model.path", str, "", v.text("a directory path"), "the model directory",
        Flag("--model", "V4FLASH_MODEL", "config", "Model directory (model.path).")),
    Key("model.served_name", str, "", v.text("a name"), "the model name clients see (SGLang's default: the path)"),
    Key("model.tokenizer_path", str, "", v.text("a directory path"), "the tokenizer directory (default: the model's)"),
    _choice("engine.transfer_backend", TRANSFER_BACKENDS, "nixl", "the KV transfer between prefill and decode (pd)",
            optional=True),
    _choice("engine.kv_cache_dtype", KV_CACHE_DTYPES, "fp8_e4m3", "the KV cache element type"),
    _choice("engine.moe_runner_backend", MOE_RUNNER_BACKENDS, "marlin", "SGLang's MoE runner"),
    Key("engine.mem_fraction_static", float, None, v.fraction, "GPU memory fraction for weights and KV (every worker)",
        optional=True),
    Key("engine.trust_remote_code", bool, True, v.flag, "pass --trust-remote-code"),
    Key("engine.enable_metrics", bool, False, v.flag, "pass --enable-metrics (Prometheus /metrics on each worker)"),
    Key("engine.context_length", int, None, v.integer("a number of tokens, e.g. 131072", 1),
        "the context length SGLang sizes the KV pool and graphs for", optional=True),
    Key("engine.chunked_prefill_size", int, None, v.prefill_chunk,
        f"tokens per prefill chunk (at most {v.MAX_PREFILL_CHUNK} on sm_120)", optional=True),
    Key("engine.extra_args", tuple, [], v.args, "more SGLang flags for every worker"),
    _choice("numa", NUMA_MODES, "bind", "NUMA binding of each worker to its GPUs' node",
            flag=Flag("--numa", "V4FLASH_NUMA", "config",
                      "NUMA binding: membind (falls back to preferred when not permitted), preferred, off.")),
    *(_switch_key(sw) for sw in SWITCHES),  # in the registry's order, as --help lists the flags
    Key("sparse_decode", bool, None, v.on_off, "older spelling of patches.sparse_decode (wins over it)", optional=True),
    # Speculative decoding with the model's MTP (NextN) layer, off while num_steps = 0. The same flags go
    # to every worker (prefill stores the draft state that decode rebuilds); config/speculative.py refuses
    # what the pinned sglang would refuse or silently change.
    Key("speculative.algorithm", str, v.SPEC_ALGORITHM, v.spec_algorithm,
        "the speculative algorithm (sglang 0.5.13.post1 takes only EAGLE for DeepSeek-V4)", choices=(v.SPEC_ALGORITHM,)),
    Key("speculative.num_steps", int, 0, v.integer("a number of draft steps per verify (0 = off)", 0, 64),
        "draft steps per verify; 0 = speculative decoding off",
        Flag("--mtp", "V4FLASH_MTP", "config",
             "Speculative decoding with the model's MTP layer: N draft steps per verify (EAGLE, top-k 1, N+1 draft "
             "tokens) on every worker; 0 = off (speculative.num_steps).")),
    Key("speculative.eagle_topk", int, 1, v.spec_topk, "draft tokens kept per step (DeepSeek-V4: 1, a chain)"),
    Key("speculative.num_draft_tokens", int, None, v.integer("a number of draft tokens per verify (num_steps + 1)", 1),
        "tokens verified per step (unset: num_steps + 1, the only value SGLang keeps at top-k 1)", optional=True),
    Key("python", str, "", v.text("an interpreter path"),
        "the workers' interpreter (\"\": the one running v4flash-pd here, python3 on another box)"),
    Key("ready_timeout", float, 3600.0, v.seconds(strict=True), "seconds `up` waits for READY",
        Flag("--ready-timeout", "V4FLASH_READY_TIMEOUT", "run",
             "Seconds to wait for READY (default 3600: first DeepSeek-V4 start is slow).")),
    Key("grace_period", float, 30.0, v.seconds(strict=False), "seconds between SIGTERM and SIGKILL when stopping",
        Flag("--grace", "V4FLASH_GRACE", "run", "Seconds between SIGTERM and SIGKILL.")),
    Key("hang_timeout", float, 60.0, v.seconds(strict=True),
        "seconds without a healthy /health answer before a process counts as hung"),
    Key("smoke_prompt", str, "The capital of France is", v.text("a string"),
        "the prompt of the one generate READY waits for"),
    Key("env", tuple, {}, v.env_table, "environment of every worker (NAME = \"value\")"),
    # A cluster plan (config/layout.py): `boxes` 8-GPU boxes x len(slot_gpus) NUMA slots, `prefill` +
    # `decode` of them TP workers built from [[prefill]]/[[decode]] entry 0, one router on box 0.
    # boxes = 0: one box, the [[prefill]]/[[decode]] lists as written.
    Key("cluster.boxes", int, 0, v.integer("a number of 8-GPU boxes (0 = one box, no cluster plan)", 0, 4096),
        "boxes of a cluster plan (0: one box)",
        Flag("--boxes", "V4FLASH_BOXES", "cluster",
             "Plan a cluster of N 8-GPU boxes (cluster.boxes); each box holds 2 TP4 workers.", low=1)),
    Key("cluster.prefill", int, 1, v.integer("a number of prefill workers", 1, 8192), "prefill workers in the cluster",
        Flag("--prefill", "V4FLASH_PREFILL", "cluster", "Prefill workers in the cluster (cluster.prefill).")),
    Key("cluster.decode", int, 1, v.integer("a number of decode workers", 1, 8192), "decode workers in the cluster",
        Flag("--decode", "V4FLASH_DECODE", "cluster", "Decode workers in the cluster (cluster.decode).")),
    Key("cluster.slot_gpus", tuple, [[0, 1, 2, 3], [4, 5, 6, 7]], v.slot_gpus,
        "the GPUs of each NUMA slot of a box (one TP worker per slot)"),
    Key("cluster.http_port", int, 30000, v.port, "slot 0's HTTP port (slot s: + s)"),
    Key("cluster.bootstrap_port", int, 8998, v.port, "slot 0's prefill bootstrap port (slot s: + s)"),
    Key("cluster.nccl_port", int, 30010, v.port, "slot 0's NCCL port (slot s: + s)"),
    Key("cluster.port_offset", int, 0, v.integer("a port offset per box (0 on a real cluster)", 0, 10000),
        "added K x offset to every port of box K (logical nodes sharing one network namespace)",
        Flag("--port-offset", "V4FLASH_PORT_OFFSET", "cluster",
             "Add K x N to every port of box K (logical nodes sharing one network namespace; real clusters need 0).")),
    Key("cluster.bind_host", str, "advertise", v.host,
        "where cluster workers listen: \"advertise\" = each box's own cluster.hosts entry (0.0.0.0 while no hosts "
        "are known), or an address for every box"),
    _choice("cluster.network", NETWORK_TRANSPORTS, "tcp", "the UCX transport KV takes between boxes"),
    Key("cluster.hosts", tuple, [], v.hosts, "the boxes' host names, in box order",
        Flag("--hosts", "V4FLASH_CLUSTER_HOSTS", "hosts",
             "The boxes' host names or addresses, in box order, comma-separated (cluster.hosts; `plan` shows "
             "box-0, box-1, ... until they are known).")),
    Key("router.host", str, "0.0.0.0", v.host, "where the router listens"),
    Key("router.port", int, 8000, v.port, "the router's port (the front door)"),
    Key("router.metrics_host", str, "127.0.0.1", v.host, "where the router's Prometheus metrics listen"),
    Key("router.metrics_port", int, 29000, v.port, "the router's Prometheus port"),
    Key("router.policy", str, "", v.text("a router policy name or \"\""), "the router's load-balancing policy"),
    Key("router.api_key_file", str, "", v.text("a file path"), "file holding the API key clients must send"),
    Key("router.api_key_env", str, "", v.key_env_name, "environment variable holding the API key"),
    Key("router.extra_args", tuple, [], v.args, "more sglang-router flags"),
    Key("router.env", tuple, {}, v.env_table, "environment of the router"),
)

WORKER_KEYS: tuple[Key, ...] = (
    Key("gpus", tuple, [], v.gpu_list, "the worker's GPUs (a multiple of tp)", required=True),
    Key("tp", int, 1, v.integer("a positive integer", 1), "tensor-parallel size (len(gpus) / tp data-parallel copies)"),
    Key("numa_node", int, None, v.integer("a NUMA node number (or leave it unset to follow the GPUs)", 0),
        "the NUMA node to bind to (unset: the GPUs' node)", optional=True),
    Key("host", str, "127.0.0.1", v.host, "where the worker listens"),
    Key("port", int, None, v.port, "HTTP port (every port is explicit)", required=True),
    Key("bootstrap_port", int, None, v.port, "PD bootstrap port (required for prefill)", optional=True),
    Key("nccl_port", int, None, v.port, "NCCL port (implicit ones race between two servers)", required=True),
    Key("cuda_graph_max_bs", int, None, v.integer("a positive integer", 1), "largest CUDA-graph batch", optional=True),
    Key("mem_fraction_static", float, None, v.fraction, "GPU memory fraction (default: engine's)", optional=True),
    Key("extra_args", tuple, [], v.args, "more SGLang flags for this worker"),
    Key("env", tuple, {}, v.env_table, "environment of this worker"),
)

KEY = {k.path: k for k in KEYS}
WORKER_KEY = {k.path: k for k in WORKER_KEYS}


def _nested(keys: tuple[Key, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in keys:
        *tables, last = k.path.split(".")
        node = out
        for t in tables:
            node = node.setdefault(t, {})
        node[last] = k.default
    return out


# The defaults layer: the vocabulary of a config file, each key at its default, and no workers.
DEFAULTS: dict[str, Any] = {**_nested(KEYS), **{role: [] for role in ROLES}}
WORKER_DEFAULTS: dict[str, Any] = _nested(WORKER_KEYS)


def flagged() -> tuple[Key, ...]:
    return tuple(k for k in KEYS if k.flag is not None)


def _over(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on `base`, tables merged key by key (enough for a profile over the defaults)."""
    out = dict(base)
    for k, value in over.items():
        out[k] = _over(out[k], value) if isinstance(value, dict) and isinstance(out.get(k), dict) else value
    return out


def example(key: str) -> str:
    """`--set KEY=VALUE` with the value the default profile gives `key` (role entries beyond the
    profile's take entry 0's; a worker key the profile leaves out, its default), or "" when it has none."""
    node: Any = _over(DEFAULTS, get_profile(DEFAULT_PROFILE))
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


def set_hint(key: str, what: str) -> str:
    """A fix that works, not the error again: `--set prefill.0.tp=4 (a positive integer)`."""
    found = example(key)
    return f"{found} ({what})" if found else f"set {key} to {what}"
