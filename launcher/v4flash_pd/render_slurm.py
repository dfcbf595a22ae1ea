"""A cluster plan as a plain bash sbatch script: Slurm places the boxes, our `up` runs inside each.

The script assembles only `v4flash-pd up --box K` / `--role router` lines; every SGLang and router
command line is still built by `build_plan`, on the box, from the cluster plan the script carries
in V4FLASH_CLUSTER_PLAN_JSON (so nodes need no shared file system, only Slurm and the image).
Fail fast: the first step to end stops the others with `scancel --signal=TERM` (TERM reaches our
`up`, which stops its processes cleanly; killing an `srun` client instead SIGKILLs its tasks).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from v4flash_pd import __version__
from v4flash_pd.config.types import ClusterSpec, Config
from v4flash_pd.errors import UserError
from v4flash_pd.safety import check_sbatch, check_values

CONTAINERS = ("none", "pyxis", "apptainer")
# Inside the image: where run dirs and compile caches go (the Dockerfile's volumes).
IMAGE_RUNS = "/var/lib/v4flash/runs"
IMAGE_CACHE = "/var/cache/v4flash"


@dataclass(frozen=True)
class SlurmOptions:
    container: str = "none"
    image: str = ""
    rehearse: bool = False
    job_name: str = "v4flash-pd"
    partition: str = ""
    time_limit: str = ""
    account: str = ""


def check_options(opts: SlurmOptions) -> None:
    if opts.container not in CONTAINERS:
        raise UserError(f"--container {opts.container!r} is not supported", f"use one of: {', '.join(CONTAINERS)}")
    if opts.container != "none" and not opts.image:
        example = "docker://registry.local#v4flash-pd:0.1.0 or /shared/v4flash-pd.sqsh" \
            if opts.container == "pyxis" else "/shared/v4flash-pd.sif"
        raise UserError(f"--container {opts.container} needs the image the nodes run",
                        f"pass --image (e.g. {example}); the README's cluster section shows how to make it from an "
                        "air-gap bundle")
    check_values([("--image", opts.image)])  # shown in a header comment and passed to srun/apptainer
    for name, value in (("--job-name", opts.job_name), ("--partition", opts.partition), ("--time", opts.time_limit),
                        ("--account", opts.account)):
        check_sbatch(name, value)  # written unquoted after `#SBATCH`, which sbatch scans itself


def check_model_path(opts: SlurmOptions, model: str) -> None:
    """The model dir becomes a bind-mount spec (`SRC:DST:ro`, comma-separated) in the script: only a
    plain absolute path survives both the mount syntax and the shell unquoted and unchanged."""
    if opts.container == "none" or opts.rehearse:
        return
    if not re.fullmatch(r"/[A-Za-z0-9._/+@=-]*", model):
        raise UserError(f"model.path {model!r} cannot be bind-mounted by {opts.container}: it needs a plain absolute "
                        "path (no spaces, commas, colons or shell characters)",
                        "move or symlink the model dir to such a path on every node (e.g. /models/DeepSeek-V4-Flash) "
                        "and pass --model PATH")


def _launcher(opts: SlurmOptions, model: str) -> str:
    """How a step runs `v4flash-pd` on its node: bare, under pyxis, or under apptainer."""
    if opts.container == "none":
        return "v4flash-pd"
    mounts = [f"{model}:{model}:ro"] if model and not opts.rehearse else []
    mounts += ['"$RUNS:$RUNS"', '"$CACHE:' + IMAGE_CACHE + '"']
    if opts.container == "pyxis":
        # enroot runs no entrypoint: call the launcher itself; the job's env (the plan, the hosts) passes through
        return (f"--container-image={shlex.quote(opts.image)} --container-writable --no-container-mount-home "
                f"--container-mounts={','.join(mounts)} v4flash-pd")
    return f"apptainer exec --nv --bind {','.join(mounts)} {shlex.quote(opts.image)} v4flash-pd"


def sbatch_script(cfg: Config, plan_doc: dict[str, Any], opts: SlurmOptions) -> str:
    """Pure: the same cluster plan and options give the same script (golden-tested).

    The script, top to bottom: the #SBATCH header, the preamble (the plan, the nodes Slurm gave, how
    boxes reach each other, run dirs), the `step`/`stop_steps` helpers, one `up` step per box plus the
    router's, and the wait that stops every step when one ends.
    """
    spec = cfg.cluster
    assert spec is not None and cfg.router is not None
    check_options(opts)
    check_model_path(opts, cfg.model_path)
    gpus = sum(len(g) for g in spec.slot_gpus)
    plan_text = json.dumps(plan_doc, sort_keys=True, separators=(",", ":"))
    return "\n".join([*_header(spec, opts, gpus), _preamble(spec, plan_text) + _step_helpers(opts, cfg.model_path),
                      *_steps(spec, gpus), _WAIT])


def _header(spec: ClusterSpec, opts: SlurmOptions, gpus: int) -> list[str]:
    """The comment lines and #SBATCH directives."""
    header = [
        "#!/bin/bash",
        f"# Rendered by v4flash-pd {__version__} (`v4flash-pd render slurm`): {spec.boxes} box(es) x "
        f"{len(spec.slot_gpus)} NUMA slots, {spec.prefill} prefill + {spec.decode} decode TP workers, the router on "
        "the first node.",
        "# Submit: sbatch THIS_FILE.  Clean stop: scancel --signal=TERM <jobid> (the job ends COMPLETED).",
        f"# Container: {opts.container}{' (' + shlex.quote(opts.image) + ')' if opts.image else ''}"
        f"{'; REHEARSAL (stand-in engines)' if opts.rehearse else ''}.",
        f"#SBATCH --job-name={opts.job_name}",
        f"#SBATCH --nodes={spec.boxes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --gres=gpu:{gpus}",
        f"#SBATCH --output={opts.job_name}-%j.out",
    ]
    if opts.partition:
        header.append(f"#SBATCH --partition={opts.partition}")
    if opts.time_limit:
        header.append(f"#SBATCH --time={opts.time_limit}")
    if opts.account:
        header.append(f"#SBATCH --account={opts.account}")
    return header


def _preamble(spec: ClusterSpec, plan_text: str) -> str:
    """Export the plan, check the job's nodes against it, find how boxes reach each other, make run dirs."""
    return f'''
set -uo pipefail

# The cluster plan (also written as cluster-plan.json next to this script). Every step rebuilds its
# box's plan from it with the same code path as a one-box `v4flash-pd up`.
export V4FLASH_CLUSTER_PLAN_JSON={shlex.quote(plan_text)}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#NODES[@]}}" -ne {spec.boxes} ]; then
  echo "error: the plan has {spec.boxes} box(es) but the job got ${{#NODES[@]}} node(s): ${{NODES[*]}}" >&2
  echo "fix: submit it as rendered (#SBATCH --nodes={spec.boxes}), or render again with --boxes ${{#NODES[@]}}" >&2
  exit 2
fi
# How boxes reach each other: each node's NodeAddr (its name when none is set). Preset
# V4FLASH_CLUSTER_HOSTS (comma-separated, node order) to use another network, e.g. the fast one.
if [ -z "${{V4FLASH_CLUSTER_HOSTS:-}}" ]; then
  hosts=()
  for n in "${{NODES[@]}}"; do
    addr=$(scontrol show node "$n" -o | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
    hosts+=("${{addr:-$n}}")
  done
  V4FLASH_CLUSTER_HOSTS=$(IFS=,; echo "${{hosts[*]}}")
fi
export V4FLASH_CLUSTER_HOSTS
RUNS=${{V4FLASH_RUNS_ROOT:-$PWD/v4flash-runs}}/$SLURM_JOB_ID
CACHE=${{V4FLASH_CACHE_DIR:-$PWD/v4flash-cache}}
mkdir -p "$RUNS" "$CACHE"
echo "v4flash-pd: job $SLURM_JOB_ID on ${{NODES[*]}} (hosts $V4FLASH_CLUSTER_HOSTS); run dirs under $RUNS"

'''


def _step_helpers(opts: SlurmOptions, model: str) -> str:
    """`step` (one `up` on one node, in the background) and `stop_steps` (TERM to every step's task)."""
    rehearse = " --rehearse" if opts.rehearse else ""
    run = _launcher(opts, model)
    step_opts = "--overlap --nodes=1 --ntasks=1 --cpu-bind=none"
    return f'''pids=()
step() {{  # step NODE NAME GRES UP_ARGS...: one `v4flash-pd up` on one node, in the background
  local node=$1 name=$2 gres=$3
  shift 3
  srun {step_opts} --nodelist="$node" --job-name="$name" --gres="$gres" \\
    {run} up --run-dir "$RUNS/$name"{rehearse} "$@" &
  pids+=($!)
}}

stopping=0
stop_steps() {{  # TERM to every step's task (our `up`), never SIGKILL through the srun clients
  [ "$stopping" = 1 ] && return
  stopping=1
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
}}
trap 'echo "v4flash-pd: stop requested, stopping every step" >&2; stop_steps' TERM INT
'''


def _steps(spec: ClusterSpec, gpus: int) -> list[str]:
    """One `up --box K` step per box, then the router's on the first node."""
    steps = [f'step "${{NODES[{k}]}}" box{k} gpu:{gpus} --box {k}' for k in range(spec.boxes)]
    steps.append('step "${NODES[0]}" router none --role router')
    return steps


# Wait for the first step to end, then stop the others and collect every exit status.
_WAIT = '''
rc=0
wait -n || rc=$?
if [ "$stopping" = 1 ]; then
  :
elif [ "$rc" -eq 0 ]; then
  echo "v4flash-pd: a step stopped cleanly; stopping the others" >&2
else
  echo "v4flash-pd: a step ended (exit $rc); stopping the others (fail fast)" >&2
fi
stop_steps
for pid in "${pids[@]}"; do
  wait "$pid" || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
done
echo "v4flash-pd: every step stopped (exit $rc)"
exit "$rc"
'''
