"""Router client authentication with the real sglang-router 0.3.2: the key guards /generate, comes
from a file or a variable, and appears in no argv, `.command` file, plan, state or log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import fakebox
import pytest

pytestmark = pytest.mark.timeout(150)

SECRET = "v4-test-key-8c1f0e"


def post(url: str, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"text": "2 + 2 =", "sampling_params": {"max_new_tokens": 4}}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def grep_tree(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.parametrize("source", ["file", "env"])
def test_api_key_guards_generate_and_never_leaks(source: str, tmp_path: Path) -> None:
    p = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, p)
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "1",
                "V4FLASH_GRACE": "5"})
    if source == "file":
        keyfile = tmp_path / "router.key"
        keyfile.write_text(SECRET + "\n")
        keyfile.chmod(0o600)
        auth = ["--set", f"router.api_key_file={keyfile}"]
    else:
        env["V4FLASH_TEST_ROUTER_KEY"] = SECRET
        auth = ["--set", "router.api_key_env=V4FLASH_TEST_ROUTER_KEY"]
    plan = subprocess.run([sys.executable, "-m", "v4flash_pd", "plan", "--rehearse", "--config", str(cfg), *auth],
                          capture_output=True, text=True, env=env, timeout=60)
    assert plan.returncode == 0 and SECRET not in plan.stdout + plan.stderr
    assert "auth     api key (Authorization: Bearer) from" in plan.stdout and "WITHOUT" not in plan.stdout
    out = tmp_path / "up.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(cfg), *auth],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 90
        while "READY" not in out.read_text() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert "READY" in out.read_text(), out.read_text()  # the smoke request carried the key
        url = f"http://127.0.0.1:{p[5]}/generate"
        assert post(url, None) == 401
        assert post(url, "wrong-key") == 401
        assert post(url, SECRET) == 200
        run = (tmp_path / "runs" / "latest").resolve()
        pid = json.loads((run / "state.json").read_text())["pids"]["router"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert SECRET not in cmdline, [x for x in cmdline.split("\0") if x]
        assert (run / "router.command").exists() and "routerauth" in (run / "router.command").read_text()
        assert grep_tree(run, SECRET) == [], "the key was written into the run dir"
        if source == "file":  # the clients that ship with the launcher send the key too
            base = f"http://127.0.0.1:{p[5]}"
            cli = [sys.executable, "-m", "v4flash_pd"]
            ev = subprocess.run([*cli, "eval", "--url", base, "--questions", "3", "--api-key-file", str(keyfile)],
                                capture_output=True, text=True, env=env, timeout=60)
            assert ev.returncode == 0 and "eval PASS" in ev.stdout, ev.stdout + ev.stderr
            bench = [*cli, "bench", "--url", base, "--concurrency", "1", "--requests", "2", "--input-len", "8",
                     "--output-len", "4"]
            ok = subprocess.run([*bench, "--api-key-file", str(keyfile)], capture_output=True, text=True, env=env,
                                timeout=60)
            assert ok.returncode == 0, ok.stdout + ok.stderr
            denied = subprocess.run(bench, capture_output=True, text=True, env=env, timeout=60)
            assert denied.returncode == 1 and "401" in denied.stderr, denied.stdout + denied.stderr
        # offline: the router's tokenizer lookup for the (absent) model dir never left the box
        assert "huggingface.co" not in (run / "router.log").read_text(errors="replace")
        assert SECRET not in out.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def test_missing_key_file_is_refused_before_start(tmp_path: Path) -> None:
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(cfg),
                          "--run-dir", str(tmp_path / "run"), "--set", f"router.api_key_file={tmp_path / 'nokey'}"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2 and "cannot read the router API key file" in res.stderr, res.stderr
    assert "READY" not in res.stdout and not list((tmp_path / "run").glob("*.log"))


def test_router_wrapper_argv_is_the_routers_own(tmp_path: Path) -> None:
    """What follows `--` is parsed by the pinned router's parser: same workers, ports, policy."""
    import argparse

    from sglang_router.launch_router import RouterArgs

    from v4flash_pd import topology as topo
    from v4flash_pd.config.load import load_config
    from v4flash_pd.host import Host
    from v4flash_pd.plan import build_plan

    t8 = Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json"
    cfg = load_config(env={}, sets=(f"router.api_key_file={tmp_path / 'k'}",))
    argv = list(build_plan(cfg, Host.remote(topo.load(t8))).get("router").argv)
    assert argv[1:5] == ["-m", "v4flash_pd.routerauth", "--api-key-file", str(tmp_path / "k")]
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    ra = RouterArgs.from_cli_args(parser.parse_args(argv[argv.index("--") + 1:]))
    assert ra.pd_disaggregation and ra.api_key is None  # the key is set by the wrapper, never on argv
    assert ra.prefill_urls == [("http://127.0.0.1:30000", 8998)] and ra.decode_urls == ["http://127.0.0.1:30001"]
