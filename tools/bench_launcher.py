"""Launcher overhead benchmark (not a test): `plan` latency, `up --rehearse` time to READY beyond the
stand-ins' configured load time, and SIGTERM-to-exit time. Prints a table; numbers go in the notes.

    .venv/bin/python tools/bench_launcher.py [--runs 5] [--load 2.0] [--grace 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fakebox  # noqa: E402

BIN = str(Path(sys.executable).parent / "v4flash-pd")


def time_plan(runs: int, topo: Path) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([BIN, "plan", "--topology", str(topo)], check=True, capture_output=True, timeout=60)
        out.append(time.perf_counter() - t0)
    return out


def time_up(tmp: Path, topo: Path, load: float, grace: float) -> tuple[float, float]:
    cfg = fakebox.write_pd_config(tmp, fakebox.free_ports(7))
    env = dict(os.environ, V4FLASH_RUNS_ROOT=str(tmp / "runs"), V4FLASH_REHEARSAL_LOAD_SECONDS=str(load),
               V4FLASH_GRACE=str(grace))
    out = tmp / "up.out"
    with open(out, "w") as f:
        t0 = time.perf_counter()
        p = subprocess.Popen([BIN, "up", "--rehearse", "--config", str(cfg), "--topology", str(topo)],
                             env=env, stdout=f, stderr=subprocess.STDOUT)
        ready = None
        while time.perf_counter() - t0 < 60 and p.poll() is None:
            if "READY" in out.read_text():
                ready = time.perf_counter() - t0
                break
            time.sleep(0.01)
        if ready is None:
            p.kill()
            raise SystemExit(f"no READY:\n{out.read_text()}")
        t1 = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
        stop = time.perf_counter() - t1
    if rc != 0:
        raise SystemExit(f"up exited {rc}:\n{out.read_text()}")
    return ready, stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--grace", type=float, default=5.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        topo = fakebox.write_topology(tmp, fakebox.BOX_8GPU_2NODE)
        plan = time_plan(a.runs * 4, topo)
        ups = []
        for i in range(a.runs):
            sub = tmp / f"r{i}"
            sub.mkdir()
            ups.append(time_up(sub, topo, a.load, a.grace))
    ready_extra = [r - a.load for r, _ in ups]
    stops = [s for _, s in ups]
    print(f"{'metric':<44} {'median':>8} {'max':>8} {'target':>12}")
    print(f"{'plan (s)':<44} {statistics.median(plan):8.3f} {max(plan):8.3f} {'< 0.300':>12}")
    print(f"{'up --rehearse READY beyond load time (s)':<44} {statistics.median(ready_extra):8.2f} {max(ready_extra):8.2f} {'< 5':>12}")
    print(f"{'SIGTERM -> exit, all stopped (s)':<44} {statistics.median(stops):8.2f} {max(stops):8.2f} {'< grace+2 = ' + str(a.grace + 2):>12}")


if __name__ == "__main__":
    main()
