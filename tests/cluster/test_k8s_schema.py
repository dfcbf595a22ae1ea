"""The offline Kubernetes schema check (k8s_schema.py) accepts good manifests and names the bad field.

Each broken manifest is a known-good one with exactly one mistake, so a test that expects a failure
fails for that mistake and nothing else. Fast: no cluster, only the vendored / pip-shipped schemas.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cluster import k8s_schema
from cluster.k8s_schema import assert_valid, load_yaml_docs, validate

LWS_YAML = """\
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: v4flash-decode
  namespace: serving
  labels: {app.kubernetes.io/name: v4flash-pd, v4flash-pd/role: decode}
  annotations: {v4flash-pd/config-sha256: "0123abcd"}
spec:
  replicas: 2
  startupPolicy: LeaderCreated
  networkConfig: {subdomainPolicy: Shared}
  leaderWorkerTemplate:
    size: 1
    restartPolicy: RecreateGroupOnPodRestart
    workerTemplate:
      metadata:
        labels: {v4flash-pd/role: decode}
      spec:
        containers:
        - name: sglang
          image: registry.example/v4flash-pd:1.0
          command: [v4flash-pd, serve, --role, decode]
          env:
          - {name: V4FLASH_ROLE, value: decode}
          ports:
          - {name: http, containerPort: 30000}
          resources:
            limits: {nvidia.com/gpu: 4, memory: 512Gi, cpu: "32"}
            requests: {nvidia.com/gpu: "4", ephemeral-storage: 100Gi}
          readinessProbe:
            httpGet: {path: /health, port: http}
            periodSeconds: 10
          startupProbe:
            httpGet: {path: /health, port: 30000}
            failureThreshold: 120
            periodSeconds: 10
          volumeMounts:
          - {name: shm, mountPath: /dev/shm}
        volumes:
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: 64Gi}
"""

CORE_YAML = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: v4flash-config, labels: {app: v4flash-pd}}
data:
  config.toml: |
    model = "deepseek-ai/DeepSeek-V4-Flash"
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: v4flash-router}
spec:
  replicas: 1
  selector: {matchLabels: {app: v4flash-router}}
  template:
    metadata: {labels: {app: v4flash-router}}
    spec:
      containers:
      - name: router
        image: registry.example/v4flash-pd:1.0
        args: [router, --port, "8000"]
        ports: [{containerPort: 8000}]
        resources:
          limits: {cpu: "2", memory: 4Gi}
        readinessProbe:
          httpGet: {path: /health, port: 8000}
        volumeMounts: [{name: config, mountPath: /etc/v4flash}]
      volumes:
      - name: config
        configMap: {name: v4flash-config}
---
apiVersion: v1
kind: Service
metadata: {name: v4flash-router}
spec:
  selector: {app: v4flash-router}
  ports:
  - {name: http, port: 80, targetPort: 8000, protocol: TCP}
"""

RBG_YAML = """\
apiVersion: workloads.x-k8s.io/v1alpha2
kind: RoleBasedGroup
metadata: {name: v4flash}
spec:
  roles:
  - name: router
    replicas: 1
    standalonePattern:
      template:
        spec:
          containers:
          - {name: router, image: registry.example/v4flash-pd:1.0}
"""


def lws() -> dict[str, Any]:
    (doc,) = load_yaml_docs(LWS_YAML)
    return doc


def lws_container(doc: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    return container


def core() -> list[dict[str, Any]]:
    return load_yaml_docs(CORE_YAML)


def assert_one_error_naming(errors: list[str], *needles: str) -> None:
    assert len(errors) == 1, errors
    for needle in needles:
        assert needle in errors[0], (needle, errors)


# ---- good manifests ------------------------------------------------------------------------------

def test_valid_lws_passes() -> None:
    assert validate([lws()]) == []


def test_valid_lws_with_leader_template_passes() -> None:
    doc = lws()
    template = doc["spec"]["leaderWorkerTemplate"]
    template["size"] = 2
    template["leaderTemplate"] = copy.deepcopy(template["workerTemplate"])
    assert validate([doc]) == []


def test_valid_core_manifests_pass() -> None:
    docs = core()
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service"]
    assert_valid(docs)


def test_valid_rbg_passes() -> None:
    assert validate(load_yaml_docs(RBG_YAML)) == []


def test_rbg_misspelled_field_fails() -> None:
    (doc,) = load_yaml_docs(RBG_YAML)
    doc["spec"]["roles"][0]["replica"] = 1
    assert_one_error_naming(validate([doc]), "RoleBasedGroup/v4flash", "spec.roles[0]", "'replica'")


def test_tightening_keeps_maps_and_free_form_fields() -> None:
    """additionalProperties: false must not close the maps (labels, limits, nodeSelector, ...)."""
    doc = lws()
    doc["metadata"]["labels"]["any.example/label"] = "x"
    doc["metadata"]["annotations"]["any.example/annotation"] = "y"
    pod = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    pod["metadata"]["labels"]["another"] = "label"
    pod["metadata"]["annotations"] = {"kubectl.kubernetes.io/default-container": "sglang"}
    pod["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H200"}
    container = lws_container(doc)
    container["resources"]["limits"]["rdma/ib"] = 1
    container["resources"]["limits"]["hugepages-2Mi"] = "1Gi"
    assert validate([doc]) == []


def test_empty_documents_are_dropped() -> None:
    assert load_yaml_docs("---\n---\n" + CORE_YAML + "\n---\n") == core()


# ---- broken LWS ------------------------------------------------------------------------------------

def test_lws_replicas_string_fails() -> None:
    doc = lws()
    doc["spec"]["replicas"] = "one"
    assert_one_error_naming(validate([doc]), "LeaderWorkerSet/v4flash-decode", "spec.replicas", "'one'")


def test_lws_misspelled_readiness_probe_fails() -> None:
    doc = lws()
    container = lws_container(doc)
    container["readinesProbe"] = container.pop("readinessProbe")
    assert_one_error_naming(validate([doc]), "workerTemplate.spec.containers[0]", "readinesProbe")


def test_lws_both_mistakes_reported() -> None:
    """The recipe's smoke case: replicas 'one' and readinesProbe, both reported, not only the first."""
    doc = lws()
    doc["spec"]["replicas"] = "one"
    container = lws_container(doc)
    container["readinesProbe"] = container.pop("readinessProbe")
    errors = validate([doc])
    assert len(errors) == 2, errors
    assert any("spec.replicas" in e for e in errors) and any("readinesProbe" in e for e in errors)


@pytest.mark.parametrize(
    ("mutate", "needles"),
    [
        (lambda d: d["spec"].__setitem__("replica", 2), ("spec", "'replica'")),
        (lambda d: d["spec"]["leaderWorkerTemplate"].__setitem__("size", "1"), ("leaderWorkerTemplate.size",)),
        (lambda d: d["spec"]["leaderWorkerTemplate"].pop("workerTemplate"), ("'workerTemplate' is a required",)),
        (lambda d: d["spec"]["networkConfig"].__setitem__("subdomainPolicy", "PerPod"), ("subdomainPolicy",)),
        (lambda d: lws_container(d)["startupProbe"]["httpGet"].__setitem__("port", 1.5), ("httpGet.port",)),
        (lambda d: lws_container(d)["resources"].__setitem__("limit", {}), ("'limit'",)),
        (lambda d: d["metadata"].__setitem__("label", {}), ("metadata", "'label'")),
        (lambda d: d["metadata"]["labels"].__setitem__("n", 1), ("metadata.labels.n",)),
        (lambda d: d.__setitem__("apiVersion", "leaderworkerset.x-k8s.io/v2"), ("not served",)),
        (lambda d: d.__setitem__("extra", 1), ("'extra'",)),
    ],
    ids=["misspelled-spec-field", "size-string", "no-workerTemplate", "bad-enum", "port-float",
         "misspelled-resources-field", "misspelled-metadata-field", "label-not-string", "unserved-version",
         "unknown-root-field"],
)
def test_lws_single_mistakes_fail(mutate: Any, needles: tuple[str, ...]) -> None:
    doc = lws()
    mutate(doc)
    assert_one_error_naming(validate([doc]), *needles)


# ---- broken core kinds -----------------------------------------------------------------------------

def test_deployment_misspelled_container_field_fails() -> None:
    docs = core()
    container = docs[1]["spec"]["template"]["spec"]["containers"][0]
    container["imagePullPolicyy"] = "Always"
    assert_one_error_naming(validate(docs), "Deployment/v4flash-router", "containers[0]", "imagePullPolicyy")


def test_service_port_wrong_type_fails() -> None:
    docs = core()
    docs[2]["spec"]["ports"][0]["port"] = "eighty"
    assert_one_error_naming(validate(docs), "Service/v4flash-router", "spec.ports[0].port", "'eighty'")


def test_errors_name_the_document() -> None:
    docs = core()
    del docs[0]["metadata"]["name"]
    assert_one_error_naming(validate(docs), "doc 0 ConfigMap/?", "metadata.name")


# ---- what cannot be checked is an error, not a pass -----------------------------------------------

def test_unknown_kind_fails() -> None:
    doc = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert_one_error_naming(validate([doc]), "Widget/w", "no schema")


@pytest.mark.parametrize("api_version", ["extensions/v1", "apps.example.com/v1"])
def test_builtin_kind_under_wrong_group_fails(api_version: str) -> None:
    """apps.example.com/v1 maps to kubernetes-validate's apps-v1 file; its apiVersion enum must catch it."""
    docs = core()
    docs[1]["apiVersion"] = api_version
    assert_one_error_naming(validate(docs[1:2]), "Deployment/v4flash-router", api_version.split("/")[0])


def test_unshipped_k8s_version_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="1.99"):
        validate(core(), k8s_version="1.99")


def test_non_mapping_yaml_document_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a mapping"):
        load_yaml_docs("- a\n- b\n")


# ---- the tightening itself -------------------------------------------------------------------------

def test_tighten_rules() -> None:
    schema = {
        "type": "object",
        "properties": {
            "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"b": {}}},
            "bare": {"type": "object"},
            "ios": {"x-kubernetes-int-or-string": True},
            "list": {"type": "array", "items": {"type": "object", "properties": {"c": {}}}},
        },
    }
    out = k8s_schema._tighten(schema)
    assert "additionalProperties" not in schema  # a copy: the cached CRD stays as vendored
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["closed"]["additionalProperties"] is False
    assert props["map"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["free"]
    assert "additionalProperties" not in props["bare"]
    assert props["ios"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert props["list"]["items"]["additionalProperties"] is False


def test_vendored_crds_are_the_named_versions() -> None:
    for (group, kind), path in k8s_schema.VENDORED_CRDS.items():
        crd = k8s_schema._crd(path)
        assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
    assert k8s_schema._crd_versions(k8s_schema.VENDORED_CRDS["leaderworkerset.x-k8s.io", "LeaderWorkerSet"]) == ["v1"]
    assert "v1alpha2" in k8s_schema._crd_versions(k8s_schema.VENDORED_CRDS["workloads.x-k8s.io", "RoleBasedGroup"])
