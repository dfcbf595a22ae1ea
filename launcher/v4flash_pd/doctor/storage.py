"""Free disk for the JIT/compile caches and the size of /dev/shm.

Triton/DeepGEMM/TileLang/FlashInfer caches grow to many GB on first start, and a full disk shows
up as a worker dying mid-compile. Docker's default 64 MB /dev/shm breaks
NCCL and SGLang's IPC between TP ranks.
"""

from __future__ import annotations

from pathlib import Path

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn

GIB = 2**30
CACHE_WARN_GIB = 20
CACHE_ERROR_GIB = 2
SHM_WARN_GIB = 16
SHM_ERROR_GIB = 1
CACHE_VARS = ("SGLANG_CACHE_DIR", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
              "TORCHINDUCTOR_CACHE_DIR", "HF_HOME")


def cache_dirs(env: dict[str, str]) -> list[tuple[str, str]]:
    """(variable, dir) pairs the workers will write to; ~/.cache when nothing is set."""
    out = [(v, env[v]) for v in CACHE_VARS if env.get(v)]
    if not out:
        base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or "~").expanduser() / ".cache")
        out.append(("XDG_CACHE_HOME" if env.get("XDG_CACHE_HOME") else "~/.cache", base))
    return out


def check_cache_disk(inp: DoctorInput) -> Check:
    env = {**inp.probe.env, **inp.expect.worker_env}
    worst: tuple[float, str, str] | None = None
    seen: dict[str, float] = {}
    for var, d in cache_dirs(env):
        res = inp.probe.disk_free(d)
        if res is None:
            continue
        where, free, _total = res
        seen[f"{var}={d}"] = free / GIB
        if worst is None or free / GIB < worst[0]:
            worst = (free / GIB, var, where)
    if worst is None:
        return skip("cache-disk", "no cache directory could be statted")
    free_gib, var, where = worst
    detail = ", ".join(f"{k}: {v:.1f} GiB free" for k, v in seen.items())
    fix = (f"free space on {where} or point {var} (and SGLANG_CACHE_DIR) at a volume with >= {CACHE_WARN_GIB} GiB; "
           "in the image mount the cache volume (-v v4flash-cache:/var/cache/v4flash)")
    if free_gib < CACHE_ERROR_GIB:
        return error("cache-disk", detail, fix)
    if free_gib < CACHE_WARN_GIB:
        return warn("cache-disk", detail, fix)
    return ok("cache-disk", detail)


def check_shm(inp: DoctorInput) -> Check:
    path = inp.probe.env.get("V4FLASH_SHM_PATH", "/dev/shm")
    res = inp.probe.disk_free(path)
    if res is None or res[0] != str(Path(path)):
        return error("shm", f"{path} does not exist",
                     "mount a tmpfs at /dev/shm (docker: --shm-size 32g or --ipc=host)")
    _where, free, total = res
    detail = f"{path}: {total / GIB:.1f} GiB ({free / GIB:.1f} GiB free)"
    fix = "run the container with --ipc=host or --shm-size 32g (NCCL and SGLang's TP IPC use /dev/shm)"
    if total < SHM_ERROR_GIB * GIB:
        return error("shm", detail + " (docker's default is 64 MiB)", fix)
    if total < SHM_WARN_GIB * GIB:
        return warn("shm", detail, fix)
    return ok("shm", detail)


def run(inp: DoctorInput) -> list[Check]:
    return [check_cache_disk(inp), check_shm(inp)]
