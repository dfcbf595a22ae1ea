"""A CycloneDX 1.5 JSON SBOM derived from the stack lock (never hand-written, never scanned).

The lock already pins every distribution with its sha256 set, so the SBOM is a pure function of
it: same lock bytes -> same components and the same serial number (uuid5 of the lock hash), which
lets `verify` regenerate it offline and compare. The lock lists every acceptable artifact hash
for a version (one per platform wheel); they all go into the component's `hashes`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from v4flash_pd.stacklock import StackLock

SPEC_VERSION = "1.5"
_NS = uuid.UUID("6f1d7c52-0b7e-4c39-9b0a-4c1f6a0e2d11")


def purl(name: str, version: str) -> str:
    return f"pkg:pypi/{name}@{version}"


def components(lock: StackLock) -> list[dict[str, Any]]:
    out = []
    for pkg in sorted(lock.packages, key=lambda p: p.name):
        comp: dict[str, Any] = {
            "type": "library",
            "bom-ref": purl(pkg.name, pkg.version),
            "name": pkg.name,
            "version": pkg.version,
            "purl": purl(pkg.name, pkg.version),
            "hashes": [
                {"alg": "SHA-256", "content": h.split(":", 1)[1]}
                for h in sorted(pkg.hashes)
                if h.startswith("sha256:")
            ],
        }
        if pkg.marker:
            comp["properties"] = [{"name": "v4flash:marker", "value": pkg.marker}]
        out.append(comp)
    return out


def sbom_from_lock(lock: StackLock, created: str, tool_version: str) -> dict[str, Any]:
    """The SBOM document; `created` is an ISO-8601 UTC timestamp."""
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid5(_NS, lock.sha256)}",
        "version": 1,
        "metadata": {
            "timestamp": created,
            "tools": {"components": [{"type": "application", "name": "v4flash-pd", "version": tool_version}]},
            "component": {"type": "application", "name": "v4flash-pd", "version": tool_version,
                          "bom-ref": "v4flash-pd"},
            "properties": [
                {"name": "v4flash:lock-sha256", "value": lock.sha256},
                *({"name": f"v4flash:lock-{k}", "value": v} for k, v in sorted(lock.header.items())),
            ],
        },
        "components": components(lock),
        "dependencies": [
            {"ref": "v4flash-pd",
             "dependsOn": [purl(p.name, p.version) for p in sorted(lock.packages, key=lambda p: p.name)]}
        ],
    }


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=False) + "\n"


def check_sbom(text: str, lock: StackLock) -> list[str]:
    """Problems if the SBOM does not describe exactly this lock (pure)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not valid JSON ({exc.msg})"]
    if not isinstance(doc, dict):
        return [f"a JSON {type(doc).__name__}, not a CycloneDX document (a JSON object)"]
    problems = []
    if doc.get("bomFormat") != "CycloneDX":
        problems.append("bomFormat is not CycloneDX")
    meta = doc.get("metadata")
    listed = meta.get("properties") if isinstance(meta, dict) else None
    if not isinstance(listed, list) or not all(isinstance(p, dict) for p in listed):
        listed = []
        problems.append("metadata.properties is not a list of CycloneDX properties")
    props = {p.get("name"): p.get("value") for p in listed}
    if props.get("v4flash:lock-sha256") != lock.sha256:
        problems.append(f"records lock sha256 {props.get('v4flash:lock-sha256')}, the bundled lock is {lock.sha256}")
    if doc.get("components") != components(lock):
        problems.append("components differ from the bundled stack.lock")
    return problems
