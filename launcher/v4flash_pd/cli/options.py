"""Options shared by plan/up/doctor, and the one function that turns them into a Plan.

Each option names its V4FLASH_<OPTION> env var explicitly (click's auto prefix would make it
V4FLASH_PLAN_CONFIG); precedence flags > env > file > profile > defaults lives in config.load_config.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from v4flash_pd import topology as topo
from v4flash_pd.config import Config, load_config
from v4flash_pd.hostprobe import HostNuma, probe_numa
from v4flash_pd.model import ModelCheck, check_model_dir
from v4flash_pd.plan import Plan, build_plan

ON_OFF = click.Choice(["on", "off", "1", "0", "true", "false"], case_sensitive=False)


def plan_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--config", "config_file", type=click.Path(path_type=Path), envvar="V4FLASH_CONFIG",
                     help="TOML config file (layered over the profile)."),
        click.option("--profile", envvar="V4FLASH_PROFILE", help="Built-in profile (default rtx6000-8x-pd)."),
        click.option("--topology", "topology_file", type=click.Path(path_type=Path), envvar="V4FLASH_TOPOLOGY",
                     help="Topology JSON (from `v4flash-pd topology --save`) instead of probing this host."),
        click.option("--model", envvar="V4FLASH_MODEL", help="Model directory (model.path)."),
        click.option("--numa", type=click.Choice(["bind", "preferred", "off"]), envvar="V4FLASH_NUMA",
                     help="NUMA binding: membind (falls back to preferred when not permitted), preferred, off."),
        click.option("--sparse-decode", type=ON_OFF, envvar="V4FLASH_SPARSE_DECODE",
                     help="Our Triton sparse-MLA decode in SGLang workers (on) or upstream's (off)."),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                     help="Override any config key, e.g. --set decode.0.cuda_graph_max_bs=16 (repeatable; env V4FLASH_SET)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@dataclass(frozen=True)
class Resolved:
    config: Config
    topology: topo.Topology
    host: HostNuma | None
    model: ModelCheck
    plan: Plan
    seconds: float


def resolve(params: dict[str, Any], *, rehearse: bool = False, local: bool | None = None,
            for_up: bool = False) -> Resolved:
    """Config -> Topology -> Plan. `local` (default: no --topology) probes this host's NUMA too;
    missing GPUs are an error only for a real `up` (plan/rehearsal warn)."""
    t0 = time.monotonic()
    overrides: dict[str, Any] = {}
    if params.get("model"):
        overrides["model.path"] = params["model"]
    if params.get("numa"):
        overrides["numa"] = params["numa"]
    if params.get("sparse_decode"):
        overrides["sparse_decode"] = params["sparse_decode"].lower() in ("on", "1", "true")
    cfg = load_config(params.get("config_file"), params.get("profile"), overrides, sets=tuple(params.get("sets") or ()))
    tfile = params.get("topology_file")
    topology = topo.load(tfile) if tfile else topo.probe()
    local = (tfile is None) if local is None else local
    host = probe_numa() if local or rehearse else None
    model = check_model_dir(cfg.model_path)
    plan = build_plan(cfg, topology, host, rehearse=rehearse, model=model, require_gpus=for_up and not rehearse)
    return Resolved(cfg, topology, host, model, plan, time.monotonic() - t0)


def pass_params(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Hand the command all its params as one dict (keeps command signatures short)."""

    @functools.wraps(fn)
    def wrapper(**params: Any) -> Any:
        return fn(params)

    return wrapper
