"""Offline, strict schema validation of Kubernetes manifests, for tests.

Why this exists: no API server (etcd + kube-apiserver) can run on the test machines, yet the manifests
the launcher renders must be checked for what `kubectl apply` (field validation Strict) would reject:
wrong types and misspelled fields. A misspelled `readinesProbe` is silently dropped by a lenient
check and the pod then never gets a readiness probe, so "strict" is the point of this module.

Two sources of schemas, both read from disk only:

- built-in kinds (Deployment, Service, ConfigMap, ...): the `-strict` JSON schemas that the PyPI package
  `kubernetes-validate` ships for each Kubernetes minor (1.25 to 1.37 in 1.37.0). Every object in
  them already has `additionalProperties: false`.
- custom resources (LeaderWorkerSet, RoleBasedGroup): the vendored CRDs under `schemas/` (see its
  README). A CRD's `openAPIV3Schema` says nothing about unknown fields (the API server *prunes* them),
  so it is tightened here, see `_tighten`, and its root `metadata` (just `type: object` in every
  controller-gen CRD) is validated against the core ObjectMeta schema of the same Kubernetes version.

Not covered (needs a real API server): CEL rules (`x-kubernetes-validations`), admission webhooks
(LWS's own defaulting/validation), `format` checks (int32 range, date-time), list-map key uniqueness.

    docs = load_yaml_docs(path.read_text())
    assert validate(docs) == []
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

# Kubernetes minor the manifests are checked against by default: a version kubernetes-validate 1.37.0
# ships strict schemas for, old enough for current managed clusters, new enough for LWS v0.10.0
# (which needs StatefulSet start ordinals: Kubernetes >= 1.27).
DEFAULT_K8S_VERSION = "1.33"

SCHEMAS = Path(__file__).resolve().parent / "schemas"

# (API group, kind) -> vendored CRD file. Every version the CRD serves is accepted, as the API
# server would. Keep in step with schemas/README.md.
VENDORED_CRDS: dict[tuple[str, str], Path] = {
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"):
        SCHEMAS / "lws-v0.10.0" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("workloads.x-k8s.io", "RoleBasedGroup"):
        SCHEMAS / "rbg-v0.8.0-alpha.5" / "workloads.x-k8s.io_rolebasedgroups.yaml",
}

# `$id` of kubernetes-validate's shared definitions file; its per-kind schemas `$ref` into it.
_DEFS_URI = "https://kubernetes.io/api/_definitions.json"
_OBJECT_META_REF = _DEFS_URI + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_MAX_MESSAGE = 300

# libyaml when present: the RBG CRD is 2.9 MB, ~0.6 s with it and many seconds without.
_YamlLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml_docs(text: str) -> list[dict[str, Any]]:
    """Parse a (multi-document) YAML manifest into its objects, dropping empty documents.

    Raises ValueError on a document that is not a mapping: a manifest of scalars or lists is a
    rendering bug, not something to validate.
    """
    docs: list[dict[str, Any]] = []
    for i, doc in enumerate(yaml.load_all(text, Loader=_YamlLoader)):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ValueError(f"YAML document {i} is a {type(doc).__name__}, not a mapping")
        docs.append(doc)
    return docs


def validate(docs: Sequence[Mapping[str, Any]], k8s_version: str = DEFAULT_K8S_VERSION) -> list[str]:
    """Check each object strictly against its schema; return human-readable errors (empty = valid).

    Each error reads `doc <i> <Kind>/<name>: <field path>: <message>`, the field path dotted with list
    indexes in brackets (`spec.template.spec.containers[0]`), so a test failure names the field.
    An object whose apiVersion/kind is neither a built-in of `k8s_version` nor a vendored CRD is an
    error too: an unknown kind would otherwise pass unchecked.

    Raises ValueError when kubernetes-validate ships no schemas for `k8s_version` (a caller bug).
    """
    schema_dir = _core_schema_dir(k8s_version)
    errors: list[str] = []
    for i, doc in enumerate(docs):
        errors.extend(_validate_one(i, doc, schema_dir))
    return errors


def assert_valid(docs: Sequence[Mapping[str, Any]], k8s_version: str = DEFAULT_K8S_VERSION) -> None:
    """`validate`, raising AssertionError listing every error, for use in tests."""
    errors = validate(docs, k8s_version)
    if errors:
        raise AssertionError("Kubernetes schema errors:\n  " + "\n  ".join(errors))


def _validate_one(i: int, doc: Mapping[str, Any], schema_dir: str) -> list[str]:
    if not isinstance(doc, Mapping):
        return [f"doc {i}: not a mapping but a {type(doc).__name__}"]
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    where = f"doc {i} {kind}/{name or '?'}"
    if not isinstance(api_version, str) or not isinstance(kind, str) or not api_version or not kind:
        return [f"{where}: apiVersion and kind must both be non-empty strings"]

    errors: list[str] = []
    if not isinstance(meta, Mapping) or not (meta.get("name") or meta.get("generateName")):
        errors.append(f"{where}: metadata.name: missing (kubectl apply needs a name)")

    group, _, version = api_version.rpartition("/")
    crd_path = VENDORED_CRDS.get((group, kind))
    if crd_path is not None:
        served = _crd_versions(crd_path)
        if version not in served:
            return errors + [f"{where}: apiVersion: {api_version} is not served by the vendored {kind} CRD "
                             f"(serves {', '.join(f'{group}/{v}' for v in served)})"]
        # The CRD schema leaves root metadata as a bare object; check it like the API server does.
        if isinstance(meta, Mapping):
            errors += _errors(where, _object_meta_validator(schema_dir), meta, ("metadata",))
        return errors + _errors(where, _crd_validator(crd_path, version), doc, ())

    validator = _core_validator(schema_dir, _core_schema_file(api_version, kind))
    if validator is None:
        return errors + [f"{where}: no schema for apiVersion {api_version} kind {kind}: not a built-in of "
                         f"Kubernetes {schema_dir.split('-')[0].lstrip('v').removesuffix('.0')} and not a vendored CRD "
                         f"({', '.join(k for _, k in VENDORED_CRDS)})"]
    return errors + _errors(where, validator, doc, ())


def _errors(where: str, validator: Any, instance: Any, prefix: tuple[str | int, ...]) -> list[str]:
    out = []
    for err in sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path]):
        msg = err.message if len(err.message) <= _MAX_MESSAGE else err.message[:_MAX_MESSAGE] + "..."
        out.append(f"{where}: {_dotted((*prefix, *err.absolute_path))}: {msg}")
    return out


def _dotted(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


# ---- built-in kinds: kubernetes-validate's strict schemas ----------------------------------------

def _core_schema_dir(k8s_version: str) -> str:
    """`v1.33.0-local-strict` for "1.33" / "v1.33" / "1.33.4"; exact minor only, no fallback."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?", k8s_version)
    name = f"v{m.group(1)}.{m.group(2)}.0-local-strict" if m else ""
    if not m or not _schema_root().joinpath(name).is_dir():
        have = sorted(p.name for p in _schema_root().iterdir() if p.name.endswith("-local-strict"))
        raise ValueError(f"kubernetes-validate ships no strict schemas for Kubernetes {k8s_version!r}; has {have}")
    return name


def _schema_root() -> Any:
    return resources.files("kubernetes_validate").joinpath("kubernetes-json-schema")


def _core_schema_file(api_version: str, kind: str) -> str:
    # kubernetes-validate's naming: drop the group's domain, `/` -> `-` (rbac.authorization.k8s.io/v1 ->
    # rbac-v1; v1 stays v1). Each schema pins apiVersion with an enum, so a wrong domain still fails.
    api = re.sub(r"^([^./]*)(?:[.][^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{api}.json"


@functools.cache
def _core_registry(schema_dir: str) -> Registry:
    text = _schema_root().joinpath(schema_dir, "_definitions.json").read_text()
    return Resource.from_contents(json.loads(text)) @ Registry()


@functools.cache
def _core_validator(schema_dir: str, filename: str) -> Any:
    ref = _schema_root().joinpath(schema_dir, filename)
    if not ref.is_file():
        return None
    schema = json.loads(ref.read_text())
    return jsonschema.Draft202012Validator(schema, registry=_core_registry(schema_dir))


@functools.cache
def _object_meta_validator(schema_dir: str) -> Any:
    return jsonschema.Draft202012Validator({"$ref": _OBJECT_META_REF}, registry=_core_registry(schema_dir))


# ---- custom resources: vendored CRDs, tightened ------------------------------------------------------

@functools.cache
def _crd(path: Path) -> dict[str, Any]:
    crd = yaml.load(path.read_text(), Loader=_YamlLoader)
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{path} is not a CustomResourceDefinition")
    return crd


def _crd_versions(path: Path) -> list[str]:
    return [v["name"] for v in _crd(path)["spec"]["versions"] if v.get("served")]


@functools.cache
def _crd_validator(path: Path, version: str) -> Any:
    """A Draft 4 validator (closest to OpenAPI 3.0's schema objects) for one served CRD version.

    Cached: building it walks the whole schema (1.3 MB for LWS, 2.9 MB for RBG).
    """
    crd = _crd(path)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _tighten(entry["schema"]["openAPIV3Schema"])
    props = dict(schema.get("properties", {}))
    props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version}"]}
    props["kind"] = {"type": "string", "enum": [kind]}
    props.setdefault("metadata", {"type": "object"})  # validated separately against ObjectMeta
    schema["properties"] = props
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return jsonschema.Draft4Validator(schema)


def _tighten(node: Any) -> Any:
    """Return a copy of an OpenAPI v3 CRD schema in which unknown fields are errors.

    The API server prunes unknown fields of a custom resource (and `kubectl apply`, with its default
    strict field validation, rejects them); plain JSON Schema allows them. So every object schema
    with `properties` gets `additionalProperties: false`, except where Kubernetes itself keeps
    unknown fields or means a map:
    - the schema already sets `additionalProperties` (a map such as labels or resources.limits),
    - it has `x-kubernetes-preserve-unknown-fields: true` (free-form, e.g. RBG template patches),
    - it has no `properties` (e.g. the bare `type: object` metadata of a pod template).
    Only `properties`, `items` and `additionalProperties` are descended: a branch of
    anyOf/allOf/oneOf/not may list a subset of the properties, and closing it would reject the rest.

    Also translates Kubernetes extensions that JSON Schema does not know:
    - `x-kubernetes-int-or-string: true` without anyOf -> integer or string,
    - `nullable: true` -> null allowed,
    - `x-kubernetes-embedded-resource: true` -> apiVersion/kind/metadata are implicit properties.
    """
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if out.get("x-kubernetes-int-or-string") is True and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    props = out.get("properties")
    if isinstance(props, dict):
        if out.get("x-kubernetes-embedded-resource") is True:
            props = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                     "metadata": {"type": "object"}, **props}
        out["properties"] = {key: _tighten(sub) for key, sub in props.items()}
        if "additionalProperties" not in out and out.get("x-kubernetes-preserve-unknown-fields") is not True:
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _tighten(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _tighten(out["additionalProperties"])
    return out
