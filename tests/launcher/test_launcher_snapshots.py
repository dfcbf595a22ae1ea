"""Golden `plan --json` per built-in profile: any change to an argv, env, port or binding shows up
as a reviewed diff of a committed file, not as a surprise on the GPU box.

Regenerate after an intended change: V4FLASH_UPDATE_SNAPSHOTS=1 pytest tests/launcher -k snapshot
(then read the diff in `git diff tests/launcher/snapshots/`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapshot import check_snapshot
from v4flash_pd.profiles import PROFILES

SNAPSHOTS = Path(__file__).parent / "snapshots"
T8 = str(Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json")
CASES = [(name, rehearse) for name in sorted(PROFILES) for rehearse in (False, True)]


def snapshot_path(profile: str, rehearse: bool) -> Path:
    return SNAPSHOTS / f"plan-{profile}{'-rehearse' if rehearse else ''}.json"


@pytest.mark.parametrize("profile, rehearse", CASES, ids=[f"{p}{'-rehearse' if r else ''}" for p, r in CASES])
def test_plan_json_matches_snapshot(profile: str, rehearse: bool, plan_json) -> None:
    args = ["--topology", T8, "--profile", profile] + (["--rehearse"] if rehearse else [])
    got = json.dumps(plan_json(*args), indent=2, sort_keys=True) + "\n"
    check_snapshot(got, snapshot_path(profile, rehearse), "plan --json")


def test_every_profile_has_a_snapshot() -> None:
    names = {p.name for p in SNAPSHOTS.glob("plan-*.json")}
    assert names == {snapshot_path(p, r).name for p, r in CASES}
