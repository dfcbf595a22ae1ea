"""The format markers of the JSON documents the launcher writes, and the one place they are put on.

Every document says what it is and which version of it (`"format": "v4flash-pd/<kind>/<n>"`), so a
reader can refuse a file of another kind or an older shape by name instead of failing on a key.
"""

from __future__ import annotations

from typing import Any, Mapping

PLAN = "v4flash-pd/plan/2"  # 2: ports name their process and kind; warnings carry a code
TOPOLOGY = "v4flash-pd/topology/1"
CLUSTER_PLAN = "v4flash-pd/cluster-plan/1"
CLUSTER_VIEW = "v4flash-pd/cluster-view/1"
LAUNCH = "v4flash-pd/launch/1"  # what `up --detach` hands its background launcher


def stamp(marker: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """`body` as a document of kind `marker`: the marker first, then the body's keys."""
    return {"format": marker, **{k: v for k, v in body.items() if k != "format"}}


def marker_of(doc: Any) -> str:
    """The format a parsed document claims ("" when it is no JSON object or claims none)."""
    return str(doc.get("format") or "") if isinstance(doc, dict) else ""
