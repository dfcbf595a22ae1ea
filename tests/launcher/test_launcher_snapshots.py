"""Golden `plan --json` per built-in profile: any change to an argv, env, port or binding shows up
as a reviewed diff of a committed file, not as a surprise on the GPU box.

Regenerate after an intended change: V4FLASH_UPDATE_SNAPSHOTS=1 pytest tests/launcher -k snapshot
(then read the diff in `git diff tests/launcher/snapshots/`).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest

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
    path = snapshot_path(profile, rehearse)
    if os.environ.get("V4FLASH_UPDATE_SNAPSHOTS") == "1":
        path.write_text(got)
    assert path.exists(), f"no snapshot {path.name}: run with V4FLASH_UPDATE_SNAPSHOTS=1 and commit it"
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(path), "plan --json"))
        pytest.fail(f"plan for {profile} changed:\n{diff[:6000]}")


def test_every_profile_has_a_snapshot() -> None:
    names = {p.name for p in SNAPSHOTS.glob("plan-*.json")}
    assert names == {snapshot_path(p, r).name for p, r in CASES}
