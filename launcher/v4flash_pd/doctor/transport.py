"""KV transport (NIXL over UCX) and GPU peer access between the prefill and decode groups.

RTX PRO 6000 has no NVLink and the two groups sit on different sockets, so which UCX transports
exist decides whether KV moves GPU->GPU (cuda_ipc) or is staged through host memory (cuda_copy);
without cuda_copy UCX misdetects VRAM and the prefill engine segfaults, and
without NIXL's bundled CUDA modules VRAM registration fails.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn

NIXL_PKG = "nixl_cu13"
NEEDED_TLS = ("cuda_copy",)
WANTED_TLS = ("cuda_ipc",)

_AGENT_SCRIPT = f"""
import json
from {NIXL_PKG} import nixl_agent, nixl_agent_config
a = nixl_agent("v4flash-doctor", nixl_agent_config(enable_prog_thread=False, backends=[]))
plugins = list(a.get_plugin_list())
mem = list(a.get_plugin_mem_types("UCX")) if "UCX" in plugins else []
print(json.dumps({{"plugins": plugins, "ucx_mem": mem}}))
"""

_PEER_SCRIPT = """
import json, sys
import torch
pairs = json.loads(sys.argv[1])
if not torch.cuda.is_available():
    print(json.dumps({"cuda": False})); sys.exit(0)
n = torch.cuda.device_count()
out = [[a, b, bool(torch.cuda.can_device_access_peer(a, b))] for a, b in pairs if a < n and b < n]
print(json.dumps({"cuda": True, "count": n, "pairs": out}))
"""


def parse_ucx_transports(text: str) -> tuple[str, ...]:
    """Transport names from `ucx_info -d` ('#      Transport: cuda_copy')."""
    return tuple(dict.fromkeys(re.findall(r"Transport:\s*([A-Za-z0-9_]+)", text)))


def _libs_dir(inp: DoctorInput) -> Path | None:
    for d in inp.probe.module_dirs(NIXL_PKG):
        cand = Path(d).parent / f"{NIXL_PKG}.libs"
        if cand.is_dir():
            return cand
    return None


def _ucx_module_dir(inp: DoctorInput) -> str:
    env = {**inp.probe.env, **inp.expect.worker_env}
    return env.get("UCX_MODULE_DIR", "")


def check_nixl(inp: DoctorInput) -> Check:
    p = inp.probe
    if not p.has_module(NIXL_PKG):
        return error("nixl", f"{NIXL_PKG} is not installed, but the transfer backend is nixl",
                     "pip install --no-deps nixl-cu13==1.5.1 (the `nixl` meta-package cannot resolve; "
                     "the image has it), or set engine.transfer_backend")
    r = p.run([sys.executable, "-c", _AGENT_SCRIPT], 60.0, dict(inp.expect.worker_env))
    lines = [ln for ln in r.out.splitlines() if ln.startswith("{")]
    if r.rc != 0 or not lines:
        last = r.text.splitlines()[-1] if r.text else f"exit {r.rc}"
        return error("nixl", f"cannot create a NIXL agent: {last}",
                     "reinstall nixl-cu13==1.5.1; make sure only one UCX is on LD_LIBRARY_PATH "
                     "(two UCX copies in one process give NIXL_ERR_BACKEND, dynamo#12558)")
    info = json.loads(lines[-1])
    if "UCX" not in info["plugins"]:
        return error("nixl", f"NIXL loads, but has no UCX plugin (plugins: {', '.join(info['plugins']) or 'none'})",
                     "reinstall nixl-cu13 (its libplugin_UCX.so is missing or fails to load); unset "
                     "NIXL_PLUGIN_DIR if it points elsewhere")
    if "VRAM_SEG" not in info["ucx_mem"]:
        return error("nixl", f"the UCX plugin cannot register GPU memory (mem types {info['ucx_mem']})",
                     "set UCX_MODULE_DIR to nixl_cu13.libs/ucx (nixl#1628); the default profile does")
    return ok("nixl", f"NIXL agent with the UCX plugin (mem types {', '.join(info['ucx_mem'])})")


def check_ucx(inp: DoctorInput) -> Check:
    p = inp.probe
    env = {**p.env, **inp.expect.worker_env}
    tls = [t.strip() for t in env.get("UCX_TLS", "").split(",") if t.strip()]
    moddir = _ucx_module_dir(inp)
    if moddir and not Path(moddir).is_dir():
        return error("ucx-transports", f"UCX_MODULE_DIR={moddir} does not exist",
                     "point UCX_MODULE_DIR at <site-packages>/nixl_cu13.libs/ucx (or leave the profile's 'auto')")
    source = ""
    found: tuple[str, ...] = ()
    ucx_info = p.which("ucx_info")
    if ucx_info:
        r = p.run([ucx_info, "-d"], 60.0, dict(inp.expect.worker_env))
        found = parse_ucx_transports(r.out) if r.rc == 0 else ()
        source = "`ucx_info -d`" if r.rc == 0 else ""
    if not source:
        libs = _libs_dir(inp)
        cand = Path(moddir) if moddir else (libs / "ucx" if libs else None)
        if cand is None or not cand.is_dir():
            return skip("ucx-transports", "no ucx_info on PATH and no NIXL-bundled UCX module dir to inspect")
        mods = {m.name.split(".so")[0] for m in cand.glob("libuct_*.so*")}
        if "libuct_cuda" in mods:
            found = ("cuda_copy", "cuda_ipc")  # both live in libuct_cuda
        found += tuple(sorted(m.removeprefix("libuct_") for m in mods if m != "libuct_cuda"))
        source = f"modules in {cand}"
    missing_need = [t for t in NEEDED_TLS if t not in found]
    missing_want = [t for t in WANTED_TLS if t not in found]
    detail = f"{', '.join(found) or 'none'} ({source})"
    if missing_need:
        return error("ucx-transports", f"no {', '.join(missing_need)} transport: {detail}",
                     "UCX must load its CUDA module: set UCX_MODULE_DIR to nixl_cu13.libs/ucx; without "
                     "cuda_copy UCX treats VRAM as host memory and the prefill engine crashes")
    if tls and not all(t in tls for t in NEEDED_TLS):
        return error("ucx-transports", f"UCX_TLS={','.join(tls)} excludes cuda_copy",
                     "set UCX_TLS=cuda_copy,cuda_ipc,sm,tcp,self (the default profile's value)")
    if not tls:
        return warn("ucx-transports", f"UCX_TLS is not set for the workers; available: {detail}",
                    "set UCX_TLS=cuda_copy,cuda_ipc,sm,tcp,self so UCX does not pick tcp for VRAM")
    if missing_want:
        return warn("ucx-transports", f"no cuda_ipc: KV goes GPU->host->GPU ({detail})",
                    "expected without a CUDA UCX module; check UCX_MODULE_DIR (nixl#1628)")
    return ok("ucx-transports", f"UCX_TLS={','.join(tls)}; available {detail}")


def check_peer(inp: DoctorInput) -> Check:
    e, p = inp.expect, inp.probe
    pre = [g for w in e.workers if w.role == "prefill" for g in w.gpus]
    dec = [g for w in e.workers if w.role == "decode" for g in w.gpus]
    if not pre or not dec:
        return skip("gpu-peer", "no prefill/decode split in this plan")
    if not p.has_module("torch"):
        return skip("gpu-peer", "torch is not installed here")
    pairs = [[a, b] for a in pre for b in dec]
    r = p.run([sys.executable, "-c", _PEER_SCRIPT, json.dumps(pairs)], 120.0)
    lines = [ln for ln in r.out.splitlines() if ln.startswith("{")]
    if r.rc != 0 or not lines:
        last = r.text.splitlines()[-1] if r.text else f"exit {r.rc}"
        return skip("gpu-peer", f"torch could not query CUDA: {last}")
    info = json.loads(lines[-1])
    if not info.get("cuda"):
        return skip("gpu-peer", "torch sees no CUDA device")
    checked = info["pairs"]
    if len(checked) < len(pairs):
        return skip("gpu-peer", f"only {info['count']} CUDA device(s) visible; the plan uses GPUs up to {max(pre + dec)}")
    no = [(a, b) for a, b, okp in checked if not okp]
    if no:
        sample = ", ".join(f"{a}->{b}" for a, b in no[:4]) + (" ..." if len(no) > 4 else "")
        return warn("gpu-peer", f"no P2P for {len(no)}/{len(checked)} prefill->decode pairs ({sample}): "
                                "cuda_ipc is unavailable, KV is staged through host memory",
                    "expected across sockets on some boards; check `nvidia-smi topo -p2p r`, ACS/IOMMU "
                    "settings in the BIOS, and measure with `v4flash-pd bench`")
    return ok("gpu-peer", f"P2P possible for all {len(checked)} prefill->decode GPU pairs")


def run(inp: DoctorInput) -> list[Check]:
    if inp.expect.transfer_backend != "nixl":
        why = f"transfer backend is {inp.expect.transfer_backend or 'none (aggregated mode)'}"
        return [skip("nixl", why), skip("ucx-transports", why), check_peer(inp)]
    return [check_nixl(inp), check_ucx(inp), check_peer(inp)]
