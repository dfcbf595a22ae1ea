"""The one option set shared by plan/up/doctor, and the one function that turns it into a Plan.

`up` and `doctor` take exactly the same options (`run_options`), so an operator can replace `up`
with `doctor` in a command line and check precisely what would start. Each option names its
V4FLASH_<OPTION> env var explicitly (click's auto prefix would make it V4FLASH_UP_CONFIG);
precedence flags > env > file > profile > defaults lives in config.load_config.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from v4flash_kernels.hook.patches import SWITCHES
from v4flash_pd import topology as topo
from v4flash_pd.config import PATCH_SWITCHES, Config, build_config, merged_layers
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host, probe_host
from v4flash_pd.plan import Plan, build_plan

ON_OFF = click.Choice(["on", "off", "1", "0", "true", "false"], case_sensitive=False)


def _stack(fn: Callable[..., Any], opts: list[Callable[..., Any]]) -> Callable[..., Any]:
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def config_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What decides the Plan: config layers, topology, NUMA mode, the kernel patch switches."""
    opts = [
        click.option("--config", "config_file", type=click.Path(path_type=Path), envvar="V4FLASH_CONFIG",
                     help="TOML config file (layered over the profile)."),
        click.option("--profile", envvar="V4FLASH_PROFILE", help="Built-in profile (default rtx6000-8x-pd)."),
        click.option("--topology", "topology_file", type=click.Path(path_type=Path), envvar="V4FLASH_TOPOLOGY",
                     help="Topology JSON (from `v4flash-pd topology --save`) instead of probing the GPUs; "
                          "`plan` then plans for that box and uses no fact of this one."),
        click.option("--model", envvar="V4FLASH_MODEL", help="Model directory (model.path)."),
        click.option("--numa", type=click.Choice(["bind", "preferred", "off"]), envvar="V4FLASH_NUMA",
                     help="NUMA binding: membind (falls back to preferred when not permitted), preferred, off."),
    ]
    for sw in SWITCHES:
        opts.append(click.option(sw.flag, f"patch_{sw.name}", type=ON_OFF, envvar=sw.env,
                                 help=sw.help + f" Workers get {sw.env}=1/0."))
    opts.append(click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                             help="Override any config key, e.g. --set decode.0.cuda_graph_max_bs=16 "
                                  "(repeatable; env V4FLASH_SET)."))
    return _stack(fn, opts)


def cluster_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The shape of a cluster plan (`plan`, `render`): boxes x NUMA slots, prefill and decode counts."""
    opts = [
        click.option("--boxes", type=click.IntRange(1, 4096), envvar="V4FLASH_BOXES",
                     help="Plan a cluster of N 8-GPU boxes (cluster.boxes); each box holds 2 TP4 workers."),
        click.option("--prefill", "n_prefill", type=click.IntRange(1, 8192), envvar="V4FLASH_PREFILL",
                     help="Prefill workers in the cluster (cluster.prefill)."),
        click.option("--decode", "n_decode", type=click.IntRange(1, 8192), envvar="V4FLASH_DECODE",
                     help="Decode workers in the cluster (cluster.decode)."),
        click.option("--port-offset", type=click.IntRange(0, 10000), envvar="V4FLASH_PORT_OFFSET",
                     help="Add K x N to every port of box K (logical nodes sharing one network namespace; "
                          "real clusters need 0)."),
    ]
    return _stack(fn, opts)


def selection_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Which part of a cluster plan this `up`/`doctor` starts (Slurm: a box; Kubernetes: a pod)."""
    opts = [
        click.option("--cluster-plan", type=click.Path(path_type=Path), envvar="V4FLASH_CLUSTER_PLAN",
                     help="cluster-plan.json from `render slurm|k8s` (default: $V4FLASH_CLUSTER_PLAN_JSON, "
                          "which the rendered sbatch script sets)."),
        click.option("--box", type=int, envvar="V4FLASH_BOX", help="Start this box's workers of the cluster plan."),
        click.option("--role", "cluster_role", type=click.Choice(["router", "prefill", "decode"]),
                     envvar="V4FLASH_ROLE",
                     help="router: wait for every worker's /health, then start the router; prefill|decode: one "
                          "worker (with --index), e.g. one Kubernetes pod."),
        click.option("--index", "cluster_index", type=int, envvar="V4FLASH_INDEX",
                     help="Which prefill/decode worker --role starts (0-based)."),
        click.option("--hosts", envvar="V4FLASH_CLUSTER_HOSTS",
                     help="The boxes' host names or addresses, in box order, comma-separated (cluster.hosts)."),
    ]
    return _stack(fn, opts)


def run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`up`'s options (and therefore `doctor`'s): the config options plus how the run is started."""
    opts = [
        config_options,
        selection_options,
        click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE",
                     help="Same plan, ports, env, numactl and router, with stand-in engines instead of SGLang."),
        click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR",
                     help="Where logs/pids/state go (default: $V4FLASH_RUNS_ROOT/<timestamp>, ./runs)."),
        click.option("--ready-timeout", type=float, envvar="V4FLASH_READY_TIMEOUT",
                     help="Seconds to wait for READY (default 3600: first DeepSeek-V4 start is slow)."),
        click.option("--grace", type=float, envvar="V4FLASH_GRACE", help="Seconds between SIGTERM and SIGKILL."),
        click.option("--detach", is_flag=True, envvar="V4FLASH_DETACH",
                     help="Return once READY; supervise in the background."),
        click.option("--eval", "eval_gate", is_flag=True, envvar="V4FLASH_EVAL", help="Run the accuracy gate before READY."),
        click.option("--eval-questions", type=click.IntRange(1, 10000), default=20, show_default=True,
                     envvar="V4FLASH_EVAL_QUESTIONS", help="Questions the accuracy gate asks."),
        click.option("--eval-min-accuracy", type=click.FloatRange(0.0, 1.0), default=0.8, show_default=True,
                     envvar="V4FLASH_EVAL_MIN_ACCURACY", help="Fraction the gate needs right (0-1)."),
        click.option("--verify-model", type=click.Choice(["size", "full", "off"]), default="size", show_default=True,
                     envvar="V4FLASH_VERIFY_MODEL", help="Check the model dir against its bundle manifest before start."),
        click.option("--no-selfcheck", is_flag=True, envvar="V4FLASH_NO_SELFCHECK",
                     help="Skip the kernel self-check before the workers start (the patches then run unverified)."),
        click.option("--strict-selfcheck", is_flag=True, envvar="V4FLASH_STRICT_SELFCHECK",
                     help="Refuse to start when a kernel patch fails its self-check (default: switch it off and go on)."),
    ]
    return _stack(fn, opts)


@dataclass(frozen=True)
class Resolved:
    config: Config
    host: Host
    plan: Plan
    seconds: float

    @property
    def topology(self) -> topo.Topology:
        return self.host.topology


CLUSTER_FLAGS = (("boxes", "cluster.boxes"), ("n_prefill", "cluster.prefill"), ("n_decode", "cluster.decode"),
                 ("port_offset", "cluster.port_offset"))


def cluster_base(params: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """The cluster plan a box starts from: --cluster-plan FILE, else the sbatch script's env copy."""
    import os

    from v4flash_pd.cluster import read_plan

    selecting = params.get("box") is not None or params.get("cluster_role")
    if params.get("cluster_plan"):
        return read_plan(params["cluster_plan"])
    text = os.environ.get("V4FLASH_CLUSTER_PLAN_JSON", "")
    if selecting and text.strip():
        return read_plan(None, text)
    return None


def config_overrides(params: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The typed flags as dotted config keys, and the `--set` items (flags win over env and file)."""
    overrides: dict[str, Any] = {}
    for key, dotted in CLUSTER_FLAGS:
        if params.get(key) is not None:
            overrides[dotted] = params[key]
    if params.get("hosts"):
        overrides["cluster.hosts"] = params["hosts"]
    if params.get("model"):
        overrides["model.path"] = params["model"]
    if params.get("numa"):
        overrides["numa"] = params["numa"]
    for name, _ in PATCH_SWITCHES:
        value = params.get(f"patch_{name}")
        if value:
            overrides[f"patches.{name}"] = value.lower() in ("on", "1", "true")
    sets = list(params.get("sets") or ())
    if params.get("ready_timeout") is not None:
        sets.append(f"ready_timeout={params['ready_timeout']}")
    if params.get("grace") is not None:
        sets.append(f"grace_period={params['grace']}")
    return overrides, tuple(sets)


def config_layers(params: dict[str, Any]) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """(raw, profile, sources): every layer merged, before validation (`render` stores the raw form)."""
    overrides, sets = config_overrides(params)
    base = cluster_base(params)
    if base is not None and (params.get("config_file") or params.get("profile")):
        raise UserError("--cluster-plan already holds the whole config; --config/--profile would start something "
                        "other than what was rendered",
                        "drop --config/--profile (use --set KEY=VALUE for a deliberate override), or render again")
    return merged_layers(params.get("config_file"), params.get("profile"), overrides, sets=sets, base=base,
                         rehearsal=bool(params.get("rehearse")))


def config_from_params(params: dict[str, Any]) -> Config:
    return build_config(*config_layers(params))


def resolve(params: dict[str, Any], command: str, cfg: Config | None = None) -> Resolved:
    """Config -> Host -> Plan, for `command` in plan | up | doctor.

    `plan --topology FILE` plans for that box (Host.remote: nothing of this machine); `up` and
    `doctor` always run here, so they probe this host and take only the GPU list from the file.
    Missing GPUs and unbindable NUMA nodes are errors only for a real `up`; busy ports, a missing
    model dir and a missing router are errors for any `up` (plan and doctor report them).
    """
    t0 = time.monotonic()
    rehearse = bool(params.get("rehearse"))
    cfg = selected(cfg if cfg is not None else config_from_params(params), params)
    tfile = params.get("topology_file")
    topology = topo.load(tfile) if tfile else None
    if command == "plan" and topology is not None:
        host = Host.remote(topology)
    else:
        host = probe_host(cfg, topology=topology)
    starting = command == "up"
    plan = build_plan(cfg, host, rehearse=rehearse, require_gpus=starting and not rehearse, starting=starting)
    return Resolved(cfg, host, plan, time.monotonic() - t0)


def selected(cfg: Config, params: dict[str, Any]) -> Config:
    """The part of a cluster plan this command plans: a cluster is never started as one box."""
    box, role, index = params.get("box"), params.get("cluster_role"), params.get("cluster_index")
    if cfg.cluster is None and box is None and role is None:
        return cfg
    if cfg.cluster is not None and box is None and role is None:
        raise UserError(
            f"this config is a cluster plan of {cfg.cluster.boxes} boxes; `up` and `doctor` work on one part of it "
            "at a time (a box, or the router)",
            "render it for your cluster (`v4flash-pd render slurm` or `render k8s`), or start a part by hand: "
            f"`up --cluster-plan FILE --box K` on box K (K = 0..{cfg.cluster.boxes - 1}) and `up --cluster-plan FILE "
            "--role router --hosts HOST0,HOST1,...` on box 0",
        )
    if index is not None and role not in ("prefill", "decode"):
        raise UserError("--index picks a prefill or decode worker, and needs --role prefill|decode",
                        "drop --index, or add --role prefill / --role decode")
    from v4flash_pd.cluster import select

    return select(cfg, box=box, role=role, index=index)


def pass_params(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Hand the command all its params as one dict (keeps command signatures short)."""

    @functools.wraps(fn)
    def wrapper(**params: Any) -> Any:
        return fn(params)

    return wrapper
