"""The all-reduce patch against the real pinned sglang 0.5.13.post1 wheel, each scenario in fresh interpreters.

The consumer scenario builds SGLang's own `GroupCoordinator` (a TP group with its custom all-reduce
allowed) in two CPU processes over gloo and calls its in-place all-reduce, the method the hook
replaces: ours must be entered, see that a CPU group is not ours to take (the IPC kernels need
CUDA peers) and hand the call to upstream's method, which sums over both processes. With the
switch off only upstream runs. Same inputs, same sums, both ways.
"""

from __future__ import annotations

TARGET = "sglang.srt.distributed.parallel_state"
UPSTREAM = f"{TARGET}.GroupCoordinator._all_reduce_in_place"
OURS = "v4flash_kernels.allreduce.op.group_all_reduce_in_place"

IDENTITY = """
import importlib, json, os
mod = importlib.import_module("sglang.srt.distributed.parallel_state")
fn = mod.GroupCoordinator._all_reduce_in_place
from v4flash_kernels.hook import hook
from v4flash_kernels.allreduce import op
print("PROBE-JSON " + json.dumps({
    "fn": f"{fn.__module__}.{fn.__qualname__}", "is_ours": fn is op.group_all_reduce_in_place,
    "kept": getattr(mod, hook.upstream_keep_attr(hook.by_name("allreduce")), None) is not None,
    "status": hook.patch_status("allreduce"),
}, default=str))
"""

CONSUMER = """
import json, os, socket, subprocess, sys
if "RANK" not in os.environ:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = os.environ["PROBE_SRC"]
    procs = [subprocess.Popen([sys.executable, "-c", src], env=dict(os.environ, RANK=str(r), PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    res = []
    for (o, e), p in zip(outs, procs):
        sys.stderr.write(e)
        line = [ln for ln in o.splitlines() if ln.startswith("RANK-JSON ")]
        res.append(json.loads(line[-1][len("RANK-JSON "):]) if line and p.returncode == 0 else {"rc": p.returncode})
    print("PROBE-JSON " + json.dumps(res))
    sys.exit(0)
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=2)
from sglang.srt.distributed import parallel_state as ps
g = ps.GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=False, use_pymscclpp=False, use_custom_allreduce=True,
                        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False,
                        use_npu_communicator=False, group_name="tp")
who = {("v4flash_kernels/allreduce/op.py", "group_all_reduce_in_place"): "ours",
       ("distributed/parallel_state.py", "_all_reduce_in_place"): "upstream"}
entered = []
def prof(frame, event, arg):
    if event == "call":
        for (suffix, name), w in who.items():
            if frame.f_code.co_name == name and frame.f_code.co_filename.replace(os.sep, "/").endswith(suffix):
                entered.append(w)
t = torch.arange(6, dtype=torch.float32) * (rank + 1)
sys.setprofile(prof)
try:
    ret = g._all_reduce_in_place(t)
finally:
    sys.setprofile(None)
from v4flash_kernels.hook import hook
print("RANK-JSON " + json.dumps({"rank": rank, "entered": entered, "ret": repr(ret), "out": t.tolist(),
                                 "ours_state": repr(g.__dict__.get("_v4flash_allreduce", "unset")),
                                 "status": hook.patch_status("allreduce")}, default=str))
dist.destroy_process_group()
"""


def _probe(hook_env, code: str, env: dict, timeout: int = 400):
    r = hook_env.probe_code(code, env={"PROBE_SRC": code, **env}, timeout=timeout)
    return r, r.result, [ln for ln in r.hook_lines if "all-reduce" in ln]


def test_import_swaps_the_in_place_all_reduce(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={})
    assert p.rc == 0, p.stderr
    assert res["is_ours"] and res["fn"] == OURS and res["kept"], res
    assert res["status"]["active"] is True and res["status"]["switch_env"] == "V4FLASH_ALLREDUCE", res["status"]
    assert len(lines) == 1 and "ACTIVE" in lines[0] and UPSTREAM in lines[0] and OURS in lines[0], p.stderr


def test_switch_off_leaves_upstream(hook_env):
    p, res, lines = _probe(hook_env, IDENTITY, env={"V4FLASH_ALLREDUCE": "0"})
    assert p.rc == 0, p.stderr
    assert not res["is_ours"] and res["fn"] == UPSTREAM
    assert res["status"]["active"] is False and "V4FLASH_ALLREDUCE=0" in res["status"]["reason"]
    assert not any("WARNING" in ln for ln in lines), lines


def test_sglang_group_all_reduce_through_ours_reaches_upstream_and_sums(hook_env):
    want = [3.0 * i for i in range(6)]  # rank 0: i, rank 1: 2 i
    runs = {}
    for mode, extra in (("on", {}), ("off", {"V4FLASH_ALLREDUCE": "0"})):
        p, res, _ = _probe(hook_env, CONSUMER, env=extra)
        assert p.rc == 0 and res and all("rc" not in r for r in res), p.stderr[-4000:]
        runs[mode] = res
    for r in runs["on"]:
        assert r["entered"] == ["ours", "upstream"], r  # ours decides, upstream's method does the CPU/gloo call
        assert r["ret"] == "None" and r["out"] == want and r["status"]["active"] is True
        assert r["ours_state"] == "None"  # a CPU group is never ours: no communicator was set up
    for r in runs["off"]:
        assert r["entered"] == ["upstream"] and r["out"] == want and r["status"]["active"] is False
        assert r["ours_state"] == "'unset'"
