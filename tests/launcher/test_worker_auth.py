"""Workers behind a router with an API key take the same key (issue 23, security): sglang-router 0.3.2
sends `Authorization: Bearer KEY` to the workers it routes to, so a worker port reached directly,
past the router, answers 401 without it. The key stays out of argv, the run dir and the workers'
children. Real `up --rehearse`, the real router, stand-ins enforcing --api-key as SGLang does."""

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

SECRET = "v4-worker-key-51d2aa"


def get(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return int(exc.code), {}


@pytest.mark.parametrize("source", ["file", "env"])
def test_worker_ports_refuse_requests_that_bypass_the_router(source: str, tmp_path: Path) -> None:
    p = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, p)
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.5",
                "V4FLASH_GRACE": "5"})
    if source == "file":
        keyfile = tmp_path / "router.key"
        keyfile.write_text(SECRET + "\n")
        auth = ["--set", f"router.api_key_file={keyfile}"]
    else:
        env["ROUTER_API_KEY"] = SECRET
        auth = ["--set", "router.api_key_env=ROUTER_API_KEY"]
    out = tmp_path / "up.out"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(cfg), *auth],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 90
        while "READY" not in out.read_text() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert "READY" in out.read_text(), out.read_text()
        for port in (p[0], p[3]):  # prefill, decode: straight at the worker, past the router
            base = f"http://127.0.0.1:{port}"
            assert get(base + "/v1/models") == 401
            assert get(base + "/server_info", "wrong") == 401
            assert get(base + "/v1/models", SECRET) == 200
            assert get(base + "/health") == 200  # probes need no key, as in SGLang
        # through the router: it passes the key on to both workers
        status, reply = post(f"http://127.0.0.1:{p[5]}/v1/chat/completions",
                             {"model": "x", "messages": [{"role": "user", "content": "2 + 2 ="}], "max_tokens": 4},
                             SECRET)
        assert status == 200 and reply["choices"][0]["message"]["content"], reply
        run = (tmp_path / "runs" / "latest").resolve()
        pids = json.loads((run / "state.json").read_text())["pids"]
        for name in ("prefill-0", "decode-0"):
            cmdline = Path(f"/proc/{pids[name]}/cmdline").read_bytes().decode()
            assert SECRET not in cmdline and "v4flash_pd.workerauth" in cmdline, cmdline.split("\0")
            assert "workerauth" in (run / f"{name}.command").read_text()
        leaked = [q for q in run.rglob("*") if q.is_file() and SECRET.encode() in q.read_bytes()]
        assert leaked == [], leaked
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


WORKER = r"""
import os, subprocess, sys
print("argv has key:", sys.argv[-2:] == ["--api-key", os.environ.get("EXPECT", "")] or "--api-key" in sys.argv)
print("server_args=ServerArgs(api_key=%r)" % sys.argv[-1], flush=True)
sys.stderr.write("stderr line with %s\n" % sys.argv[-1])
child = subprocess.run([sys.executable, "-c", "import os; print('child sees key var:', 'ROUTER_API_KEY' in os.environ)"],
                       capture_output=True, text=True)
print(child.stdout.strip())
print("cmdline has key:", sys.argv[-1].encode() in open("/proc/self/cmdline", "rb").read())
"""


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_wrapper_hides_the_key_from_output_cmdline_and_children(source: str, tmp_path: Path) -> None:
    (tmp_path / "fakeworker.py").write_text(WORKER)
    env = fakebox.clean_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if source == "file":
        (tmp_path / "k").write_text(SECRET + "\n")
        src = ["--api-key-file", str(tmp_path / "k")]
    else:
        env["ROUTER_API_KEY"] = SECRET
        src = ["--api-key-env", "ROUTER_API_KEY"]
    res = subprocess.run([sys.executable, "-m", "v4flash_pd.workerauth", *src, "--", "fakeworker", "--port", "1"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert SECRET not in res.stdout + res.stderr, res.stdout + res.stderr
    assert "argv has key: True" in res.stdout  # the worker got --api-key KEY (in sys.argv only)
    assert "api_key='<api-key>'" in res.stdout and "stderr line with <api-key>" in res.stderr
    assert "child sees key var: False" in res.stdout
    assert "cmdline has key: False" in res.stdout


def test_the_wrapper_refuses_a_missing_key_before_the_worker_starts(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "v4flash_pd.workerauth", "--api-key-env", "ROUTER_API_KEY", "--",
                          "sys"], capture_output=True, text=True, env=fakebox.clean_env(), timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("error: router.api_key_env names $ROUTER_API_KEY")


@pytest.mark.parametrize("module", ["no.such.module", "nosuchmodule_v4", ".relative", ""])
def test_the_wrapper_refuses_a_worker_module_that_does_not_exist(tmp_path: Path, module: str) -> None:
    """A clean paragraph and exit 2 instead of runpy's ImportError traceback (issue 29)."""
    key = tmp_path / "k"
    key.write_text(SECRET + "\n")
    res = subprocess.run([sys.executable, "-m", "v4flash_pd.workerauth", "--api-key-file", str(key), "--", module,
                          "--port", "1"], capture_output=True, text=True, env=fakebox.clean_env(), timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"error: no module named {module!r}") and "\n  fix: " in res.stderr
    assert "Traceback" not in res.stderr and SECRET not in res.stdout + res.stderr
