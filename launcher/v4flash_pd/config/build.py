"""build_config: the merged raw layers -> a validated, frozen `Config`.

Pure: no host facts are read here (the interpreter, nixl's UCX dir and the like are the Host's,
decided by `build_plan`). Each key's value goes through the check `keys.py` declares for it; what
depends on several keys (a TP size that divides the GPUs, ports a role needs, the mode's roles)
is checked here. A cluster's slots are laid out afterwards, by the caller (`layout.expand`).
"""

from __future__ import annotations

from typing import Any, Mapping

from v4flash_pd.config.extraargs import check_worker_args
from v4flash_pd.config.keys import (
    DEFAULTS,
    KEY,
    PATCH_SWITCHES,
    ROLES,
    WORKER_DEFAULTS,
    WORKER_KEY,
)
from v4flash_pd.config.speculative import check_combination
from v4flash_pd.config.speculative import resolve as resolve_speculative
from v4flash_pd.config.types import ClusterSpec, Config, RouterSpec, Speculative, WorkerSpec
from v4flash_pd.config.values import AUTO, api_key_flag, want
from v4flash_pd.errors import UserError


def check_keys(table: Mapping[str, Any], allowed: Mapping[str, Any], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise UserError(f"unknown config key {where}{key!r}",
                            f"valid keys here: {', '.join(sorted(allowed))}")


def _table(raw: Mapping[str, Any], name: str, what: str = "a table") -> dict[str, Any]:
    """A top-level table with its defaults filled in; unknown keys refused."""
    value = raw.get(name)
    table = {} if value is None else want(value, dict, name, what)
    check_keys(table, DEFAULTS[name], f"{name}.")
    return {**DEFAULTS[name], **table}


def _get(table: Mapping[str, Any], path: str) -> Any:
    """The checked value of key `path` (its last part names it in `table`)."""
    return KEY[path].parse(table[path.rsplit(".", 1)[-1]], path)


def build_worker(role: str, idx: int, raw: Any, engine_mem: float | None) -> WorkerSpec:
    """The one builder of a worker from its table (`[[prefill]]` entry `idx`)."""
    where = f"{role}.{idx}."
    want(raw, dict, f"{role}.{idx}", "a table (write it as [[" + role + "]])")
    check_keys(raw, WORKER_DEFAULTS, where)
    w = {**WORKER_DEFAULTS, **raw}

    def get(key: str) -> Any:
        return WORKER_KEY[key].parse(w[key], where + key)

    gpus, tp = get("gpus"), get("tp")
    if len(gpus) % tp:
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
    numa, cgbs = get("numa_node"), get("cuda_graph_max_bs")
    mem = get("mem_fraction_static")
    extra = get("extra_args")
    check_worker_args(extra, where + "extra_args", prefill_chunk=role in ("prefill", "server"))
    return WorkerSpec(
        name=f"{role}-{idx}",
        role=role,
        index=idx,
        gpus=gpus,
        tp=tp,
        numa_node=numa,
        host=get("host"),
        port=get("port"),
        bootstrap_port=get("bootstrap_port"),
        nccl_port=get("nccl_port"),
        cuda_graph_max_bs=cgbs,
        mem_fraction_static=mem if mem is not None else engine_mem,
        extra_args=extra,
        env=get("env"),
    )


def _switch_values(raw: Mapping[str, Any]) -> dict[str, bool | str]:
    table = _table(raw, "patches", "a table of patch = true/false")
    switches: dict[str, bool | str] = {name: _get(table, f"patches.{name}") for name, _ in PATCH_SWITCHES}
    legacy = _get(raw, "sparse_decode")
    if legacy is not None:  # the older top-level key (wins: it is the more specific layer)
        switches["sparse_decode"] = legacy
    return switches


def _patches(raw: Mapping[str, Any]) -> tuple[tuple[str, bool], ...]:
    """(switch, on for this run); an `auto` switch is off until `up`'s self-check switches it on."""
    return tuple((n, v is True or v == "on") for n, v in _switch_values(raw).items())


def _pending(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """The `auto` switches: on once their self-check passed on this box (`up` decides)."""
    return tuple(n for n, v in _switch_values(raw).items() if v == AUTO)


def _speculative(raw: Mapping[str, Any]) -> Speculative:
    t = _table(raw, "speculative")
    return resolve_speculative(*(_get(t, f"speculative.{k}") for k in
                                 ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens")))


def _router(raw: Mapping[str, Any]) -> RouterSpec:
    r = _table(raw, "router")
    router = RouterSpec(
        host=_get(r, "router.host"),
        port=_get(r, "router.port"),
        metrics_host=_get(r, "router.metrics_host"),
        metrics_port=_get(r, "router.metrics_port"),
        policy=_get(r, "router.policy"),
        extra_args=_get(r, "router.extra_args"),
        env=_get(r, "router.env"),
        api_key_file=_get(r, "router.api_key_file"),
        api_key_env=_get(r, "router.api_key_env"),
    )
    flag = api_key_flag(router.extra_args)  # argparse also takes any prefix (--api-ke) as --api-key
    if flag:
        raise UserError(f"router.extra_args passes {flag.split('=', 1)[0]!r}, which the router reads as --api-key, "
                        "on the command line, where `ps`, the .command file and the logs show it",
                        "put the key in a file (router.api_key_file) or a variable (router.api_key_env) instead")
    return router


def client_auth(router: RouterSpec | None) -> tuple[str, str]:
    """Where the key clients send comes from: ("file", path), ("env", NAME) or ("", "")."""
    if router is not None and router.api_key_file:
        return ("file", router.api_key_file)
    if router is not None and router.api_key_env:
        return ("env", router.api_key_env)
    return ("", "")


def cluster_spec(raw: Mapping[str, Any], mode: str) -> ClusterSpec:
    """The checked [cluster] table (every key, even with boxes = 0, where it is not used)."""
    c = _table(raw, "cluster")
    spec = ClusterSpec(**{name: _get(c, f"cluster.{name}") for name in DEFAULTS["cluster"]})
    if spec.boxes and mode != "pd":
        raise UserError(f"cluster.boxes = {spec.boxes} needs mode = \"pd\" (a cluster plan places prefill and decode "
                        f"workers), but mode = {mode!r}",
                        "drop cluster.boxes (aggregated serving is one box), or use the rtx6000-8x-pd profile")
    return spec


def build_config(raw: Mapping[str, Any], profile: str, sources: tuple[str, ...] = ()) -> Config:
    """Every key checked, the workers and the router built: the one-box Config, or a cluster's
    templates (`layout.expand` then places one worker per slot)."""
    check_keys(raw, DEFAULTS, "")
    mode = _get(raw, "mode")
    model = _table(raw, "model")
    engine = _table(raw, "engine")
    # the transfer backend is a pd setting: required there, ignored by one aggregated server
    transfer = KEY["engine.transfer_backend"].check(engine["transfer_backend"], "engine.transfer_backend") \
        if mode == "pd" else None
    engine_extra = _get(engine, "engine.extra_args")
    check_worker_args(engine_extra, "engine.extra_args", prefill_chunk=True)
    engine_mem = _get(engine, "engine.mem_fraction_static")

    workers: list[WorkerSpec] = []
    roles = ("prefill", "decode") if mode == "pd" else ("server",)
    for role in ROLES:
        entries = want(raw.get(role, []), list, role, f"a list of tables (write each as [[{role}]])")
        if role not in roles and entries:
            raise UserError(f"config has [[{role}]] workers but mode = {mode!r}",
                            f"{'use [[prefill]] and [[decode]]' if mode == 'pd' else 'use [[server]]'} "
                            f"for mode {mode!r}, or change mode")
        workers += [build_worker(role, i, entry, engine_mem) for i, entry in enumerate(entries)]
    for role in roles:
        if not any(w.role == role for w in workers):
            raise UserError(f"mode {mode!r} needs at least one [[{role}]] worker",
                            f"add a [[{role}]] table with gpus, tp and port")

    router = _router(raw) if mode == "pd" else None
    cluster = cluster_spec(raw, mode)
    env = _get(raw, "env")
    speculative = _speculative(raw)
    check_combination(speculative, mode, engine_extra, tuple(workers), env)
    return Config(
        profile=profile,
        mode=mode,
        model_path=_get(model, "model.path"),
        served_name=_get(model, "model.served_name"),
        tokenizer_path=_get(model, "model.tokenizer_path"),
        transfer_backend=transfer,
        kv_cache_dtype=_get(engine, "engine.kv_cache_dtype"),
        moe_runner_backend=_get(engine, "engine.moe_runner_backend"),
        trust_remote_code=_get(engine, "engine.trust_remote_code"),
        enable_metrics=_get(engine, "engine.enable_metrics"),
        context_length=_get(engine, "engine.context_length"),
        chunked_prefill_size=_get(engine, "engine.chunked_prefill_size"),
        engine_extra_args=engine_extra,
        numa=_get(raw, "numa"),
        patches=_patches(raw),
        pending_patches=_pending(raw),
        python=_get(raw, "python"),
        ready_timeout=_get(raw, "ready_timeout"),
        grace_period=_get(raw, "grace_period"),
        hang_timeout=_get(raw, "hang_timeout"),
        smoke_prompt=_get(raw, "smoke_prompt"),
        env=env,
        workers=tuple(workers),
        router=router,
        sources=sources,
        cluster=cluster if cluster.boxes else None,
        speculative=speculative,
        client_auth=client_auth(router),
    )
