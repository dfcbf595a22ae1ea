"""`v4flash-pd render slurm|k8s`: a cluster plan for the engines that already run the cluster.

Both write `cluster-plan.json` (the merged config every box or pod rebuilds its plan from) next to
the rendered file. The plan is built and checked here, by the same code `up` runs on each box, so a
cluster that cannot start is refused before anything is submitted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from v4flash_pd.cli.options import cluster_options, config_options, pass_params
from v4flash_pd.errors import UserError
from v4flash_pd.safety import check_tree


def _cluster_config(params: dict[str, Any], edit: Any = None) -> tuple[Any, dict[str, Any]]:
    """(Config, cluster-plan document) from the usual layers plus the cluster flags."""
    from v4flash_pd.cli.options import config_layers
    from v4flash_pd.cluster import part_plans, plan_document
    from v4flash_pd.config import build_config

    raw, profile, sources = config_layers(params)
    check_tree(raw)  # every value is written into the rendered file (the carried plan, manifests, comments)
    if edit is not None:  # Kubernetes: one pod per worker, the pods are the "boxes"
        raw = edit(raw)
    elif not (raw.get("cluster") or {}).get("boxes"):
        raise UserError("render slurm needs a cluster: how many boxes, prefill and decode workers",
                        "pass --boxes N --prefill P --decode D (e.g. --boxes 2 --prefill 1 --decode 1), or set "
                        "[cluster] boxes = N in the config file")
    cfg = build_config(raw, profile, sources)
    assert cfg.cluster is not None
    part_plans(cfg, rehearse=bool(params.get("rehearse")))  # every box's plan must build, as `up` will build it
    return cfg, plan_document(raw, profile, cfg)


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
@pass_params
def slurm(params: dict[str, Any]) -> None:
    """Write an sbatch script: one `srun --overlap` step per box running `v4flash-pd up --box K`, the
    router step on the first node, hosts resolved at run time, fail fast, clean stop on scancel."""
    from v4flash_pd.render_slurm import SlurmOptions, check_options, sbatch_script

    opts = SlurmOptions(container=params["container"], image=params["image"], rehearse=params["rehearse"],
                        job_name=params["job_name"], partition=params["partition"], time_limit=params["time_limit"],
                        account=params["account"])
    check_options(opts)
    cfg, doc = _cluster_config(params)
    out: Path = params["output"]
    _write(out, sbatch_script(cfg, doc, opts), 0o755)
    _write(_plan_path(out), json.dumps(doc, indent=2, sort_keys=True) + "\n")
    spec = cfg.cluster
    click.echo(f"wrote {out} ({spec.boxes} boxes, {spec.prefill} prefill + {spec.decode} decode) and "
               f"{_plan_path(out)}; submit with: sbatch {out}")


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
@pass_params
def k8s(params: dict[str, Any]) -> None:
    """Write Kubernetes manifests: a ConfigMap with the cluster plan, one LeaderWorkerSet per role
    (4 GPUs per pod) and the router as a Deployment (--flavor rbg: one RoleBasedGroup with prefill,
    decode and router roles), and a Service for the router, which waits for every worker's /health."""
    from v4flash_pd.render_k8s import K8sOptions, check_options, pod_cluster, render

    opts = K8sOptions(flavor=params["flavor"], image=params["image"], namespace=params["namespace"],
                      name=params["app_name"], worker_cpu=params["worker_cpu"], worker_memory=params["worker_memory"],
                      model_host_path=params["model_host_path"])
    check_options(opts)
    if params.get("port_offset"):
        raise UserError("--port-offset is for logical Slurm nodes sharing one network namespace; every pod has its own",
                        "drop --port-offset")
    if params.get("boxes") is not None:
        raise UserError("render k8s places one TP worker per pod and lets Kubernetes pick the nodes: --boxes has no "
                        "meaning here (the pods are --prefill P + --decode D)",
                        "drop --boxes; pass --prefill P --decode D")
    cfg, doc = _cluster_config(params, edit=lambda raw: pod_cluster(raw, opts))
    out: Path = params["output"]
    _write(out, render(cfg, doc, opts, rehearse=params["rehearse"]))
    _write(_plan_path(out), json.dumps(doc, indent=2, sort_keys=True) + "\n")
    spec = cfg.cluster
    click.echo(f"wrote {out} ({spec.prefill} prefill + {spec.decode} decode pods, router) and {_plan_path(out)}; "
               f"apply with: kubectl apply -f {out}")
