"""The options plan/up/doctor/render share, as typed records, and the one function that turns them into a Plan.

`up` and `doctor` take exactly the same options (`run_options`), so an operator can replace `up`
with `doctor` in a command line and check precisely what would start. Each option names its
V4FLASH_<OPTION> env var explicitly (click's auto prefix would make it V4FLASH_UP_CONFIG). The
options that set one config key (--model, --numa, the kernel switches, --boxes, --ready-timeout,
...) are generated from that key's `Flag` in config/keys.py; precedence defaults < profile < file <
V4FLASH_SET < V4FLASH_<OPTION> < --set < --<option> lives in config/layers.py.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

import click

from v4flash_pd import topology as topo
from v4flash_pd.cluster import read_plan, select
from v4flash_pd.config.keys import Key, flagged
from v4flash_pd.config.layers import Layers, merged_layers
from v4flash_pd.config.load import config_of
from v4flash_pd.config.types import Config
from v4flash_pd.config.values import AUTO_WORDS as on_off_auto_words
from v4flash_pd.config.values import Integer, on_off, on_off_auto
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host, probe_host
from v4flash_pd.plan import Plan, build_plan

# What a command does with the plan decides how it is resolved (`resolve`): `plan` may plan another
# box (--topology FILE); `up` starts it (what cannot start is refused); `doctor` and `selfcheck`
# run on this box and start no server (what `up` would refuse, they report).
Command = Literal["plan", "up", "doctor", "selfcheck"]
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
ON_OFF = click.Choice(["on", "off", "1", "0", "true", "false"], case_sensitive=False)
ON_OFF_AUTO = click.Choice(["auto", "on", "off", "1", "0", "true", "false"], case_sensitive=False)
F = TypeVar("F", bound=Callable[..., Any])


def _stack(fn: F, opts: list[Decorator]) -> F:
    for opt in reversed(opts):
        fn = opt(fn)  # type: ignore[assignment]
    return fn


def dest(key: Key) -> str:
    """The click parameter name of a key's flag: model.path -> model_path."""
    return key.path.replace(".", "_")


def _click_type(key: Key) -> Any:
    flag = key.flag
    assert flag is not None
    if key.type is bool:
        return ON_OFF
    if key.choices == on_off_auto_words:
        return ON_OFF_AUTO
    if key.choices:
        return click.Choice(list(key.choices))
    if key.type is int:
        if not isinstance(key.check, Integer):
            return click.IntRange(flag.low, None)
        rng = key.check  # the key's range, declared once with its check
        return click.IntRange(rng.low if flag.low is None else max(flag.low, rng.low), rng.high)
    return float if key.type is float else str  # a list key's flag is one comma-separated word


def key_flags(group: str) -> Decorator:
    """The typed options of every key whose flag is in `group` (config, cluster, hosts or run)."""
    def add(fn: F) -> F:
        return _stack(fn, [click.option(k.flag.name, dest(k), type=_click_type(k), envvar=k.flag.env, help=k.flag.help)
                           for k in flagged() if k.flag is not None and k.flag.group == group])
    return add


def config_options(fn: F) -> F:
    """What decides the Plan: config layers, topology, and the config keys' own flags."""
    return _stack(fn, [
        click.option("--config", "config_file", type=click.Path(path_type=Path), envvar="V4FLASH_CONFIG",
                     help="TOML config file (layered over the profile)."),
        click.option("--profile", envvar="V4FLASH_PROFILE", help="Built-in profile (default rtx6000-8x-pd)."),
        click.option("--topology", "topology_file", type=click.Path(path_type=Path), envvar="V4FLASH_TOPOLOGY",
                     help="Topology JSON (from `v4flash-pd topology --save`) instead of probing the GPUs; "
                          "`plan` then plans for that box and uses no fact of this one."),
        key_flags("config"),
        click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                     help="Override any config key, e.g. --set decode.0.cuda_graph_max_bs=16 "
                          "(repeatable; env V4FLASH_SET)."),
    ])


def cluster_options(fn: F) -> F:
    """The shape of a cluster plan (`plan`, `render`): boxes x NUMA slots, prefill and decode counts."""
    return _stack(fn, [key_flags("cluster")])


def hosts_option(fn: F) -> F:
    """Where a cluster plan's boxes are (`plan`, `up`, `doctor`)."""
    return _stack(fn, [key_flags("hosts")])


def selection_options(fn: F) -> F:
    """Which part of a cluster plan this `up`/`doctor` starts (Slurm: a box; Kubernetes: a pod)."""
    return _stack(fn, [
        click.option("--cluster-plan", type=click.Path(path_type=Path), envvar="V4FLASH_CLUSTER_PLAN",
                     help="cluster-plan.json from `render slurm|k8s` (default: $V4FLASH_CLUSTER_PLAN_JSON, "
                          "which the rendered sbatch script sets)."),
        click.option("--box", type=int, envvar="V4FLASH_BOX", help="Start this box's workers of the cluster plan."),
        click.option("--role", type=click.Choice(["router", "prefill", "decode"]), envvar="V4FLASH_ROLE",
                     help="router: wait for every worker's /health, then start the router; prefill|decode: one "
                          "worker (with --index), e.g. one Kubernetes pod."),
        click.option("--index", type=int, envvar="V4FLASH_INDEX",
                     help="Which prefill/decode worker --role starts (0-based)."),
        hosts_option,
    ])


def run_options(fn: F) -> F:
    """`up`'s options (and therefore `doctor`'s): the config options plus how the run is started."""
    return _stack(fn, [
        config_options,
        selection_options,
        click.option("--rehearse", is_flag=True, envvar="V4FLASH_REHEARSE",
                     help="Same plan, ports, env, numactl and router, with stand-in engines instead of SGLang."),
        click.option("--run-dir", type=click.Path(path_type=Path), envvar="V4FLASH_RUN_DIR",
                     help="Where logs/pids/state go (default: $V4FLASH_RUNS_ROOT/<timestamp>, ./runs)."),
        key_flags("run"),
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
    ])


@dataclass(frozen=True)
class Options:
    """What decides the Config and the Plan (plan, up, doctor, render)."""

    config_file: Path | None = None
    profile: str | None = None
    topology_file: Path | None = None
    sets: tuple[str, ...] = ()
    # The typed options of config keys as (dotted key, value): given on the command line, or by
    # their V4FLASH_<OPTION> variable (a lower layer than --set).
    flags: tuple[tuple[str, Any], ...] = ()
    env_flags: tuple[tuple[str, Any], ...] = ()
    rehearse: bool = False
    # Which part of a cluster plan (up, doctor).
    cluster_plan: Path | None = None
    box: int | None = None
    role: str | None = None
    index: int | None = None

    def flag(self, path: str) -> Any:
        """The value a typed option gave key `path` (command line or env), or None."""
        return dict(self.env_flags + self.flags).get(path)


@dataclass(frozen=True)
class RunOptions:
    """How `up` runs the plan (doctor takes them too, and ignores them)."""

    run_dir: Path | None = None
    detach: bool = False
    eval_gate: bool = False
    eval_questions: int = 20
    eval_min_accuracy: float = 0.8
    verify_model: str = "size"
    no_selfcheck: bool = False
    strict_selfcheck: bool = False


def _typed(key: Key, value: Any) -> Any:
    if key.type is bool:
        return on_off(value, key.path)
    return on_off_auto(value, key.path) if key.choices == on_off_auto_words else value


def _options(params: dict[str, Any]) -> Options:
    """Options from click's parameters; each key flag's value goes to the layer its source says."""
    ctx = click.get_current_context()
    given: list[tuple[str, Any]] = []
    from_env: list[tuple[str, Any]] = []
    for key in flagged():
        value = params.pop(dest(key), None)
        if value is None:
            continue
        source = ctx.get_parameter_source(dest(key))
        (from_env if source == click.core.ParameterSource.ENVIRONMENT else given).append((key.path, _typed(key, value)))
    names = {f.name for f in fields(Options)} - {"flags", "env_flags"}
    picked = {n: params.pop(n) for n in list(params) if n in names}
    if "sets" in picked:
        picked["sets"] = tuple(picked["sets"])
    return Options(**picked, flags=tuple(given), env_flags=tuple(from_env))


def pass_options(run: bool = False) -> Decorator:
    """Hand the command typed `Options` (and `RunOptions` when `run`) instead of click's parameters;
    the command's own options stay keyword arguments."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(**params: Any) -> Any:
            opts = _options(params)
            if not run:
                return fn(opts, **params)
            names = {f.name for f in fields(RunOptions)}
            return fn(opts, RunOptions(**{n: params.pop(n) for n in list(params) if n in names}), **params)
        return wrapper
    return wrap


# ------------------------------------------------------------------ options -> Config -> Host -> Plan


def cluster_base(opts: Options) -> tuple[dict[str, Any], str] | None:
    """The cluster plan a box starts from: --cluster-plan FILE, else the sbatch script's env copy."""
    if opts.cluster_plan:
        return read_plan(opts.cluster_plan)
    text = os.environ.get("V4FLASH_CLUSTER_PLAN_JSON", "")
    if (opts.box is not None or opts.role) and text.strip():
        return read_plan(None, text)
    return None


def config_layers(opts: Options) -> Layers:
    """(raw, profile, sources): every layer merged, before validation (`render` stores the raw form)."""
    base = cluster_base(opts)
    if base is not None and (opts.config_file or opts.profile):
        raise UserError("--cluster-plan already holds the whole config; --config/--profile would start something "
                        "other than what was rendered",
                        "drop --config/--profile (use --set KEY=VALUE for a deliberate override), or render again")
    # a one-box rehearsal listens on 127.0.0.1 unless a layer above the profile says otherwise
    return merged_layers(opts.config_file, opts.profile, dict(opts.flags), sets=opts.sets, base=base,
                         env_overrides=dict(opts.env_flags), rehearsal=opts.rehearse)


def load(opts: Options) -> Config:
    """The validated Config the options describe (a cluster's slots laid out, all of them)."""
    return config_of(config_layers(opts))


def selected(cfg: Config, opts: Options) -> Config:
    """The part of a cluster plan this command plans: a cluster is never started as one box."""
    if cfg.cluster is None and opts.box is None and opts.role is None:
        return cfg
    if cfg.cluster is not None and opts.box is None and opts.role is None:
        raise UserError(
            f"this config is a cluster plan of {cfg.cluster.boxes} boxes; `up` and `doctor` work on one part of it "
            "at a time (a box, or the router)",
            "render it for your cluster (`v4flash-pd render slurm` or `render k8s`), or start a part by hand: "
            f"`up --cluster-plan FILE --box K` on box K (K = 0..{cfg.cluster.boxes - 1}) and `up --cluster-plan FILE "
            "--role router --hosts HOST0,HOST1,...` on box 0",
        )
    if opts.index is not None and opts.role not in ("prefill", "decode"):
        raise UserError("--index picks a prefill or decode worker, and needs --role prefill|decode",
                        "drop --index, or add --role prefill / --role decode")
    return select(cfg, box=opts.box, role=opts.role, index=opts.index)


@dataclass(frozen=True)
class Resolved:
    config: Config  # the part of the config this command plans
    host: Host
    plan: Plan

    @property
    def topology(self) -> topo.Topology:
        return self.host.topology


def prepare(opts: Options, command: Command, cfg: Config | None = None) -> tuple[Config, Host]:
    """The part of the config this command plans (from `cfg` when it was loaded already) and the Host
    it is planned for. `plan --topology FILE` plans for that box (Host.remote: nothing of this
    machine); `up`, `doctor` and `selfcheck` always run here, so they probe this host and take only
    the GPU list from the file."""
    cfg = selected(cfg if cfg is not None else load(opts), opts)
    topology = topo.load(opts.topology_file) if opts.topology_file else None
    if command == "plan" and topology is not None:
        return cfg, Host.remote(topology)
    return cfg, probe_host(cfg, topology=topology)


def resolve(opts: Options, command: Command, prepared: tuple[Config, Host] | None = None) -> Resolved:
    """Options -> Config -> Host -> Plan, for `command` (`prepared`: what `prepare` gave already).

    Missing GPUs and unbindable NUMA nodes are errors only for a real `up`; busy ports, a missing
    model dir and a missing router are errors for any `up` (plan, doctor and selfcheck report them:
    `selfcheck` needs only the plan's GPUs and interpreter, and checks that the GPUs are here itself).
    """
    cfg, host = prepared if prepared is not None else prepare(opts, command)
    starting = command == "up"
    plan = build_plan(cfg, host, rehearse=opts.rehearse, require_gpus=starting and not opts.rehearse,
                      starting=starting)
    return Resolved(cfg, host, plan)
