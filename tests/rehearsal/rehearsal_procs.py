"""Helpers for the rehearsal tests: free ports, real subprocesses, bounded HTTP polling.

Everything talks to 127.0.0.1 and every wait is bounded; processes are started in their own
process group so teardown can always kill them (and anything they spawned).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import fakebox

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def request(method: str, port: int, path: str, body: Any = None, timeout: float = 10.0,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post_json(port: int, path: str, body: Any, timeout: float = 15.0) -> tuple[int, Any]:
    status, _, data = request("POST", port, path, body, timeout)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode(errors="replace")


def sse_events(raw: bytes) -> list[Any]:
    """Parse an SSE body into JSON payloads; '[DONE]' stays a string."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_status(port: int, path: str, want: int, timeout: float) -> float:
    """Poll until GET path returns `want`; returns the seconds it took (bounded)."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        try:
            last = request("GET", port, path, timeout=2.0)[0]
            if last == want:
                return time.monotonic() - t0
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"GET :{port}{path} did not return {want} within {timeout}s "
                         f"(last: {last!r})")


@dataclass
class Proc:
    """A real subprocess with its output in a file; `lines()` reads what it wrote so far."""

    name: str
    popen: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def records(self) -> list[dict[str, Any]]:
        return fakebox.json_records(self.text())

    def wait_records(self, keep: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> list[dict[str, Any]]:
        """The records `keep` selects, once there is one: an engine logs a request after it has answered,
        so the client (through the router) can hold the answer before the engine's line is written."""
        deadline = time.monotonic() + timeout
        while True:
            got = [r for r in self.records() if keep(r)]
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the group, then SIGKILL after `grace`; returns the exit code."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(5)
        return self.popen.returncode


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    fh = open(log, "wb")
    try:
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=full_env,
                             cwd=REPO, start_new_session=True)
    finally:
        fh.close()
    return Proc(name, p, log, argv)


def engine_argv(port: int, mode: str = "null", boot_port: int | None = None,
                extra: list[str] | None = None) -> list[str]:
    argv = [PY, "-m", "v4flash_pd.rehearsal.engine", "--model-path", "/models/DeepSeek-V4-Flash",
            "--host", HOST, "--port", str(port), "--tp", "4"]
    if mode != "null":
        argv += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl"]
    if boot_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(boot_port)]
    return argv + (extra or [])


def router_argv(port: int, metrics_port: int, prefill_port: int, boot: str | None,
                decode_port: int) -> list[str]:
    prefill = ["--prefill", f"http://{HOST}:{prefill_port}"] + ([boot] if boot else [])
    return [PY, "-m", "sglang_router.launch_router", "--pd-disaggregation", *prefill,
            "--decode", f"http://{HOST}:{decode_port}", "--host", HOST, "--port", str(port),
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
            "--policy", "round_robin", "--worker-startup-check-interval", "1",
            "--worker-startup-timeout-secs", "30", "--health-check-interval-secs", "5"]
