"""Start the rehearsal stand-in engine (non-PD) on a free 127.0.0.1 port, bounded waits only."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

from v4flash_pd import topology as topo
from v4flash_pd.config.load import load_config
from v4flash_pd.host import Host
from v4flash_pd.plan import build_plan
from v4flash_pd.ports import free_port


@contextlib.contextmanager
def engine(sets: tuple[str, ...] = (), **knobs: str) -> Iterator[str]:
    """`sets`: more config overrides (e.g. speculative.num_steps=3; speculation is off unless they turn it
    on); `knobs`: V4FLASH_REHEARSAL_<KNOB>."""
    port, nccl = free_port(), free_port()
    # the aggregated profile's one server, rehearsed: argv and env from the product's plan builder
    cfg = load_config(profile="rtx6000-tp4", env={}, sets=(
        f"python={sys.executable}", "numa=off", 'server.0.host="127.0.0.1"', f"server.0.port={port}",
        f"server.0.nccl_port={nccl}", "model.path=/models/none",
        # the profile speculates by default (2 draft steps); these tests choose it: off unless `sets` say
        "speculative.num_steps=0", *sets))
    spec = build_plan(cfg, Host.remote(topo.Topology(gpus=(), nodes=())), rehearse=True).get("server-0")
    env = dict(os.environ, V4FLASH_REHEARSAL_LOAD_SECONDS="0")
    for k in [k for k in env if k.startswith("V4FLASH_REHEARSAL_") and k != "V4FLASH_REHEARSAL_LOAD_SECONDS"]:
        env.pop(k)
    env.update(dict(spec.env))
    env.update({f"V4FLASH_REHEARSAL_{k.upper()}": v for k, v in knobs.items()})
    proc = subprocess.Popen(list(spec.argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("engine did not become healthy in 30 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
