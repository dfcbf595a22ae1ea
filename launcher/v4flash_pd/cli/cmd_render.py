"""`v4flash-pd render slurm|k8s`: a cluster plan for the engines that already run the cluster.

Both write `cluster-plan.json` (the merged config every box or pod rebuilds its plan from) next to
the rendered file. The plan is built and checked here, by the same code `up` runs on each box, so a
cluster that cannot start is refused before anything is submitted.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from v4flash_pd.cli.options import Options, cluster_options, config_layers, config_options, pass_options
from v4flash_pd.cluster import part_plans, plan_document
from v4flash_pd.config.build import build_config, cluster_spec
from v4flash_pd.config.layers import Layers, set_keys
from v4flash_pd.config.load import config_of
from v4flash_pd.config.types import ClusterSpec, Config
from v4flash_pd.errors import UserError
from v4flash_pd.render_k8s import K8sOptions, pod_layer, render
from v4flash_pd.render_k8s import check_options as check_k8s
from v4flash_pd.render_slurm import SlurmOptions, sbatch_script
from v4flash_pd.render_slurm import check_options as check_slurm
from v4flash_pd.safety import check_tree


def _layers(opts: Options) -> Layers:
    """The usual layers, every string free of control characters (each is written into the rendered
    file: the carried plan, manifests, comments). A rendered cluster keeps the profile's addresses
    with --rehearse too (no loopback layer): the other boxes and pods must reach them."""
    layers = config_layers(replace(opts, rehearse=False))
    check_tree(layers[0])
    return layers


def _cluster_config(layers: Layers, rehearse: bool) -> tuple[Config, ClusterSpec, dict[str, Any]]:
    """(Config, its cluster, cluster-plan document); every part's plan must build, as `up` will build it."""
    raw, profile, _ = layers
    cfg = config_of(layers)
    if cfg.cluster is None:
        raise UserError("render slurm needs a cluster: how many boxes, prefill and decode workers",
                        "pass --boxes N --prefill P --decode D (e.g. --boxes 2 --prefill 1 --decode 1), or set "
                        "[cluster] boxes = N in the config file")
    part_plans(cfg, rehearse=rehearse)
    return cfg, cfg.cluster, plan_document(raw, profile, cfg)


def _pod_layers(layers: Layers, opts: K8sOptions) -> Layers:
    """Kubernetes: one pod per worker, the pods are the boxes; laid out from the checked config."""
    raw, profile, sources = layers
    base = build_config(raw, profile, sources)
    if base.mode != "pd":
        raise UserError(f"render k8s places prefill and decode pods behind a router, but mode = {base.mode!r}",
                        "use a pd profile (rtx6000-8x-pd); aggregated serving is one box")
    pods = copy.deepcopy(raw)
    set_keys(pods, pod_layer(cluster_spec(raw, base.mode), base.role("prefill")[0].tp, opts))
    return pods, profile, sources


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}", "pass a writable -o path") from None


def _plan_path(out: Path) -> Path:
    return out.parent / "cluster-plan.json"


@click.group("render", short_help="Render a cluster plan for Slurm (sbatch) or Kubernetes (LeaderWorkerSet).")
def command() -> None:
    """Render a cluster plan (N boxes x 2 NUMA slots, P prefill + D decode TP workers, one router)
    for the scheduler that already runs the cluster; each box or pod then runs `v4flash-pd up`."""


@command.command("slurm", short_help="A plain bash sbatch script (+ cluster-plan.json).")
@config_options
@cluster_options
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The sbatch script to write.")
@click.option("--container", type=click.Choice(["none", "pyxis", "apptainer"]), default="none", show_default=True,
              help="How steps run the image: bare (v4flash-pd on the job's PATH), pyxis/enroot, or apptainer.")
@click.option("--image", default="", help="pyxis: image URI or .sqsh; apptainer: the .sif file.")
@click.option("--rehearse", is_flag=True, help="Stand-in engines instead of SGLang (no GPUs, no model).")
@click.option("--job-name", default="v4flash-pd", show_default=True)
@click.option("--partition", default="", help="#SBATCH --partition.")
@click.option("--time", "time_limit", default="", help="#SBATCH --time.")
@click.option("--account", default="", help="#SBATCH --account.")
@pass_options()
def slurm(opts: Options, output: Path, container: str, image: str, job_name: str, partition: str,
          time_limit: str, account: str) -> None:
    """Write an sbatch script: one `srun --overlap` step per box running `v4flash-pd up --box K`, the
    router step on the first node, hosts resolved at run time, fail fast, clean stop on scancel."""
    slurm_opts = SlurmOptions(container=container, image=image, rehearse=opts.rehearse, job_name=job_name,
                              partition=partition, time_limit=time_limit, account=account)
    check_slurm(slurm_opts)
    cfg, spec, doc = _cluster_config(_layers(opts), opts.rehearse)
    _write(output, sbatch_script(cfg, doc, slurm_opts), 0o755)
    _write(_plan_path(output), json.dumps(doc, indent=2, sort_keys=True) + "\n")
    click.echo(f"wrote {output} ({spec.boxes} boxes, {spec.prefill} prefill + {spec.decode} decode) and "
               f"{_plan_path(output)}; submit with: sbatch {output}")


@command.command("k8s", short_help="LeaderWorkerSet or RoleBasedGroup manifests (+ cluster-plan.json).")
@config_options
@cluster_options
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The YAML file to write.")
@click.option("--flavor", type=click.Choice(["lws", "rbg"]), default="lws", show_default=True,
              help="lws: one LeaderWorkerSet per role (size 1, one TP worker per pod) + a router Deployment; "
                   "rbg: one RoleBasedGroup (prefill, decode, router roles).")
@click.option("--image", default="v4flash-pd:latest", show_default=True, help="The image every GPU node has.")
@click.option("--namespace", default="", help="metadata.namespace of every object (default: kubectl's).")
@click.option("--name", "app_name", default="v4flash", show_default=True, help="Prefix of every object name.")
@click.option("--worker-cpu", default="32", show_default=True,
              help="Whole CPUs per worker pod (requests = limits: Guaranteed QoS, pinned by the CPU Manager).")
@click.option("--worker-memory", default="256Gi", show_default=True, help="Memory per worker pod (requests = limits).")
@click.option("--model-host-path", default="", help="The model dir on every node (default: model.path).")
@click.option("--rehearse", is_flag=True, help="Stand-in engines instead of SGLang (no GPUs, no model).")
@pass_options()
def k8s(opts: Options, output: Path, flavor: str, image: str, namespace: str, app_name: str, worker_cpu: str,
        worker_memory: str, model_host_path: str) -> None:
    """Write Kubernetes manifests: a ConfigMap with the cluster plan, one LeaderWorkerSet per role
    (4 GPUs per pod) and the router as a Deployment (--flavor rbg: one RoleBasedGroup with prefill,
    decode and router roles), and a Service for the router, which waits for every worker's /health."""
    k8s_opts = K8sOptions(flavor=flavor, image=image, namespace=namespace, name=app_name, worker_cpu=worker_cpu,
                          worker_memory=worker_memory, model_host_path=model_host_path)
    check_k8s(k8s_opts)
    if opts.flag("cluster.port_offset"):
        raise UserError("--port-offset is for logical Slurm nodes sharing one network namespace; every pod has its own",
                        "drop --port-offset")
    if opts.flag("cluster.boxes") is not None:
        raise UserError("render k8s places one TP worker per pod and lets Kubernetes pick the nodes: --boxes has no "
                        "meaning here (the pods are --prefill P + --decode D)",
                        "drop --boxes; pass --prefill P --decode D")
    cfg, spec, doc = _cluster_config(_pod_layers(_layers(opts), k8s_opts), opts.rehearse)
    _write(output, render(cfg, doc, k8s_opts, rehearse=opts.rehearse))
    _write(_plan_path(output), json.dumps(doc, indent=2, sort_keys=True) + "\n")
    click.echo(f"wrote {output} ({spec.prefill} prefill + {spec.decode} decode pods, router) and {_plan_path(output)}; "
               f"apply with: kubectl apply -f {output}")
