"""`report` owns what it starts (issue 29): Ctrl-C, SIGTERM or SIGHUP while a variant's trio starts or
while the bench runs through it stops that trio before the report exits, and the report says so.

Real processes throughout: the report (rehearsal: real sglang-router, stand-in engines) in its own
session, signalled the way a terminal (Ctrl-C: the whole foreground group) or a scheduler (the pid)
does; the trio's processes are read from its run dir before the signal and looked for in /proc after
it, and every port of the trio must be free again."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import fakebox
import pytest

pytestmark = [pytest.mark.timeout(240)]


def _state(run: Path) -> dict:
    try:
        st = json.loads((run / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return st if isinstance(st, dict) else {}


def _generates(run: Path) -> int:
    try:
        text = (run / "decode-0.log").read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for r in fakebox.json_records(text) if r.get("path") == "/generate")


def _live(pgids: set[int]) -> list[str]:
    """Every process (not a zombie) in one of `pgids`."""
    out = []
    for e in Path("/proc").iterdir():
        if not e.name.isdigit():
            continue
        try:
            raw = (e / "stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rfind(")") + 2:].split()
        if int(rest[2]) in pgids and rest[0] not in ("Z", "X"):
            out.append(f"{e.name} ({raw[raw.find('(') + 1:raw.rfind(')')]})")
    return out


def _mentioning(text: str) -> list[str]:
    """Processes whose command line or environment names `text` (the report dir)."""
    out = []
    for e in Path("/proc").iterdir():
        if not e.name.isdigit() or int(e.name) == os.getpid():
            continue
        try:
            blob = (e / "cmdline").read_bytes() + (e / "environ").read_bytes()
            state = (e / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in blob and state not in ("Z", "X"):
            out.append(f"{e.name}: {(e / 'cmdline').read_bytes()[:120]!r}")
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "starting"), (signal.SIGTERM, "benching"),
                                       (signal.SIGHUP, "starting"), (signal.SIGINT, "benching")])
def test_a_stop_signal_stops_the_trio_the_report_started(tmp_path, sig, when):
    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_GRACE": "5",
                # a slow load keeps the trio starting long enough to be caught there
                "V4FLASH_REHEARSAL_LOAD_SECONDS": "4" if when == "starting" else "0.2"})
    out = tmp_path / "rep"
    run = out / "e2e" / "on" / "run"
    argv = [sys.executable, "-m", "v4flash_pd", "report", "--rehearse", "--config", str(cfg), "--topology",
            str(fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)), "--out", str(out), "--skip", "step,selfcheck",
            "--variants", "on", "--concurrency", "1", "--requests", "400", "--output-len", "64", "--eval-questions", "2"]
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        p = subprocess.Popen(argv, stdout=so, stderr=se, env=env, cwd=tmp_path, start_new_session=True)
    pgids: set[int] = set()
    try:
        if when == "starting":
            st = fakebox.wait_for(lambda: (s := _state(run)).get("status") == "starting" and len(s.get("pids") or {}) >= 2
                                  and s, 60, "the trio's workers to start")
        else:
            st = fakebox.wait_for(lambda: (s := _state(run)).get("status") == "ready" and s, 60, "the trio to be READY")
            # the smoke request, the warm-up, then the bench's own
            fakebox.wait_for(lambda: _generates(run) >= 6, 30, "the bench's requests to reach decode")
        assert p.poll() is None
        pgids = {int(pid) for pid in (st.get("pids") or {}).values()} | {int(st["launcher_pid"])}
        assert _live(pgids), "the trio runs before the signal"
        if sig == signal.SIGINT:
            os.killpg(p.pid, sig)  # Ctrl-C at a terminal: the whole foreground group
        else:
            os.kill(p.pid, sig)  # a scheduler or `kill`: the report alone
        rc = p.wait(timeout=120)
        stderr = (tmp_path / "stderr").read_text()
        assert rc == 128 + sig, (rc, stderr[-3000:])
        assert f"error: the report was interrupted by {signal.Signals(sig).name}" in stderr and "\n  fix: " in stderr
        assert "stopped the trio it had started (on); nothing of it is left running" in stderr, stderr
        assert "Traceback" not in stderr and "please send us" not in (tmp_path / "stdout").read_text()
        # nothing of the trio is left: its process groups, anything pointing at the report dir, its ports
        assert _live(pgids) == []
        assert _mentioning(str(out)) == []
        assert [pt for pt in ports if not _port_free(pt)] == []
        assert json.loads((out / "report.json").read_text())["interrupted"] == signal.Signals(sig).name
        assert not (tmp_path / "rep.tar.gz").exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        last = _state(run)
        pgids |= {int(pid) for pid in (last.get("pids") or {}).values()}
        for g in pgids:  # what a failing report left behind, stopped by the pids its run dir recorded
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
