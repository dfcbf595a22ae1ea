"""A run dir that fills up (ENOSPC) or turns read-only (EROFS, as ext4 does with errors=remount-ro)
while the trio runs: stopping must still stop everything. Real filesystems, made in a private mount
namespace of the launcher (`unshare -m`), so nothing on this machine outside the test changes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import fakebox
import pytest
from fakebox import group_alive

pytestmark = pytest.mark.timeout(180)

PY = sys.executable


def _can_unshare() -> bool:
    if not shutil.which("unshare") or not shutil.which("nsenter"):
        return False
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True, timeout=30)
    return r.returncode == 0


needs_mount_ns = pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m and mount (root or CAP_SYS_ADMIN)")



class NsUp:
    """`v4flash-pd up --rehearse` in its own mount namespace, `setup` run there first."""

    def __init__(self, tmp: Path, run: Path, setup: str) -> None:
        self.tmp = tmp
        ports = fakebox.free_ports(7)
        cfg = fakebox.write_pd_config(tmp, ports)
        topo = fakebox.write_topology(tmp, fakebox.BOX_8GPU_2NODE)
        env = fakebox.clean_env()
        env.update({"V4FLASH_RUNS_ROOT": str(tmp / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.5",
                    "V4FLASH_GRACE": "5"})
        argv = " ".join(f"'{a}'" for a in [PY, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(cfg),
                                          "--topology", str(topo), "--run-dir", str(run)])
        self.out = tmp / "up.out"
        with open(self.out, "w") as f:
            self.p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                       f"set -e; {setup}; exec {argv}"],
                                      env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.run = run

    def text(self) -> str:
        return self.out.read_text()

    def in_ns(self, script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", "-t", str(self.p.pid), "-m", "sh", "-c", script],
                              capture_output=True, text=True, timeout=60)

    def state(self) -> dict:
        # the launcher's view of its run dir (a tmpfs exists only inside its namespace)
        return json.loads(Path(f"/proc/{self.p.pid}/root{self.run}/state.json").read_text())

    def kill_all(self, pids: dict[str, int]) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
        for pid in pids.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@needs_mount_ns
@pytest.mark.parametrize("how", ["disk-full", "read-only"])
def test_stop_with_a_full_or_read_only_run_dir_leaves_nothing_behind(tmp_path: Path, how: str) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = mnt / "run"
    setup = f"mount -t tmpfs -o size=4m tmpfs '{mnt}'" if how == "disk-full" else "true"
    up = NsUp(tmp_path, run, setup)
    pids: dict[str, int] = {}
    try:
        fakebox.wait_for(lambda: "READY" in up.text() or up.p.poll() is not None, 60, "READY")
        assert "READY" in up.text(), up.text()
        pids = {k: int(v) for k, v in up.state()["pids"].items()}
        if how == "disk-full":
            r = up.in_ns(f"dd if=/dev/zero of='{mnt}/fill' bs=64k 2>&1; df -k '{mnt}'")
            assert "No space left" in r.stdout, r.stdout + r.stderr
        else:
            r = up.in_ns(f"mount --bind '{run}' '{run}' && mount -o remount,ro,bind '{run}' && "
                         f"! touch '{run}/probe' 2>/dev/null")
            assert r.returncode == 0, r.stdout + r.stderr
        up.p.send_signal(signal.SIGTERM)
        rc = up.p.wait(60)
        out = up.text()
        for name, pid in pids.items():
            fakebox.wait_for(lambda pid=pid: not group_alive(pid), 10, f"{name} (pgid {pid}) to go:\n{out}")
        assert rc == 0, out
        assert "stopped cleanly" in out and "Traceback" not in out, out
        assert "cannot write the run dir" in out, out
    finally:
        up.kill_all(pids)


@needs_mount_ns
def test_up_on_a_run_dir_that_is_full_before_the_first_process_refuses_cleanly(tmp_path: Path) -> None:
    """ENOSPC in the run dir before anything started (the disk had room for the lock and nothing more): one
    error + fix paragraph, non-zero exit, no traceback, and no process started."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = mnt / "run"
    # fill the tmpfs, then free exactly one page: the lock (taken first, with its pid) takes it back
    setup = (f"mount -t tmpfs -o size=1m tmpfs '{mnt}'; dd if=/dev/zero of='{mnt}/pad' bs=4096 count=1 2>/dev/null; "
             f"dd if=/dev/zero of='{mnt}/fill' bs=4096 2>/dev/null || true; rm '{mnt}/pad'")
    up = NsUp(tmp_path, run, setup)
    try:
        rc = up.p.wait(60)
        out = up.text()
        assert rc == 2, out
        assert "Traceback" not in out, out
        assert re.search(r"^error: cannot write .*No space left on device.*\n  fix: free space", out, re.M), out
        assert "started prefill" not in out and "READY" not in out, out
    finally:
        up.kill_all({})


@needs_mount_ns
def test_a_run_dir_that_fills_after_ready_is_reported_not_hidden(tmp_path: Path) -> None:
    """Past READY the launcher kept saying `ready` while every log line and state write was lost: it
    must say so on its output, and `status` must show it (state.json itself cannot be written)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = mnt / "run"
    up = NsUp(tmp_path, run, f"mount -t tmpfs -o size=4m tmpfs '{mnt}'")
    pids: dict[str, int] = {}
    try:
        fakebox.wait_for(lambda: "READY" in up.text() or up.p.poll() is not None, 60, "READY")
        assert "READY" in up.text(), up.text()
        pids = {k: int(v) for k, v in up.state()["pids"].items()}
        r = up.in_ns(f"dd if=/dev/zero of='{mnt}/fill' bs=64k 2>&1")
        assert "No space left" in r.stdout, r.stdout + r.stderr
        fakebox.wait_for(lambda: "run dir is full" in up.text() or up.p.poll() is not None, 30, "the full-disk warning")
        assert up.p.poll() is None, up.text()  # still serving: a full disk does not stop the run
        st = up.in_ns(f"{PY} -m v4flash_pd status --run-dir '{run}'")
        assert st.returncode == 0 and "Traceback" not in st.stderr, st.stdout + st.stderr
        assert re.search(r"^status +ready \(DEGRADED: run dir is full", st.stdout, re.M), st.stdout
        # space again: the warning is taken back
        up.in_ns(f"rm '{mnt}/fill'")
        fakebox.wait_for(lambda: "run dir has space again" in up.text(), 30, "the all-clear")
        st = up.in_ns(f"{PY} -m v4flash_pd status --run-dir '{run}'")
        assert re.search(r"^status +ready$", st.stdout, re.M), st.stdout
        up.p.send_signal(signal.SIGTERM)
        assert up.p.wait(60) == 0, up.text()
        for name, pid in pids.items():
            fakebox.wait_for(lambda pid=pid: not group_alive(pid), 10, f"{name} (pgid {pid}) to go")
    finally:
        up.kill_all(pids)
