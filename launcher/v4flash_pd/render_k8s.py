"""A cluster plan as Kubernetes manifests: one LeaderWorkerSet per role, the router as a Deployment.

Each pod is one TP worker (4 GPUs from the device plugin) running `v4flash-pd up --role R --index I`
from the cluster plan in a ConfigMap; `up` builds the SGLang command line with the one
`build_plan` and derives the NUMA node from the GPUs the pod was given (never fixed indices), so the
kubelet's Topology Manager decides the socket. The router pod waits for every worker's /health
before it starts the router (Kubernetes has no start order), and its readiness is the router's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from v4flash_pd import __version__
from v4flash_pd.config.types import ClusterSpec, Config
from v4flash_pd.errors import UserError
from v4flash_pd.profiles import OFFLINE_ENV
from v4flash_pd.safety import check_values

FLAVORS = ("lws", "rbg")
PLAN_DIR = "/etc/v4flash"
PLAN_FILE = f"{PLAN_DIR}/cluster-plan.json"
# The pod label that carries a worker's index within its role, per flavor.
INDEX_LABEL = {"lws": "leaderworkerset.sigs.k8s.io/group-index", "rbg": "rbg.workloads.x-k8s.io/role-instance-index"}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class K8sOptions:
    flavor: str = "lws"
    image: str = "v4flash-pd:latest"
    namespace: str = ""
    name: str = "v4flash"
    worker_cpu: str = "32"
    worker_memory: str = "256Gi"
    shm_size: str = "32Gi"
    model_host_path: str = ""  # "" = the model path on every node (hostPath, read-only)
    image_pull_policy: str = "IfNotPresent"  # air-gapped: the image is preloaded on the nodes


def check_options(opts: K8sOptions) -> None:
    check_values([("--image", opts.image), ("--model-host-path", opts.model_host_path)])
    if opts.flavor not in FLAVORS:
        raise UserError(f"--flavor {opts.flavor!r} is not rendered",
                        "use --flavor lws (LeaderWorkerSet) or --flavor rbg (RoleBasedGroup)")
    for what, value in (("--name", opts.name), ("--namespace", opts.namespace)):
        if value and (not _DNS_LABEL.match(value) or len(value) > 40):
            raise UserError(f"{what} {value!r} is not a DNS label Kubernetes accepts (here at most 40 characters)",
                            f"use lowercase letters, digits and '-', e.g. {what} v4flash")
    if not opts.image or any(c.isspace() for c in opts.image):
        raise UserError(f"--image {opts.image!r} is not an image reference",
                        "pass the image every node has, e.g. --image registry.local/v4flash-pd:0.1.0")
    if not re.fullmatch(r"[1-9][0-9]*", opts.worker_cpu):
        raise UserError(f"--worker-cpu {opts.worker_cpu!r} is not a whole number of CPUs",
                        "pass e.g. --worker-cpu 32: the CPU Manager pins only whole CPUs of Guaranteed pods")
    if not re.fullmatch(r"[1-9][0-9]*(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?", opts.worker_memory):
        raise UserError(f"--worker-memory {opts.worker_memory!r} is not a Kubernetes memory quantity",
                        "pass e.g. --worker-memory 256Gi")
    if opts.model_host_path and not opts.model_host_path.startswith("/"):
        raise UserError(f"--model-host-path {opts.model_host_path!r} is not an absolute path",
                        "pass the model dir as every node has it, e.g. --model-host-path /data/DeepSeek-V4-Flash")


def pod_layer(spec: ClusterSpec, tp: int, opts: K8sOptions) -> dict[str, Any]:
    """The pod layout as a config layer (dotted keys), from the checked [cluster] table and the prefill
    template's TP size: one slot per pod (`tp` GPUs, numbered from 0 inside it), its own network
    namespace (no port offset), listening on every pod address, hosts = the pods' DNS names (box i =
    prefill-i, box P+j = decode-j: the slot-major layout with one slot per box)."""
    p, d = spec.prefill, spec.decode
    return {"cluster.boxes": p + d, "cluster.slot_gpus": [list(range(tp))], "cluster.port_offset": 0,
            "cluster.bind_host": "0.0.0.0",
            "cluster.hosts": [pod_dns(opts, "prefill", i) for i in range(p)]
            + [pod_dns(opts, "decode", j) for j in range(d)],
            # each pod is its own network namespace: the router's metrics port must listen on the pod address
            # to be scraped (the containerPort "metrics"); the one-box default keeps it on 127.0.0.1
            "router.metrics_host": "0.0.0.0"}


def pod_dns(opts: K8sOptions, role: str, index: int) -> str:
    """A worker pod's stable DNS name (namespace-relative) from the flavor's headless Service:
    LeaderWorkerSet: <lws>-<group>.<lws>; RoleBasedGroup: <rbg>-<role>-<i>.s-<rbg>-<role>."""
    if opts.flavor == "rbg":
        return f"{opts.name}-{role}-{index}.s-{opts.name}-{role}"
    return f"{opts.name}-{role}-{index}.{opts.name}-{role}"


def _meta(name: str, opts: K8sOptions, component: str) -> dict[str, Any]:
    m: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "v4flash-pd",
                                                  "app.kubernetes.io/instance": opts.name,
                                                  "app.kubernetes.io/component": component}}
    if opts.namespace:
        m["namespace"] = opts.namespace
    return m


def _env(cfg: Config, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    offline = {**OFFLINE_ENV, **{k: v for k, v in cfg.env if k in OFFLINE_ENV}}
    return extra + [{"name": k, "value": v} for k, v in sorted(offline.items())]


def _probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _volumes(cfg: Config, opts: K8sOptions, with_model: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    vols: list[dict[str, Any]] = [
        {"name": "cluster-plan", "configMap": {"name": f"{opts.name}-cluster-plan"}},
        {"name": "runs", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "cluster-plan", "mountPath": PLAN_DIR, "readOnly": True},
        {"name": "runs", "mountPath": "/var/lib/v4flash/runs"},
        {"name": "cache", "mountPath": "/var/cache/v4flash"},
    ]
    if with_model:
        vols += [{"name": "model", "hostPath": {"path": opts.model_host_path or cfg.model_path, "type": "Directory"}},
                 {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}]
        mounts += [{"name": "model", "mountPath": cfg.model_path, "readOnly": True},
                   {"name": "dshm", "mountPath": "/dev/shm"}]
    return vols, mounts


def _worker_pod(cfg: Config, role: str, opts: K8sOptions, rehearse: bool) -> dict[str, Any]:
    """The pod template of one TP worker of `role` (the same for every flavor but the index label)."""
    w = cfg.role(role)[0]
    ports = [{"name": "http", "containerPort": w.port}, {"name": "nccl", "containerPort": w.nccl_port}]
    if w.bootstrap_port is not None:
        ports.append({"name": "bootstrap", "containerPort": w.bootstrap_port})
    vols, mounts = _volumes(cfg, opts, with_model=not rehearse)
    key_env, key_vols, key_mounts = _router_key(cfg, opts)  # workers take the router's key as their own
    vols += key_vols
    mounts += key_mounts
    gpus = str(len(w.gpus))
    resources = {"cpu": opts.worker_cpu, "memory": opts.worker_memory, "nvidia.com/gpu": gpus}
    args = ["up", "--cluster-plan", PLAN_FILE, "--role", role, "--index", "$(V4FLASH_INDEX)"] + \
        (["--rehearse"] if rehearse else [])
    container = {
        "name": role,
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "args": args,
        "env": _env(cfg, [{"name": "V4FLASH_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{INDEX_LABEL[opts.flavor]}']"}}}] + key_env),
        "ports": ports,
        # Guaranteed QoS (requests = limits, whole CPUs): the CPU and Memory Managers only pin those
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        # numactl --membind needs it (else `up` falls back to --preferred and says so)
        "securityContext": {"capabilities": {"add": ["SYS_NICE"]}},
        "startupProbe": _probe("/health", "http", 10, max(6, int(cfg.ready_timeout // 10))),
        "readinessProbe": _probe("/health", "http", 10, 3),
        "volumeMounts": mounts,
    }
    return {"metadata": {"labels": _labels(opts, role)},
            "spec": {"containers": [container], "volumes": vols,
                     "terminationGracePeriodSeconds": int(cfg.grace_period) + 30}}


def _labels(opts: K8sOptions, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "v4flash-pd", "app.kubernetes.io/instance": opts.name,
            "app.kubernetes.io/component": component}


def _worker_lws(cfg: Config, role: str, opts: K8sOptions, rehearse: bool) -> dict[str, Any]:
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": _meta(f"{opts.name}-{role}", opts, role),
        "spec": {
            "replicas": len(cfg.role(role)),
            "startupPolicy": "LeaderCreated",
            # size 1: a TP worker never spans pods (or boxes)
            "leaderWorkerTemplate": {"size": 1, "restartPolicy": "RecreateGroupOnPodRestart",
                                     "workerTemplate": _worker_pod(cfg, role, opts, rehearse)},
        },
    }


def router_secret(opts: K8sOptions) -> str:
    """The Secret (key `api-key`) the operator creates when the plan asks for router authentication."""
    return f"{opts.name}-router-key"


def _router_key(cfg: Config, opts: K8sOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, volumes, mounts) that hand the router (and the workers, which take the same key) the API
    key from a Secret, where the plan reads it (router.api_key_env or router.api_key_file): never in
    the manifest, never in argv."""
    r = cfg.router
    assert r is not None
    ref = {"name": router_secret(opts), "key": "api-key"}
    if r.api_key_file and not r.api_key_file.startswith("/"):
        raise UserError(f"router.api_key_file = {r.api_key_file!r} is a relative path; in Kubernetes the key is a Secret "
                        "mounted at that path, and a volume's mountPath must be absolute",
                        "use an absolute path inside the pod, e.g. --set router.api_key_file=/etc/v4flash-key/api-key, "
                        "or router.api_key_env")
    if r.api_key_env:
        return [{"name": r.api_key_env, "valueFrom": {"secretKeyRef": ref}}], [], []
    if r.api_key_file:
        vol = {"name": "router-key", "secret": {"secretName": ref["name"], "defaultMode": 0o400,
                                                "items": [{"key": "api-key", "path": "api-key"}]}}
        return [], [vol], [{"name": "router-key", "mountPath": r.api_key_file, "subPath": "api-key", "readOnly": True}]
    return [], [], []


def _router_pod(cfg: Config, opts: K8sOptions, rehearse: bool) -> dict[str, Any]:
    r = cfg.router
    assert r is not None
    vols, mounts = _volumes(cfg, opts, with_model=False)
    key_env, key_vols, key_mounts = _router_key(cfg, opts)
    vols += key_vols
    mounts += key_mounts
    container = {
        "name": "router",
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "args": ["up", "--cluster-plan", PLAN_FILE, "--role", "router"] + (["--rehearse"] if rehearse else []),
        "env": _env(cfg, key_env),
        "ports": [{"name": "http", "containerPort": r.port}, {"name": "metrics", "containerPort": r.metrics_port}],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}},
        # the router starts only once every worker is healthy (up to ready_timeout), then gates itself
        "startupProbe": _probe("/readiness", "http", 10, max(6, int(cfg.ready_timeout // 10) + 6)),
        "readinessProbe": _probe("/readiness", "http", 10, 3),
        "volumeMounts": mounts,
    }
    return {"metadata": {"labels": _labels(opts, "router")},
            "spec": {"containers": [container], "volumes": vols,
                     "terminationGracePeriodSeconds": int(cfg.grace_period) + 30}}


def _router_service(cfg: Config, opts: K8sOptions) -> dict[str, Any]:
    r = cfg.router
    assert r is not None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(f"{opts.name}-router", opts, "router"),
        "spec": {"selector": _labels(opts, "router"), "ports": [{"name": "http", "port": r.port, "targetPort": "http"}]},
    }


def _router_deployment(cfg: Config, opts: K8sOptions, rehearse: bool) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(f"{opts.name}-router", opts, "router"),
        "spec": {"replicas": 1, "selector": {"matchLabels": _labels(opts, "router")},
                 "template": _router_pod(cfg, opts, rehearse)},
    }


def _rbg(cfg: Config, opts: K8sOptions, rehearse: bool) -> dict[str, Any]:
    """One RoleBasedGroup: prefill and decode roles (one pod per TP worker), the router role after
    both are ready (RBG's dependencies; the router's own gate waits for /health as well)."""
    roles: list[dict[str, Any]] = [
        {"name": role, "replicas": len(cfg.role(role)),
         "standalonePattern": {"template": _worker_pod(cfg, role, opts, rehearse)}}
        for role in ("prefill", "decode")
    ]
    roles.append({"name": "router", "replicas": 1, "dependencies": ["prefill", "decode"],
                  "standalonePattern": {"template": _router_pod(cfg, opts, rehearse)}})
    return {"apiVersion": "workloads.x-k8s.io/v1alpha2", "kind": "RoleBasedGroup",
            "metadata": _meta(opts.name, opts, "group"), "spec": {"roles": roles}}


WORKER_ROLES = ("prefill", "decode")


def _network_policy(opts: K8sOptions) -> dict[str, Any]:
    """Worker pods accept the router (their HTTP port) and each other (bootstrap, NIXL/UCX and SGLang's
    ZMQ side channel, on ports picked at run time: every port), nothing else. SGLang's bootstrap
    server, NCCL and the KV transfer have no authentication of their own; the kubelet's probes come
    from the node, which a NetworkPolicy never blocks."""
    instance = {"key": "app.kubernetes.io/instance", "operator": "In", "values": [opts.name]}
    workers = {"matchExpressions": [instance, {"key": "app.kubernetes.io/component", "operator": "In",
                                               "values": list(WORKER_ROLES)}]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(f"{opts.name}-workers", opts, "network-policy"),
        "spec": {
            "podSelector": workers,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": _labels(opts, "router")}}], "ports": [{"port": "http"}]},
                {"from": [{"podSelector": workers}]},
            ],
        },
    }


def manifests(cfg: Config, plan_doc: dict[str, Any], opts: K8sOptions, rehearse: bool = False) -> list[dict[str, Any]]:
    """Pure: ConfigMap (the cluster plan), one LeaderWorkerSet per role + the router Deployment, or one
    RoleBasedGroup (prefill, decode, router roles); a Service for the router and a NetworkPolicy that
    lets only the router and the peer workers reach worker pods, either way."""
    check_options(opts)
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{opts.name}-cluster-plan", opts, "config"),
        "data": {"cluster-plan.json": json.dumps(plan_doc, indent=2, sort_keys=True) + "\n"},
    }
    if opts.flavor == "rbg":
        return [configmap, _rbg(cfg, opts, rehearse), _router_service(cfg, opts), _network_policy(opts)]
    return [configmap, _worker_lws(cfg, "prefill", opts, rehearse), _worker_lws(cfg, "decode", opts, rehearse),
            _router_deployment(cfg, opts, rehearse), _router_service(cfg, opts), _network_policy(opts)]


# ------------------------------------------------------------ YAML out (the launcher needs no YAML library)

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./:-]*(?<!:)")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    s = str(v)
    if _PLAIN.fullmatch(s) and s.lower() not in _RESERVED:
        return s
    return _quoted(s)


def _quoted(s: str) -> str:
    r"""A double-quoted YAML scalar that reads back as exactly `s`. JSON's own escaping is not enough:
    with ensure_ascii it writes a character outside the BMP as a surrogate pair (\ud83d\ude00), which
    YAML reads as two lone surrogates; so keep printable characters as they are (the file is UTF-8)
    and escape the rest with YAML's \uXXXX / \UXXXXXXXX."""
    out = []
    for ch in json.dumps(s, ensure_ascii=False)[1:-1]:
        o = ord(ch)
        out.append(ch if ch.isprintable() or ch in "\\\"" else (f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}"))
    return '"' + "".join(out) + '"'


def _block_ok(s: str) -> bool:
    """A literal block (`|`) keeps the text exactly only for plain lines ending in one newline."""
    lines = s[:-1].split("\n")
    return (s.endswith("\n") and not s.endswith("\n\n") and "\r" not in s and bool(lines[0])
            and not lines[0][0].isspace() and all(line.isprintable() for line in lines))


def _inline(item: Any) -> str:
    return json.dumps(item, ensure_ascii=False) if isinstance(item, (dict, list)) else _scalar(item)


def _emit(v: Any, indent: int, out: list[str]) -> None:
    pad = "  " * indent
    if isinstance(v, dict):
        for k, item in v.items():
            if isinstance(item, str) and "\n" in item and _block_ok(item):
                out.append(f"{pad}{_scalar(k)}: |")
                out += [f"{pad}  {line}" if line else "" for line in item[:-1].split("\n")]
            elif isinstance(item, (dict, list)) and item:
                out.append(f"{pad}{_scalar(k)}:")
                _emit(item, indent + 1, out)
            else:
                out.append(f"{pad}{_scalar(k)}: {_inline(item)}")
    elif isinstance(v, list):
        for item in v:
            if isinstance(item, (dict, list)) and item:
                sub: list[str] = []
                _emit(item, indent + 1, sub)
                first = sub[0][len(pad) + 2:]
                out.append(f"{pad}- {first}")
                out += sub[1:]
            else:
                out.append(f"{pad}- {_inline(item)}")


def to_yaml(docs: list[dict[str, Any]], header: str = "") -> str:
    out: list[str] = [f"# {line}" for line in header.splitlines()]
    for doc in docs:
        out.append("---")
        _emit(doc, 0, out)
    return "\n".join(out) + "\n"


def render(cfg: Config, plan_doc: dict[str, Any], opts: K8sOptions, rehearse: bool = False) -> str:
    spec = cfg.cluster
    assert spec is not None
    controller = "RoleBasedGroup controller (v0.8, v1alpha2)" if opts.flavor == "rbg" else \
        "LeaderWorkerSet controller (v0.10)"
    weights = (f"Model weights: a read-only hostPath {opts.model_host_path or cfg.model_path!r}, so they must be on EVERY\n"
               "GPU node at that path (copy them there and check with `v4flash-pd bundle verify DIR --model PATH --full`).\n"
               if not rehearse else "Rehearsal: stand-in engines, no GPUs and no model weights needed.\n")
    auth = (f"Router API key (the workers take it too): kubectl create secret generic {router_secret(opts)} "
            "--from-file=api-key=KEYFILE\n" if cfg.router is not None and cfg.router.auth else
            "The router is UNAUTHENTICATED: anyone who reaches its Service can generate (set router.api_key_file).\n")
    header = (f"Rendered by v4flash-pd {__version__} (`v4flash-pd render k8s --flavor {opts.flavor}`): "
              f"{spec.prefill} prefill + {spec.decode} decode TP workers (one pod each), one router.\n"
              f"Needs the {controller} and, for NUMA alignment, kubelets with the CPU Manager\n"
              "static policy, Topology Manager single-numa-node and the Memory Manager Static policy (README: cluster).\n"
              + weights
              + "Run dirs and compile caches are emptyDir volumes: lost when a pod restarts, and the caches take tens of\n"
                "minutes to rebuild (mount a volume at /var/cache/v4flash to keep them).\n"
              + auth
              + "The NetworkPolicy lets only the router (HTTP) and the peer workers (KV transfer) reach worker pods; it\n"
                "needs a CNI that enforces NetworkPolicies, and a rule of your own for Prometheus to scrape workers.\n"
              + "Apply: kubectl apply -f THIS_FILE")
    return to_yaml(manifests(cfg, plan_doc, opts, rehearse), header)
