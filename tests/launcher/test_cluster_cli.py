"""Cluster plans through the real CLI: every wrong use of `up/doctor --cluster-plan --box --role --index`
and of `render slurm|k8s` is one `error:` + `fix:` paragraph, exit 2, no traceback, and nothing is
started or written; the happy paths write what they say they write.

(`up --cluster-plan F --box K` actually starting a box is an end-to-end test elsewhere.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import fakebox
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
T8 = str(FIXTURES / "topology-8gpu-2node.json")
PARAGRAPH = re.compile(r"\Aerror: [^\n]+\n  fix: [^\n]+\n\Z")
CLUSTER_TOML = "[cluster]\nboxes = 2\nprefill = 1\ndecode = 1\n"

Cli = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cluster-plan.json of a 1P1D, 2-box cluster, as `render slurm` writes it (read-only for the tests)."""
    out = tmp_path_factory.mktemp("rendered") / "job.sbatch"
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", "render", "slurm", "--boxes", "2", "--prefill", "1",
                          "--decode", "1", "-o", str(out)], capture_output=True, text=True, env=fakebox.clean_env(),
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return out.parent / "cluster-plan.json"


def write(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def up(plan: str, *args: str) -> list[str]:
    return ["up", "--cluster-plan", plan, "--rehearse", "--run-dir", "RUN", *args]


# (id, argv (PLAN = the rendered plan file, RUN = a run dir, OUT = a render output), extra env, words)
CASES: list[tuple[str, Callable[[Path], list[str]], dict[str, str], list[str]]] = [
    ("up-cluster-plan-without-box", lambda t: up("PLAN"), {},
     ["cluster plan of 2 boxes", "one part of it at a time"]),
    ("up-cluster-config-without-box", lambda t: ["up", "--rehearse", "--run-dir", "RUN", "--config",
                                                 write(t, "c.toml", CLUSTER_TOML)], {},
     ["cluster plan of 2 boxes", "--box K"]),
    ("up-box-out-of-range", lambda t: up("PLAN", "--box", "5"), {},
     ["--box 5 is not a box of this 2-box cluster plan", "--box 0..1"]),
    ("up-negative-box", lambda t: up("PLAN", "--box", "-1"), {}, ["--box -1 is not a box"]),
    ("up-router-without-hosts", lambda t: up("PLAN", "--role", "router"), {},
     ["names no host for prefill-0, decode-0", "--hosts node1,node2"]),
    ("up-router-with-too-few-hosts", lambda t: up("PLAN", "--role", "router", "--hosts", "node-a"), {},
     ["cluster.hosts names 1 host(s) for 2 box(es)"]),
    ("up-box-and-role", lambda t: up("PLAN", "--box", "0", "--role", "router"), {},
     ["exactly one of --box K or --role ROLE"]),
    ("up-index-with-box", lambda t: up("PLAN", "--box", "0", "--index", "0"), {},
     ["--index picks a prefill or decode worker", "--role prefill"]),
    ("up-index-with-router", lambda t: up("PLAN", "--role", "router", "--hosts", "a,b", "--index", "0"), {},
     ["--index picks a prefill or decode worker"]),
    ("up-index-out-of-range", lambda t: up("PLAN", "--role", "decode", "--index", "1"), {},
     ["--role decode needs --index 0..0", "got 1"]),
    ("up-role-without-index", lambda t: up("PLAN", "--role", "prefill"), {}, ["--role prefill needs --index"]),
    ("up-missing-plan", lambda t: up(str(t / "missing.json"), "--box", "0"), {},
     ["cluster plan", "missing.json does not exist", "render"]),
    ("up-plan-not-json", lambda t: up(write(t, "p.json", "#!/bin/bash\n"), "--box", "0"), {},
     ["p.json is not valid JSON", "render it again"]),
    ("up-plan-other-format", lambda t: up(write(t, "p.json", json.dumps({"format": "v4flash-pd/plan/1"})), "--box", "0"),
     {}, ["is not a v4flash-pd cluster plan", "'v4flash-pd/plan/1'"]),
    ("up-plan-and-config", lambda t: up("PLAN", "--box", "0", "--config", write(t, "c.toml", "")), {},
     ["--cluster-plan already holds the whole config", "drop --config"]),
    ("up-plan-and-profile", lambda t: up("PLAN", "--box", "0", "--profile", "rtx6000-8x-pd"), {},
     ["--cluster-plan already holds the whole config"]),
    ("up-plan-env-not-json", lambda t: ["up", "--box", "0", "--rehearse", "--run-dir", "RUN"],
     {"V4FLASH_CLUSTER_PLAN_JSON": "{truncated"}, ["V4FLASH_CLUSTER_PLAN_JSON is not valid JSON"]),
    ("up-box-without-cluster", lambda t: ["up", "--box", "0", "--rehearse", "--run-dir", "RUN"], {},
     ["no cluster", "--cluster-plan FILE"]),
    ("doctor-cluster-plan-without-box", lambda t: ["doctor", "--cluster-plan", "PLAN", "--rehearse"], {},
     ["cluster plan of 2 boxes"]),
    ("doctor-box-out-of-range", lambda t: ["doctor", "--cluster-plan", "PLAN", "--box", "7", "--rehearse"], {},
     ["--box 7 is not a box of this 2-box cluster plan"]),
    ("doctor-box-and-role", lambda t: ["doctor", "--cluster-plan", "PLAN", "--box", "0", "--role", "router"], {},
     ["exactly one of --box K or --role ROLE"]),
    ("doctor-router-without-hosts", lambda t: ["doctor", "--cluster-plan", "PLAN", "--role", "router"], {},
     ["names no host for prefill-0, decode-0"]),
    ("doctor-missing-plan", lambda t: ["doctor", "--cluster-plan", str(t / "missing.json"), "--box", "0"], {},
     ["missing.json does not exist"]),
    ("doctor-plan-and-config", lambda t: ["doctor", "--cluster-plan", "PLAN", "--box", "0", "--config",
                                          write(t, "c.toml", "")], {}, ["--cluster-plan already holds"]),
    ("render-slurm-without-boxes", lambda t: ["render", "slurm", "-o", "OUT"], {},
     ["render slurm needs a cluster", "--boxes N"]),
    ("render-slurm-pyxis-without-image", lambda t: ["render", "slurm", "--boxes", "2", "--container", "pyxis", "-o", "OUT"],
     {}, ["--container pyxis needs the image", "--image"]),
    ("render-slurm-apptainer-without-image", lambda t: ["render", "slurm", "--boxes", "2", "--container", "apptainer",
                                                        "-o", "OUT"], {}, ["--container apptainer", ".sif"]),
    ("render-slurm-too-many-workers", lambda t: ["render", "slurm", "--boxes", "1", "--prefill", "2", "--decode", "1",
                                                 "-o", "OUT"], {}, ["= 3 slots", "hold 2", "--boxes 2"]),
    ("render-slurm-empty-box", lambda t: ["render", "slurm", "--boxes", "3", "--prefill", "1", "--decode", "1",
                                          "-o", "OUT"], {}, ["box(es) 2 of", "would run nothing", "--boxes 2"]),
    ("render-slurm-port-offset-collision", lambda t: ["render", "slurm", "--boxes", "2", "--prefill", "2", "--decode", "2",
                                                      "--port-offset", "1", "-o", "OUT"], {},
     ["port 30001 is used twice", "port_offset"]),
    ("render-slurm-router-on-a-worker-port", lambda t: ["render", "slurm", "--boxes", "2", "--set", "router.port=30000",
                                                        "-o", "OUT"], {}, ["port 30000 is used twice on box 0"]),
    ("render-slurm-bogus-network", lambda t: ["render", "slurm", "--boxes", "2", "--set", "cluster.network=bogus",
                                              "-o", "OUT"], {}, ["cluster.network = 'bogus'"]),
    ("render-slurm-aggregated", lambda t: ["render", "slurm", "--boxes", "2", "--profile", "rtx6000-tp4", "-o", "OUT"],
     {}, ["needs mode = \"pd\""]),
    ("render-slurm-two-prefill-entries", lambda t: ["render", "slurm", "--boxes", "2", "--prefill", "2", "--config",
                                                    write(t, "c.toml", "[[prefill]]\n[[prefill]]\ngpus = [4, 5, 6, 7]\n"
                                                          "tp = 4\nport = 30002\nnccl_port = 30012\n"
                                                          "bootstrap_port = 8999\n"), "-o", "OUT"], {},
     ["2 [[prefill]] workers", "template"]),
    ("render-slurm-hosts-count", lambda t: ["render", "slurm", "--boxes", "2", "--set", 'cluster.hosts=["a"]', "-o", "OUT"],
     {}, ["cluster.hosts names 1 host(s) for 2 box(es)"]),
    ("render-slurm-job-name-with-space", lambda t: ["render", "slurm", "--boxes", "2", "--job-name", "a b", "-o", "OUT"],
     {}, ["--job-name 'a b'"]),
    ("render-k8s-bad-name", lambda t: ["render", "k8s", "--name", "Bad_Name", "-o", "OUT"], {},
     ["--name 'Bad_Name' is not a DNS label", "lowercase"]),
    ("render-k8s-bad-namespace", lambda t: ["render", "k8s", "--namespace", "-serving", "-o", "OUT"], {},
     ["--namespace '-serving' is not a DNS label"]),
    ("render-k8s-port-offset", lambda t: ["render", "k8s", "--port-offset", "3", "-o", "OUT"], {},
     ["--port-offset is for logical Slurm nodes", "drop --port-offset"]),
    ("render-k8s-boxes", lambda t: ["render", "k8s", "--boxes", "2", "-o", "OUT"], {},
     ["--boxes has no meaning here", "drop --boxes"]),
    ("render-k8s-bad-flavor", lambda t: ["render", "k8s", "--flavor", "helm", "-o", "OUT"], {}, ["--flavor"]),
    ("render-k8s-cpu-not-whole", lambda t: ["render", "k8s", "--worker-cpu", "2.5", "-o", "OUT"], {},
     ["--worker-cpu '2.5' is not a whole number", "Guaranteed"]),
    ("render-k8s-memory-not-a-quantity", lambda t: ["render", "k8s", "--worker-memory", "lots", "-o", "OUT"], {},
     ["--worker-memory 'lots'", "256Gi"]),
    ("render-k8s-relative-model-host-path", lambda t: ["render", "k8s", "--model-host-path", "models/x", "-o", "OUT"],
     {}, ["not an absolute path"]),
    ("render-slurm-pyxis-model-path-with-space", lambda t: ["render", "slurm", "--boxes", "2", "--container", "pyxis",
                                                            "--image", "docker://r#i:1", "--model", "/models/Deep Seek",
                                                            "-o", "OUT"], {},
     ["cannot be bind-mounted by pyxis", "plain absolute"]),
    ("render-slurm-apptainer-model-path-with-subshell", lambda t: ["render", "slurm", "--boxes", "2", "--container",
                                                                   "apptainer", "--image", "/s/i.sif", "--model",
                                                                   "/models/$(id)", "-o", "OUT"], {},
     ["cannot be bind-mounted by apptainer"]),
    ("up-role-prefill-without-index", lambda t: ["up", "--cluster-plan", "PLAN", "--role", "prefill", "--rehearse"], {},
     ["--role prefill needs --index 0..0", "none was given"]),
    ("render-slurm-slot-smaller-than-tp", lambda t: ["render", "slurm", "--boxes", "2", "--set",
                                                     "cluster.slot_gpus=[[0,1],[2,3]]", "-o", "OUT"], {},
     ["cluster.slot_gpus[0] has 2 GPU(s)", "prefill.0.tp=N"]),
]


def materialize(argv: list[str], tmp: Path, plan: Path) -> list[str]:
    names = {"PLAN": str(plan), "RUN": str(tmp / "run"), "OUT": str(tmp / "out" / "rendered.file")}
    return [names.get(a, a) for a in argv]


@pytest.mark.parametrize("name, argv, env, words", CASES, ids=[c[0] for c in CASES])
def test_wrong_use_is_one_paragraph_and_starts_or_writes_nothing(name: str, argv: Callable[[Path], list[str]],
                                                                   env: dict[str, str], words: list[str], cli: Cli,
                                                                   plan_file: Path, tmp_path: Path) -> None:
    args = materialize(argv(tmp_path), tmp_path, plan_file)
    res = cli(*args, extra_env={"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), **env})
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    assert PARAGRAPH.match(res.stderr), f"not one error/fix paragraph:\n{res.stderr}"
    for w in words:
        assert w in res.stderr, (w, res.stderr)
    assert "READY" not in res.stdout
    # nothing started or written: no run dir, no render output, no cluster-plan.json next to it
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    assert not (tmp_path / "out").exists()


def test_render_slurm_writes_an_executable_script_and_the_plan(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "slurm" / "job.sbatch"
    res = cli("render", "slurm", "--boxes", "2", "--prefill", "2", "--decode", "2", "--partition", "gpu",
              "--time", "04:00:00", "-o", str(out))
    assert res.returncode == 0, res.stderr
    plan_path = out.parent / "cluster-plan.json"
    assert f"wrote {out}" in res.stdout and str(plan_path) in res.stdout and f"sbatch {out}" in res.stdout
    assert os.access(out, os.X_OK)
    syntax = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    text = out.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gres=gpu:8", "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00",
                 'step "${NODES[0]}" box0 gpu:8 --box 0', 'step "${NODES[1]}" box1 gpu:8 --box 1',
                 'step "${NODES[0]}" router none --role router'):
        assert line in text.splitlines(), line
    doc = json.loads(plan_path.read_text())
    assert doc["format"] == "v4flash-pd/cluster-plan/1" and doc["boxes"] == 2
    assert [(s["name"], s["box"]) for s in doc["slots"]] == [("prefill-0", 0), ("prefill-1", 1), ("decode-0", 0),
                                                              ("decode-1", 1)]
    # the copy the script carries to every node is the same plan
    carried = subprocess.run(["bash", "-c", 'eval "$(grep "^export V4FLASH_CLUSTER_PLAN_JSON=" "$1")"; '
                              'printf %s "$V4FLASH_CLUSTER_PLAN_JSON"', "_", str(out)],
                             capture_output=True, text=True, timeout=30)
    assert carried.returncode == 0 and json.loads(carried.stdout) == doc


def test_render_k8s_writes_manifests_and_the_plan(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "k8s" / "v4flash.yaml"
    res = cli("render", "k8s", "--prefill", "2", "--decode", "1", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert f"kubectl apply -f {out}" in res.stdout
    doc = json.loads((out.parent / "cluster-plan.json").read_text())
    # one pod per worker: as many "boxes" as workers, each one slot of 4 GPUs, named by its pod's DNS name
    assert doc["boxes"] == 3
    assert [(s["name"], s["box"], s["host"]) for s in doc["slots"]] == [
        ("prefill-0", 0, "v4flash-prefill-0.v4flash-prefill"), ("prefill-1", 1, "v4flash-prefill-1.v4flash-prefill"),
        ("decode-0", 2, "v4flash-decode-0.v4flash-decode")]
    assert "kind: LeaderWorkerSet" in out.read_text()


def doctor_checks(cli: Cli, *args: str) -> dict[str, str]:
    """`doctor --json ARGS` that ran its checks (0 ok, 3 warnings, 4 errors; 2 = bad options): {check: status}."""
    res = cli("doctor", "--json", *args, timeout=120)
    assert res.returncode in (0, 3, 4), (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    report = json.loads(res.stdout)
    assert report["exit_code"] == res.returncode
    return {c["name"]: c["status"] for c in report["checks"]}


@pytest.mark.parametrize("box", ["0", "1"])
def test_doctor_checks_one_box_of_a_cluster_plan(box: str, cli: Cli, plan_file: Path) -> None:
    """The box's own plan builds (both boxes use GPUs 0-3 and port 30000: no collision within a box)."""
    checks = doctor_checks(cli, "--cluster-plan", str(plan_file), "--box", box, "--rehearse")
    assert checks["plan"] in ("ok", "warn")
    assert "gpus" in checks and "model-dir" in checks


def test_doctor_checks_the_router_part_without_the_boxes_checks(cli: Cli, plan_file: Path) -> None:
    checks = doctor_checks(cli, "--cluster-plan", str(plan_file), "--role", "router", "--hosts", "node-a,node-b",
                           "--rehearse")
    assert checks["plan"] == "ok" and "ports" in checks
    assert not {"gpus", "model-dir", "numa-membind"} & set(checks)


def test_doctor_takes_the_cluster_options_from_the_environment(cli: Cli, plan_file: Path) -> None:
    """What the sbatch script exports (the plan's text, the hosts) plus V4FLASH_BOX is enough."""
    res = cli("doctor", "--rehearse", extra_env={"V4FLASH_CLUSTER_PLAN_JSON": plan_file.read_text(),
                                                 "V4FLASH_BOX": "1"}, timeout=120)
    assert res.returncode in (0, 3, 4), (res.returncode, res.stdout, res.stderr)
    assert res.stdout.startswith("doctor: profile rtx6000-8x-pd") and "Traceback" not in res.stderr


def test_plan_shows_a_cluster_part_by_part(cli: Cli, tmp_path: Path) -> None:
    """`plan` of a cluster starts nothing and shows each box's plan and the router's, as their `up` builds them."""
    res = cli("plan", "--topology", T8, "--json", "--config", write(tmp_path, "c.toml", CLUSTER_TOML),
              "--hosts", "node-a,node-b")
    assert res.returncode == 0, res.stderr
    view = json.loads(res.stdout)
    parts = view["parts"]
    assert list(parts) == ["box 0", "box 1", "router"]
    assert [[p["name"] for p in parts[k]["processes"]] for k in parts] == [["prefill-0"], ["decode-0"], ["router"]]
    router = parts["router"]["processes"][0]["argv"]
    assert router[router.index("--prefill") + 1:router.index("--prefill") + 3] == ["http://node-a:30000", "8998"]
    assert router[router.index("--decode") + 1] == "http://node-b:30000"
