"""A router key file (and a key variable) is exactly one non-empty line of printable ASCII (issue 29).

A two-line key file was accepted: the second line went into the `Authorization` header, the HTTP
client refused it with an error quoting the header, and the key reached `up`'s output, state.json,
launcher.log and the report. Now every reader of a key (up, report, bench, eval, the router and
worker wrappers) refuses anything else before anything starts, and never shows the content."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fakebox
import pytest

pytestmark = pytest.mark.timeout(120)

CORE = "SECRETcore"
BAD = {
    "two-lines": f"{CORE}1\n{CORE}2\n",
    "blank-second-line": f"{CORE}\n\n",
    "blank-first-line": f"\n{CORE}\n",
    "carriage-return-inside": f"{CORE}\rx\n",
    "tab": f"{CORE}\tx\n",
    "nul": f"{CORE}\0x\n",
    "non-ascii": f"{CORE}\u20ac\n",
    "empty": "",
    "only-newline": "\n",
}
CLI = [sys.executable, "-m", "v4flash_pd"]


def run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=90)


def paragraph(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and "\n  fix: " in res.stderr and "Traceback" not in res.stderr
    assert CORE not in res.stdout + res.stderr


@pytest.fixture()
def box(tmp_path: Path) -> dict:
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.2",
                "V4FLASH_GRACE": "5", "V4FLASH_READY_TIMEOUT": "30"})
    topo = fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)
    return {"tmp": tmp_path, "env": env, "base": ["--rehearse", "--config", str(cfg), "--topology", str(topo)]}


@pytest.mark.parametrize("content", list(BAD.values()), ids=list(BAD))
def test_a_malformed_key_file_is_refused_by_up_before_anything_starts(box, content):
    key = box["tmp"] / "router.key"
    key.write_text(content, encoding="utf-8")
    res = run(["up", *box["base"], "--detach", "--run-dir", str(box["tmp"] / "run"), "--set",
               f"router.api_key_file={key}"], box["env"], box["tmp"])
    paragraph(res)
    assert str(key) in res.stderr and "one" in res.stderr
    assert not (box["tmp"] / "run").exists(), "nothing started, not even a run dir"


def test_a_two_line_key_is_refused_everywhere_a_key_is_read(box):
    key = box["tmp"] / "router.key"
    key.write_text(BAD["two-lines"])
    env = dict(box["env"], ROUTER_KEY=BAD["two-lines"])
    url = f"http://127.0.0.1:{fakebox.free_ports(1)[0]}"
    for args in (["up", *box["base"], "--set", "router.api_key_env=ROUTER_KEY"],
                 ["report", *box["base"], "--out", "rep", "--set", f"router.api_key_file={key}"],
                 ["bench", "--url", url, "--api-key-file", str(key)],
                 ["bench", "--url", url, "--api-key-env", "ROUTER_KEY"],
                 ["eval", "--url", url, "--api-key-file", str(key)]):
        res = run(args, env, box["tmp"])
        paragraph(res)
        assert "2 lines" in res.stderr, (args[0], res.stderr)
    assert not (box["tmp"] / "rep").exists()
    for wrapper in ("v4flash_pd.routerauth", "v4flash_pd.workerauth"):
        res = subprocess.run([sys.executable, "-m", wrapper, "--api-key-file", str(key), "--", "x"],
                             capture_output=True, text=True, env=env, timeout=60)
        paragraph(res)


@pytest.mark.parametrize("content", ["k3y-" + CORE + "\n", "k3y-" + CORE, "  k3y-" + CORE + "  \r\n"])
def test_one_line_is_accepted_with_or_without_its_newline(box, content):
    key = box["tmp"] / "router.key"
    key.write_text(content)
    url = f"http://127.0.0.1:{fakebox.free_ports(1)[0]}"
    res = run(["bench", "--url", url, "--requests", "1", "--concurrency", "1", "--api-key-file", str(key)],
              box["env"], box["tmp"])
    assert res.returncode == 1 and "key" not in res.stderr.lower(), res.stderr  # it got as far as the connection
    assert CORE not in res.stdout + res.stderr


def test_a_key_with_quotes_reaches_no_output_state_or_log_in_any_spelling(box):
    """`up --detach` with a one-line key holding quotes and a backslash (its JSON and repr spellings differ
    from the raw one): none of them in up's output, state.json, launcher.log or any file of the run."""
    key = box["tmp"] / "router.key"
    key.write_text(f"k'\"{CORE}\\z\n")
    run_dir = box["tmp"] / "run"
    up = run(["up", *box["base"], "--detach", "--run-dir", str(run_dir), "--set", f"router.api_key_file={key}"],
             box["env"], box["tmp"])
    try:
        assert up.returncode == 0 and "READY" in up.stdout, up.stdout[-2000:] + up.stderr[-2000:]
        assert CORE not in up.stdout + up.stderr
        assert json.loads((run_dir / "state.json").read_text())["status"] == "ready"
        leaked = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file() and CORE.encode() in p.read_bytes()]
        assert leaked == []
    finally:
        down = run(["down", "--run-dir", str(run_dir)], box["env"], box["tmp"])
        assert down.returncode == 0, down.stdout + down.stderr
    assert CORE.encode() not in (run_dir / "launcher.log").read_bytes()
