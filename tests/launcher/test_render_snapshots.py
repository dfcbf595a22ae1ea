"""Golden `render slurm` / `render k8s` output: the sbatch script, the manifests and the cluster-plan.json
next to them are committed files, so any change to what a cluster runs shows up as a reviewed diff.

The manifests are also checked as `kubectl apply` (strict field validation) would check them, offline
(tests/cluster/k8s_schema.py: core schemas + the LWS v0.10.0 CRD), and the launcher's own small YAML
emitter is checked against PyYAML.

Regenerate after an intended change: V4FLASH_UPDATE_SNAPSHOTS=1 pytest tests/launcher -k render_snapshot
(then read the diff in `git diff tests/launcher/snapshots/render/`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from cluster.k8s_schema import load_yaml_docs, validate
from snapshot import check_snapshot
from v4flash_pd.cluster import read_plan
from v4flash_pd.config.load import load_config
from v4flash_pd.render_k8s import K8sOptions, manifests, render, to_yaml

SNAPSHOTS = Path(__file__).parent / "snapshots" / "render"
PYXIS_IMAGE = "docker://registry.local#v4flash-pd:0.1.0"
SIF = "/shared/v4flash-pd.sif"

# (case, render argv without -o, the rendered file's suffix)
CASES: list[tuple[str, list[str], str]] = [
    ("slurm-1p1d", ["slurm", "--boxes", "2", "--prefill", "1", "--decode", "1", "--container", "none"], "sbatch"),
    ("slurm-2p2d-pyxis", ["slurm", "--boxes", "2", "--prefill", "2", "--decode", "2", "--container", "pyxis",
                          "--image", PYXIS_IMAGE], "sbatch"),
    ("slurm-1p1d-apptainer", ["slurm", "--boxes", "2", "--prefill", "1", "--decode", "1", "--container", "apptainer",
                              "--image", SIF], "sbatch"),
    ("k8s-lws-1p1d", ["k8s", "--flavor", "lws", "--prefill", "1", "--decode", "1"], "yaml"),
    ("k8s-lws-2p1d-serving", ["k8s", "--flavor", "lws", "--prefill", "2", "--decode", "1",
                              "--namespace", "serving"], "yaml"),
    ("k8s-rbg-2p1d", ["k8s", "--flavor", "rbg", "--prefill", "2", "--decode", "1"], "yaml"),
]
IDS = [c[0] for c in CASES]
SLURM = [c for c in CASES if c[2] == "sbatch"]
K8S = [c for c in CASES if c[2] == "yaml"]
K8S_LWS = [c for c in K8S if "lws" in c[1]]
K8S_RBG = [c for c in K8S if "rbg" in c[1]]
KINDS = {
    "lws": [("v1", "ConfigMap"), ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
            ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"), ("apps/v1", "Deployment"), ("v1", "Service"),
            ("networking.k8s.io/v1", "NetworkPolicy")],
    "rbg": [("v1", "ConfigMap"), ("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"), ("v1", "Service"),
            ("networking.k8s.io/v1", "NetworkPolicy")],
}
Cli = Callable[..., subprocess.CompletedProcess]


def rendered(cli: Cli, tmp_path: Path, case: str, argv: list[str], suffix: str) -> tuple[Path, Path]:
    """Run `v4flash-pd render ARGV -o tmp/CASE.SUFFIX`; (the rendered file, its cluster-plan.json)."""
    out = tmp_path / case / f"{case}.{suffix}"
    res = cli("render", *argv, "-o", str(out))
    assert res.returncode == 0, f"render failed (rc {res.returncode}):\n{res.stderr}"
    assert res.stderr == "" and "Traceback" not in res.stderr
    return out, out.parent / "cluster-plan.json"


@pytest.mark.parametrize("case, argv, suffix", CASES, ids=IDS)
def test_render_matches_snapshot(case: str, argv: list[str], suffix: str, cli: Cli, tmp_path: Path) -> None:
    out, plan = rendered(cli, tmp_path, case, argv, suffix)
    check_snapshot(out.read_text(), SNAPSHOTS / f"{case}.{suffix}")
    check_snapshot(plan.read_text(), SNAPSHOTS / f"{case}.cluster-plan.json")


def test_every_render_case_has_snapshots_and_no_stale_ones() -> None:
    want = {f"{c}.{s}" for c, _, s in CASES} | {f"{c}.cluster-plan.json" for c, _, _ in CASES}
    assert {p.name for p in SNAPSHOTS.iterdir()} == want


# ------------------------------------------------------------------ Slurm


@pytest.mark.parametrize("case, argv, suffix", SLURM, ids=[c[0] for c in SLURM])
def test_sbatch_script_is_executable_bash(case: str, argv: list[str], suffix: str, cli: Cli, tmp_path: Path) -> None:
    out, _ = rendered(cli, tmp_path, case, argv, suffix)
    assert os.access(out, os.X_OK)
    res = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert (SNAPSHOTS / f"{case}.sbatch").read_text() == out.read_text()


def test_container_steps_run_the_launcher_in_the_image(cli: Cli, tmp_path: Path) -> None:
    pyxis, _ = rendered(cli, tmp_path, *SLURM[1])
    apptainer, _ = rendered(cli, tmp_path, *SLURM[2])
    assert f"--container-image='{PYXIS_IMAGE}'" in pyxis.read_text()  # `#` would start a comment unquoted
    assert "--container-mounts=/models/DeepSeek-V4-Flash:/models/DeepSeek-V4-Flash:ro," in pyxis.read_text()
    assert "apptainer exec --nv --bind /models/DeepSeek-V4-Flash:/models/DeepSeek-V4-Flash:ro," in apptainer.read_text()
    assert f" {SIF} v4flash-pd up " in apptainer.read_text()


# ------------------------------------------------------------------ Kubernetes


def k8s_options(argv: list[str]) -> K8sOptions:
    return K8sOptions(namespace=argv[argv.index("--namespace") + 1] if "--namespace" in argv else "",
                      flavor=argv[argv.index("--flavor") + 1])


@pytest.mark.parametrize("case, argv, suffix", K8S, ids=[c[0] for c in K8S])
def test_manifests_are_valid_kubernetes(case: str, argv: list[str], suffix: str, cli: Cli, tmp_path: Path) -> None:
    """Both the committed golden and what `render k8s` writes now (a golden regenerated from a broken renderer
    must not pass either)."""
    out, _ = rendered(cli, tmp_path, case, argv, suffix)
    for text in ((SNAPSHOTS / f"{case}.yaml").read_text(), out.read_text()):
        docs = load_yaml_docs(text)
        assert [(d["apiVersion"], d["kind"]) for d in docs] == KINDS[k8s_options(argv).flavor]
        assert validate(docs) == []
        namespace = k8s_options(argv).namespace
        assert all(d["metadata"].get("namespace", "") == namespace for d in docs)


def lws(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"].endswith(role))


def container(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    pod = spec["leaderWorkerTemplate"]["workerTemplate"] if doc["kind"] == "LeaderWorkerSet" else spec["template"]
    return pod["spec"]["containers"][0]


def rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


MUTATIONS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("lws-replicas-not-an-integer", lambda docs: lws(docs, "prefill")["spec"].update(replicas="one"), "replicas"),
    ("lws-readiness-probe-misspelt", lambda docs: rename(container(lws(docs, "decode")), "readinessProbe",
                                                         "readinesProbe"), "readinesProbe"),
    ("router-readiness-probe-misspelt", lambda docs: rename(container(docs[3]), "readinessProbe", "readinesProbe"),
     "readinesProbe"),
    ("deployment-replicas-not-an-integer", lambda docs: docs[3]["spec"].update(replicas="one"), "replicas"),
    ("lws-size-not-an-integer", lambda docs: lws(docs, "decode")["spec"]["leaderWorkerTemplate"].update(size="1"),
     "size"),
    ("configmap-data-not-a-string", lambda docs: docs[0]["data"].update({"cluster-plan.json": {"a": 1}}),
     "cluster-plan.json"),
]


def rbg_role(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return next(r for r in docs[1]["spec"]["roles"] if r["name"] == role)


def rbg_container(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return rbg_role(docs, role)["standalonePattern"]["template"]["spec"]["containers"][0]


RBG_MUTATIONS: list[tuple[str, Callable[[list[dict[str, Any]]], None], str]] = [
    ("rbg-replicas-not-an-integer", lambda docs: rbg_role(docs, "prefill").update(replicas="one"), "replicas"),
    ("rbg-readiness-probe-misspelt", lambda docs: rename(rbg_container(docs, "decode"), "readinessProbe",
                                                         "readinesProbe"), "readinesProbe"),
    ("rbg-router-dependencies-misspelt", lambda docs: rename(rbg_role(docs, "router"), "dependencies", "dependsOn"),
     "dependsOn"),
    ("rbg-dependencies-not-a-list", lambda docs: rbg_role(docs, "router").update(dependencies="prefill"),
     "dependencies"),
]


def test_rbg_workers_reach_each_other_by_the_rbg_pod_names() -> None:
    """RBG's headless Service per role is s-<rbg>-<role>; the index comes from role-instance-index."""
    plan = json.loads((SNAPSHOTS / "k8s-rbg-2p1d.cluster-plan.json").read_text())
    assert plan["config"]["cluster"]["hosts"] == ["v4flash-prefill-0.s-v4flash-prefill",
                                                  "v4flash-prefill-1.s-v4flash-prefill",
                                                  "v4flash-decode-0.s-v4flash-decode"]
    docs = load_yaml_docs((SNAPSHOTS / "k8s-rbg-2p1d.yaml").read_text())
    env = {e["name"]: e for e in rbg_container(docs, "prefill")["env"]}
    assert env["V4FLASH_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['rbg.workloads.x-k8s.io/role-instance-index']"
    assert rbg_role(docs, "router")["dependencies"] == ["prefill", "decode"]


BROKEN = [(c[0], *m) for c in K8S_LWS for m in MUTATIONS] + [(c[0], *m) for c in K8S_RBG for m in RBG_MUTATIONS]


@pytest.mark.parametrize("case, mutation, mutate, field", BROKEN, ids=[f"{b[0]}-{b[1]}" for b in BROKEN])
def test_a_broken_copy_of_the_manifests_is_invalid(case: str, mutation: str,
                                                    mutate: Callable[[list[dict[str, Any]]], None], field: str) -> None:
    """The validation can fail: each mutation of a golden manifest alone makes it invalid, naming the field."""
    docs = load_yaml_docs((SNAPSHOTS / f"{case}.yaml").read_text())
    broken = copy.deepcopy(docs)
    mutate(broken)
    errors = validate(broken)
    assert errors, f"{mutation} passed validation"
    assert any(field in e for e in errors), errors


@pytest.mark.parametrize("case, argv, suffix", K8S, ids=[c[0] for c in K8S])
def test_the_cluster_plan_file_rebuilds_the_manifests(case: str, argv: list[str], suffix: str, cli: Cli,
                                                      tmp_path: Path) -> None:
    """The written cluster-plan.json is what the ConfigMap carries, and it alone determines the manifests."""
    out, plan_path = rendered(cli, tmp_path, case, argv, suffix)
    text = out.read_text()
    docs = load_yaml_docs(text)
    assert docs[0]["data"]["cluster-plan.json"] == plan_path.read_text()  # byte for byte, multi-line JSON included
    plan_doc = json.loads(plan_path.read_text())
    cfg = load_config(env={}, base=read_plan(plan_path))
    opts = k8s_options(argv)
    built = manifests(cfg, plan_doc, opts)
    assert built == docs
    assert render(cfg, plan_doc, opts) == text


@pytest.mark.parametrize("case, argv, suffix", K8S, ids=[c[0] for c in K8S])
def test_the_yaml_emitter_round_trips_the_manifests(case: str, argv: list[str], suffix: str, tmp_path: Path) -> None:
    plan_path = SNAPSHOTS / f"{case}.cluster-plan.json"
    cfg = load_config(env={}, base=read_plan(plan_path))
    docs = manifests(cfg, json.loads(plan_path.read_text()), k8s_options(argv))
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs
    assert list(yaml.safe_load_all(to_yaml(docs, header="a header\nof two lines"))) == docs


TRICKY: list[Any] = [
    "yes", "No", "on", "OFF", "true", "null", "~", "y", "1", "0.5", "1e3", "0x1F", "-1", "", " ", "a b", "a: b",
    "a #b", "#c", "- x", "-", "[x]", "{x}", "'q'", '"q"', "$(V4FLASH_INDEX)", "metadata.labels['x/y']", "*a", "&a",
    "!t", "%p", "@x", "`x`", "a,b", "é", "tab\tin", "back\\slash", "http://x:1/y", "/p/a:b", "v4flash-pd:latest",
    "{\n  \"a\": 1\n}\n", "two\nlines\n", "x:", "line\n", "yes\n", "a\nb", "a\nb\n\n", "  x\ny\n", "a\r\nb\n",
    0, 1, -3, 2.5, True, False, None, {}, [], [[]], [{}], [[1, 2], ["a"]],
    {"k": {"n": [1, {"m": ["x", {}]}]}}, [{"a": 1, "b": [{"c": "d"}]}],
]


@pytest.mark.parametrize("value", TRICKY, ids=[repr(v)[:30] for v in TRICKY])
def test_the_yaml_emitter_round_trips_scalars_and_nesting(value: Any) -> None:
    docs = [{"value": value, "list": [value], "nested": {"key": value}}]
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs


@pytest.mark.parametrize("key, flavor", [("router.api_key_env=ROUTER_KEY", "lws"),
                                         ("router.api_key_file=/etc/v4flash-key/router.key", "rbg")])
def test_the_router_key_comes_from_a_secret_never_from_the_manifest(key: str, flavor: str, cli: Cli,
                                                                     tmp_path: Path) -> None:
    out, _ = rendered(cli, tmp_path, f"auth-{flavor}", ["k8s", "--flavor", flavor, "--set", key], "yaml")
    docs = load_yaml_docs(out.read_text())
    assert validate(docs) == []
    if flavor == "lws":
        router = docs[3]["spec"]["template"]["spec"]
    else:
        router = next(r for r in docs[1]["spec"]["roles"] if r["name"] == "router")["standalonePattern"]["template"]["spec"]
    c = router["containers"][0]
    if key.startswith("router.api_key_env"):
        env = {e["name"]: e for e in c["env"]}
        assert env["ROUTER_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "v4flash-router-key", "key": "api-key"}}
    else:
        assert {"name": "router-key", "mountPath": "/etc/v4flash-key/router.key", "subPath": "api-key",
                "readOnly": True} in c["volumeMounts"]
        vol = next(v for v in router["volumes"] if v["name"] == "router-key")
        assert vol["secret"]["secretName"] == "v4flash-router-key"
    assert "kubectl create secret generic v4flash-router-key --from-file=api-key=" in out.read_text()
    assert not any("--api-key" in a for a in c["args"])
    # the workers take the same key (the router passes it on): the same Secret, the same way
    if flavor == "lws":
        workers = [d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"] for d in docs[1:3]]
    else:
        workers = [r["standalonePattern"]["template"]["spec"] for r in docs[1]["spec"]["roles"] if r["name"] != "router"]
    assert len(workers) == 2
    for w in workers:
        wc = w["containers"][0]
        if key.startswith("router.api_key_env"):
            assert {e["name"]: e for e in wc["env"]}["ROUTER_KEY"]["valueFrom"]["secretKeyRef"]["name"] == \
                "v4flash-router-key"
        else:
            assert any(m["name"] == "router-key" and m["mountPath"] == "/etc/v4flash-key/router.key"
                       for m in wc["volumeMounts"])
            assert any(v["name"] == "router-key" for v in w["volumes"])


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics for matchLabels and In-expressions (all the renderer uses)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> pod template, for either flavor."""
    out: dict[str, dict[str, Any]] = {}
    for d in docs:
        if d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        elif d["kind"] == "Deployment":
            t = d["spec"]["template"]
        elif d["kind"] == "RoleBasedGroup":
            for r in d["spec"]["roles"]:
                out[r["name"]] = r["standalonePattern"]["template"]
            continue
        else:
            continue
        out[t["metadata"]["labels"]["app.kubernetes.io/component"]] = t
    return out


@pytest.mark.parametrize("flavor", ["lws", "rbg"])
def test_only_the_router_and_peer_workers_reach_worker_pods(flavor: str, cli: Cli, tmp_path: Path) -> None:
    """Issue 23, security: workers, bootstrap and KV transfer listen on every pod address without
    authentication; the NetworkPolicy selects exactly the worker pods and admits only the router (on
    the workers' named http port) and the peer workers (any port: UCX/ZMQ pick theirs at run time)."""
    out, _ = rendered(cli, tmp_path, f"np-{flavor}", ["k8s", "--flavor", flavor, "--prefill", "2", "--decode", "1"],
                      "yaml")
    docs = load_yaml_docs(out.read_text())
    assert validate(docs) == []
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pods(docs)
    labels = {c: t["metadata"]["labels"] for c, t in pods.items()}
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert {c for c in labels if _matches(spec["podSelector"], labels[c])} == {"prefill", "decode"}
    by_router, by_peers = spec["ingress"]
    assert [c for c in labels if _matches(by_router["from"][0]["podSelector"], labels[c])] == ["router"]
    assert by_router["ports"] == [{"port": "http"}]
    for c in ("prefill", "decode"):  # the named port exists on every worker container
        assert any(p["name"] == "http" for p in pods[c]["spec"]["containers"][0]["ports"])
    assert {c for c in labels if _matches(by_peers["from"][0]["podSelector"], labels[c])} == {"prefill", "decode"}
    assert "ports" not in by_peers


def test_the_k8s_header_says_what_an_operator_must_know(cli: Cli, tmp_path: Path) -> None:
    """Issue 23, newcomer friction: weights on every node, emptyDir caches, an unauthenticated router."""
    out, _ = rendered(cli, tmp_path, "hdr", ["k8s", "--model-host-path", "/data/DeepSeek-V4-Flash"], "yaml")
    header = "".join(line[2:] + " " for line in out.read_text().splitlines() if line.startswith("# "))
    assert "'/data/DeepSeek-V4-Flash', so they must be on EVERY GPU node" in header, header
    assert "emptyDir" in header and "lost when a pod restarts" in header and "tens of minutes" in header
    assert "The router is UNAUTHENTICATED" in header
    assert "NetworkPolicy" in header
    keyed, _ = rendered(cli, tmp_path, "hdr-key", ["k8s", "--set", "router.api_key_env=ROUTER_KEY"], "yaml")
    text = keyed.read_text()
    assert "UNAUTHENTICATED" not in text and "kubectl create secret generic v4flash-router-key" in text


@pytest.mark.parametrize("argv", [["k8s", "--flavor", "lws", "--prefill", "1", "--decode", "1"],
                                  ["slurm", "--boxes", "2", "--prefill", "1", "--decode", "1"]], ids=["k8s", "slurm"])
def test_a_rehearsed_render_keeps_the_routers_address(argv: list[str], cli: Cli, tmp_path: Path) -> None:
    """A one-box rehearsal listens on 127.0.0.1; a rendered cluster must not: the router pod's Service (or
    the other Slurm nodes) reach it from outside. `render k8s --rehearse` once carried router.host =
    127.0.0.1 (the loopback layer applied before the pods became the boxes)."""
    _, plan = rendered(cli, tmp_path, "reh", [*argv, "--rehearse"], "out")
    config = json.loads(plan.read_text())["config"]
    assert config["router"]["host"] == "0.0.0.0", config["router"]
    assert "rehearsal:loopback" not in json.dumps(config)
