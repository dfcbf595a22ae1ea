"""A cluster's router part (`up --role router`) after READY: the workers it routes to run on other
boxes, and one that dies or hangs must fail the router's run as a local worker fails a one-box run
(issue 23: it stayed `ready` while a remote worker was dead or hung). Two logical boxes on 127.0.0.1
(port offset), real `up --box K` processes with stand-in engines, the real sglang-router."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fakebox
import pytest

pytestmark = pytest.mark.timeout(180)

PY = sys.executable
HANG = 2.0



class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = fakebox.box_env(tmp, fakebox.BOX_8GPU_2NODE, membind_ok=True)
        self.env.update({"V4FLASH_RUNS_ROOT": str(tmp / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.3",
                         "V4FLASH_GRACE": "3", "V4FLASH_PROGRESS_INTERVAL": "1"})
        http, boot, nccl, router, metrics = fakebox.free_ports(5)
        out = tmp / "plan" / "job.sbatch"
        res = subprocess.run([PY, "-m", "v4flash_pd", "render", "slurm", "--boxes", "2", "--prefill", "1", "--decode",
                              "1", "--port-offset", "7", "--rehearse", "-o", str(out),
                              "--set", f"cluster.http_port={http}", "--set", f"cluster.bootstrap_port={boot}",
                              "--set", f"cluster.nccl_port={nccl}", "--set", "cluster.bind_host=127.0.0.1",
                              "--set", f"router.port={router}", "--set", f"router.metrics_port={metrics}",
                              "--set", "router.host=127.0.0.1", "--set", f"hang_timeout={HANG}"],
                             capture_output=True, text=True, env=self.env, timeout=60)
        assert res.returncode == 0, res.stderr
        self.plan = out.parent / "cluster-plan.json"
        self.procs: dict[str, subprocess.Popen] = {}

    def up(self, part: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{part}.out", "w")
        p = subprocess.Popen([PY, "-m", "v4flash_pd", "up", "--cluster-plan", str(self.plan), "--rehearse",
                              "--run-dir", str(self.tmp / "runs" / part), *args], env=self.env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[part] = p
        return p

    def text(self, part: str) -> str:
        return (self.tmp / f"{part}.out").read_text()

    def pids(self, part: str) -> dict[str, int]:
        st = json.loads((self.tmp / "runs" / part / "state.json").read_text())
        return {k: int(v) for k, v in st.get("pids", {}).items()}

    def stop(self) -> None:
        for part, p in self.procs.items():
            groups = []
            try:
                groups = list(self.pids(part).values())
            except (OSError, ValueError):
                pass
            for pid in [p.pid, *groups]:
                try:
                    os.killpg(pid, signal.SIGCONT)
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            p.wait(10)


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


@pytest.mark.parametrize("fault", ["hung", "dead"])
def test_the_router_part_fails_when_a_worker_on_another_box_hangs_or_dies(cluster: Cluster, fault: str) -> None:
    box0, box1 = cluster.up("box0", "--box", "0"), cluster.up("box1", "--box", "1")
    router = cluster.up("router", "--role", "router", "--hosts", "127.0.0.1,127.0.0.1")
    for part, p in (("box0", box0), ("box1", box1), ("router", router)):
        fakebox.wait_for(lambda p=p, part=part: "READY" in cluster.text(part) or p.poll() is not None, 90, f"{part} READY")
        assert "READY" in cluster.text(part), cluster.text(part)
    decode = cluster.pids("box1")["decode-0"]
    if fault == "hung":
        os.killpg(decode, signal.SIGSTOP)
    else:
        box1.send_signal(signal.SIGTERM)  # box 1 stops its decode worker cleanly; the router is not told
        assert box1.wait(30) == 0, cluster.text("box1")
    t0 = time.monotonic()
    fakebox.wait_for(lambda: router.poll() is not None, HANG * 6 + 10, "the router part to notice")
    took = time.monotonic() - t0
    out = cluster.text("router")
    assert router.returncode == 1, out
    assert "decode-0 is not answering after READY" in out and "runs on another box" in out, out
    assert took < HANG * 3 + 5, f"noticed after {took:.1f}s (hang_timeout {HANG}s)"
    assert "Traceback" not in out
    # the router part stopped its own process (the router); box 0 keeps running until its own stop
    for pid in cluster.pids("router").values():
        fakebox.wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists()
              or Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z", 10, "router to exit")
