"""What `up --detach` hands its background launcher: the resolved plan itself, as JSON, never argv.

The plan (and the launch around it) must survive the trip exactly, for every built-in profile and
every part of a cluster; a launch that is not one is refused in one paragraph, starting nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from v4flash_pd import topology as topo
from v4flash_pd.cluster import part_plans
from v4flash_pd.config.load import load_config
from v4flash_pd.host import Host
from v4flash_pd.launch import Launch
from v4flash_pd.plan import Plan, build_plan
from v4flash_pd.profiles import PROFILES

T8 = Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json"


def _plans() -> list[tuple[str, Plan]]:
    host = Host.remote(topo.load(T8))
    out = [(f"{name}{'-rehearse' if r else ''}", build_plan(load_config(profile=name, env={}), host, rehearse=r))
           for name in sorted(PROFILES) for r in (False, True)]
    cluster = load_config(env={}, overrides={"cluster.boxes": 2, "cluster.prefill": 2, "cluster.decode": 2})
    out += [(f"cluster {part}", plan) for part, plan in part_plans(cluster)]
    return out


PLANS = _plans()


@pytest.mark.parametrize("name, plan", PLANS, ids=[n for n, _ in PLANS])
def test_a_plan_survives_json_exactly(name: str, plan: Plan) -> None:
    text = json.dumps(plan.to_dict())
    assert Plan.from_dict(json.loads(text)) == plan


def test_a_launch_survives_json_exactly() -> None:
    _, plan = PLANS[0]
    launch = Launch(plan=plan, config={"profile": plan.profile}, fingerprint={"v4flash_pd": "x"}, grace=2.5,
                    ready_timeout=30.0, smoke_prompt="Hi", hang_timeout=7.0, eval_questions=3, eval_min_accuracy=0.5)
    assert Launch.from_dict(json.loads(json.dumps(launch.to_dict()))) == launch


def test_a_plan_of_another_format_is_refused() -> None:
    d = PLANS[0][1].to_dict()
    d["format"] = "v4flash-pd/plan/1"
    with pytest.raises(ValueError, match="plan/2"):
        Plan.from_dict(d)


@pytest.mark.parametrize("stdin", ["", "{}", '{"format": "v4flash-pd/launch/1"}', "not json"])
def test_the_background_launcher_refuses_what_is_not_a_launch(tmp_path: Path, stdin: str) -> None:
    res = subprocess.run([sys.executable, "-m", "v4flash_pd.launch", str(tmp_path)], input=stdin,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("error: the launch handed to the background launcher")
    assert "Traceback" not in res.stderr and not list(tmp_path.iterdir())  # no lock, no record, nothing started


@pytest.mark.parametrize("args, words", [
    (["--lock-fd", "x"], "usage: python -m v4flash_pd.launch RUN_DIR [--lock-fd FD]"),
    (["--lock", "5"], "usage: python -m v4flash_pd.launch RUN_DIR [--lock-fd FD]"),
    (["--lock-fd", "97"], "was not handed down (fd 97"),
    (["--lock-fd", "0"], "fd 0 is not the lock of run dir"),
])
def test_the_background_launcher_refuses_a_lock_it_was_not_handed(tmp_path: Path, args: list[str], words: str) -> None:
    """`up --detach` hands its run dir lock down as an open descriptor; anything else is refused before
    the launch is read or anything is recorded."""
    (tmp_path / ".lock").write_text("")
    res = subprocess.run([sys.executable, "-m", "v4flash_pd.launch", str(tmp_path), *args], input="{}",
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and words in res.stderr, res.stderr
    assert "fix: " in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
