"""A rehearsal (and so `make demo`) listens on 127.0.0.1 by default.

The profiles put the router (or the aggregated server) on 0.0.0.0 for the GPU box; a rehearsal on a
laptop or a CI runner has no reason to offer an unauthenticated endpoint to its network. This layer
sits right above the profile: a config file, V4FLASH_SET or a flag that names the address wins.
"""

from __future__ import annotations

from typing import Any, Mapping

WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK = "127.0.0.1"


def loopback_layer(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The raw layer that moves the profile's wildcard listeners to 127.0.0.1."""
    layer: dict[str, Any] = {}
    router = raw.get("router")
    if isinstance(router, Mapping) and router.get("host") in WILDCARDS:
        layer["router"] = {"host": LOOPBACK}
    for role in ("prefill", "decode", "server"):
        entries = raw.get(role)
        if isinstance(entries, list) and entries:
            moved = [{"host": LOOPBACK} if isinstance(e, Mapping) and e.get("host") in WILDCARDS else {}
                     for e in entries]
            if any(moved):
                layer[role] = moved
    return layer
