"""Launcher overhead benchmark (not a test): `plan` latency, `up --rehearse` time to READY beyond the
stand-ins' configured load time (split into where it goes), SIGTERM-to-everything-stopped, and how
long after a worker stops answering (SIGSTOP) the watchdog declares it hung. Prints a table and,
with --json, writes the raw numbers.

    .venv/bin/python tools/bench_launcher.py [--runs 5] [--load 2.0] [--grace 5] [--hang-window 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fakebox

PY = sys.executable


def _cli(*args: str) -> list[str]:
    return [PY, "-m", "v4flash_pd", *args]


def time_plan(runs: int, topo: Path) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(_cli("plan", "--topology", str(topo)), check=True, capture_output=True, timeout=60)
        out.append(time.perf_counter() - t0)
    return out


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


def _wait_ready(p: subprocess.Popen, out: Path, t0: float) -> float:
    while time.perf_counter() - t0 < 90 and p.poll() is None:
        if "READY" in out.read_text():
            return time.perf_counter() - t0
        time.sleep(0.005)
    p.kill()
    raise SystemExit(f"no READY:\n{out.read_text()}")


def run_up(tmp: Path, topo: Path, load: float, grace: float, hang_window: float, hang: bool) -> dict:
    """One `up --rehearse`: READY, then SIGTERM (or, hang=True, SIGSTOP decode and wait for the watchdog)."""
    cfg = fakebox.write_pd_config(tmp, fakebox.free_ports(7))
    env = fakebox.clean_env()
    env.update(V4FLASH_RUNS_ROOT=str(tmp / "runs"), V4FLASH_REHEARSAL_LOAD_SECONDS=str(load),
               V4FLASH_GRACE=str(grace))
    out = tmp / "up.out"
    res: dict = {}
    with open(out, "w") as f:
        t0 = time.perf_counter()
        wall0 = time.time()
        p = subprocess.Popen(_cli("up", "--rehearse", "--config", str(cfg), "--topology", str(topo),
                                  "--set", f"hang_timeout={hang_window}"),
                             env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            res["ready"] = _wait_ready(p, out, t0)
            run = (tmp / "runs" / "latest").resolve()
            pids = {k: int(v) for k, v in json.loads((run / "state.json").read_text())["pids"].items()}
            ev = _events(run)
            at = {(e["event"], e.get("name")): e["t"] for e in ev}
            start = at[("start", "prefill-0")]
            healthy = max(at[("healthy", "prefill-0")], at[("healthy", "decode-0")])
            res["workers_healthy_beyond_load"] = healthy - start - load
            res["launcher_to_workers_spawned"] = start - wall0
            res["healthy_to_router_start"] = at[("start", "router")] - healthy
            res["router_start_to_router_ready"] = at[("router_ready", None)] - at[("start", "router")]
            res["router_ready_to_smoke"] = at[("smoke", None)] - at[("router_ready", None)]
            res["smoke_to_ready_line"] = wall0 + res["ready"] - at[("smoke", None)]
            if hang:
                t_stop = time.time()
                os.killpg(pids["decode-0"], signal.SIGSTOP)
                rc = p.wait(60)
                hung = [e for e in _events(run) if e["event"] == "hung"]
                if rc != 1 or not hung:
                    raise SystemExit(f"hang not detected (rc {rc}):\n{out.read_text()}")
                res["hang_detected_after"] = hung[0]["t"] - t_stop
                res["hang_to_all_stopped"] = time.time() - t_stop
            else:
                t1 = time.perf_counter()
                p.send_signal(signal.SIGTERM)
                rc = p.wait(60)
                while not all(not fakebox.group_alive(g) for g in pids.values()) and time.perf_counter() - t1 < 30:
                    time.sleep(0.005)
                res["sigterm_to_all_stopped"] = time.perf_counter() - t1
                if rc != 0:
                    raise SystemExit(f"up exited {rc}:\n{out.read_text()}")
            if not all(not fakebox.group_alive(g) for g in pids.values()):
                raise SystemExit(f"processes left behind: {pids}")
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    res["ready_beyond_load"] = res["ready"] - load
    return res


def _row(name: str, xs: list[float], target: str) -> str:
    return f"{name:<48} {statistics.median(xs):8.3f} {max(xs):8.3f} {target:>14}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--grace", type=float, default=5.0)
    ap.add_argument("--hang-window", type=float, default=2.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        topo = fakebox.write_topology(tmp, fakebox.BOX_8GPU_2NODE)
        plan = time_plan(a.runs * 4, topo)
        ups, hangs = [], []
        for i in range(a.runs):
            for hang, acc in ((False, ups), (True, hangs)):
                sub = tmp / f"r{i}-{'hang' if hang else 'term'}"
                sub.mkdir()
                acc.append(run_up(sub, topo, a.load, a.grace, a.hang_window, hang))
    col = lambda rows, k: [r[k] for r in rows]  # noqa: E731
    lines = [f"{'metric (seconds)':<48} {'median':>8} {'max':>8} {'target':>14}",
             _row("plan", plan, "<= 0.100"),
             _row("up --rehearse READY beyond the engines' load", col(ups + hangs, "ready_beyond_load"), "<= 1.0"),
             _row("  launcher start -> workers spawned (CLI, plan)", col(ups + hangs, "launcher_to_workers_spawned"), ""),
             _row("  workers healthy beyond load (spawn, import)", col(ups + hangs, "workers_healthy_beyond_load"), ""),
             _row("  last healthy -> router spawned", col(ups + hangs, "healthy_to_router_start"), ""),
             _row("  router spawned -> router sees both (its start)", col(ups + hangs, "router_start_to_router_ready"), ""),
             _row("  router ready -> smoke generate answered", col(ups + hangs, "router_ready_to_smoke"), ""),
             _row("  smoke answered -> READY printed", col(ups + hangs, "smoke_to_ready_line"), ""),
             _row("SIGTERM -> all process groups gone", col(ups, "sigterm_to_all_stopped"), "<= 1.0"),
             _row(f"SIGSTOP decode -> declared hung (window {a.hang_window:g})", col(hangs, "hang_detected_after"),
                  f"<= {a.hang_window + 1:g}"),
             _row("SIGSTOP decode -> all process groups gone", col(hangs, "hang_to_all_stopped"), "")]
    print("\n".join(lines))
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "plan": plan, "up": ups,
                                      "hang": hangs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
