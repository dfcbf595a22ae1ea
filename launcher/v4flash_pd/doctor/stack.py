"""Installed versions vs the stack lock, and whether the sparse-MLA decode patch is in effect.

ABI drift between sglang-kernel, torch and flashinfer (field-notes 12-13) shows up as undefined
symbols deep inside a worker; comparing importlib.metadata against the lock finds it up front.
"""

from __future__ import annotations

import sys

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn
from v4flash_pd.errors import UserError

ANCHOR = "sglang"  # if this is absent, we are not running inside the serving environment
UPSTREAM_MODULE = "sglang.srt.layers.attention.flash_mla_sm120_triton"
UPSTREAM_FUNC = "flash_mla_sparse_decode_triton"


def compare(locked: dict[str, str], installed: dict[str, str | None]) -> tuple[list[str], list[str]]:
    """(drifted 'name installed!=locked' items, missing names); pure."""
    drift, missing = [], []
    for name, want in sorted(locked.items()):
        have = installed.get(name)
        if have is None:
            missing.append(name)
        elif have != want:
            drift.append(f"{name} {have} (lock {want})")
    return drift, missing


def check_versions(inp: DoctorInput) -> Check:
    from v4flash_pd import stacklock

    lock_env = inp.probe.env.get(stacklock.LOCK_ENV)
    try:
        lock = stacklock.load_lock(lock_env) if lock_env else stacklock.load_lock()
    except UserError as exc:
        return skip("stack-versions", f"no stack lock to compare with ({exc.message})")
    locked = {p.name: p.version for p in lock.packages if not p.marker}
    installed = {n: inp.probe.dist_version(n) for n in locked}
    drift, missing = compare(locked, installed)
    where = f"in {sys.executable}"
    in_stack = installed.get(ANCHOR) is not None or ANCHOR not in locked
    fix = (f"reinstall the pinned stack: pip install --require-hashes -r {lock.path} "
           "(or run inside the v4flash-pd image, which is built from it)")
    if drift and in_stack:
        more = f" (+{len(drift) - 6} more)" if len(drift) > 6 else ""
        return error("stack-versions", f"{len(drift)} package(s) differ from the lock {where}: "
                                       + "; ".join(drift[:6]) + more, fix)
    if missing and in_stack:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        return error("stack-versions", f"{len(missing)} locked package(s) not installed {where}: "
                                       + ", ".join(missing[:8]) + more, fix)
    if not in_stack:
        return warn("stack-versions", f"the serving stack ({ANCHOR}) is not installed {where}; "
                                      f"{len(missing)} of {len(locked)} locked packages missing, {len(drift)} differ",
                    "fine on a host that only plans; run `v4flash-pd doctor` inside the image (or the venv "
                    "made from stack.lock) before serving")
    return ok("stack-versions", f"{len(locked)} packages match {lock.path.name} (sha256 {lock.sha256[:12]})")


def _probe_patch_script() -> str:
    return (f"import importlib; m = importlib.import_module({UPSTREAM_MODULE!r}); "
            f"f = getattr(m, {UPSTREAM_FUNC!r}); print(getattr(f, '__module__', '?'))")


def _hook_note(st: object) -> str:
    """One short phrase from `v4flash_kernels.hook.status()` (a dict; anything else is shown as is)."""
    if st is None:
        return ""
    if isinstance(st, dict):
        bits = []
        if "hook_booted_by_pth" in st:
            bits.append(f".pth hook {'loaded' if st['hook_booted_by_pth'] else 'NOT loaded'} in this interpreter")
        if st.get("pinned_sglang_version"):
            bits.append(f"pinned sglang {st['pinned_sglang_version']}")
        return "; ".join(bits) or str(st)[:200]
    return str(st)[:200]


def check_kernel_patch(inp: DoctorInput) -> Check:
    p = inp.probe
    if not p.has_module("v4flash_kernels"):
        return error("kernel-patch", "v4flash_kernels is not importable",
                     "install the v4flash-pd wheel (it ships v4flash_kernels and the .pth hook)")
    hook_note = ""
    if p.has_module("v4flash_kernels.hook"):
        try:
            from v4flash_kernels import hook  # type: ignore[attr-defined]

            st = hook.status() if hasattr(hook, "status") else None
            hook_note = _hook_note(st)
        except Exception as exc:  # a broken hook must show up as a finding
            return error("kernel-patch", f"v4flash_kernels.hook fails to import/report: {exc!r}",
                         "reinstall the v4flash-pd wheel; run with --debug for the traceback")
    else:
        return error("kernel-patch", "v4flash_kernels.hook is missing (the import hook that patches SGLang)",
                     "install the v4flash-pd wheel built from this release (it ships the hook and its .pth)")
    env = {**p.env, **inp.expect.worker_env}
    disabled = env.get("V4FLASH_SPARSE_DECODE", "1").strip().lower() in ("0", "off", "false", "no")
    if not p.has_module("sglang"):
        return skip("kernel-patch", "sglang is not installed here, cannot import the patched module"
                    + (f" ({hook_note})" if hook_note else ""))
    python = sys.executable
    r = p.run([python, "-c", _probe_patch_script()], 180.0, dict(inp.expect.worker_env))
    if r.rc != 0:
        last = r.text.splitlines()[-1] if r.text else f"exit {r.rc}"
        return error("kernel-patch", f"importing {UPSTREAM_MODULE} failed: {last}",
                     "the installed sglang cannot import its SM120 attention module: check stack-versions")
    owner = r.out.strip().splitlines()[-1] if r.out.strip() else "?"
    ours = owner.startswith("v4flash_kernels")
    if disabled:
        if ours:
            return error("kernel-patch", "V4FLASH_SPARSE_DECODE=0 but the patch is still applied",
                         "report a bug: the switch must leave SGLang untouched")
        return ok("kernel-patch", "disabled (sparse_decode = off, workers get V4FLASH_SPARSE_DECODE=0): upstream kernel in use")
    if not ours:
        return error("kernel-patch", f"{UPSTREAM_MODULE}.{UPSTREAM_FUNC} is still upstream's ({owner})"
                     + (f"; {hook_note}" if hook_note else ""),
                     "the hook did not apply: check the warning it printed (sglang version not the pinned one?) "
                     "and that the v4flash-pd .pth is in site-packages")
    return ok("kernel-patch", f"{UPSTREAM_FUNC} -> {owner}" + (f" ({hook_note})" if hook_note else ""))


def run(inp: DoctorInput) -> list[Check]:
    return [check_versions(inp), check_kernel_patch(inp)]
