"""Installed versions vs the stack lock, and whether each kernel patch is in effect.

ABI drift between sglang-kernel, torch and flashinfer shows up as undefined
symbols deep inside a worker; comparing importlib.metadata against the lock finds it up front.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from v4flash_kernels.hook.patches import PATCHES, switch_by_name
from v4flash_pd import stacklock
from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn
from v4flash_pd.errors import UserError

ANCHOR = "sglang"  # if this is absent, we are not running inside the serving environment


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


# Above this many tokens of context the unpatched indexer's per-step cost (it scores every cached
# token) dominates decode on sm_120: say so when its patch is off.
LARGE_CONTEXT = 65536


def _hook_note(st: object) -> str:
    """One short phrase from the hook's status dict (anything else is shown as is)."""
    if isinstance(st, dict):
        bits = []
        if "hook_booted_by_pth" in st:
            bits.append(f".pth hook {'loaded' if st['hook_booted_by_pth'] else 'NOT loaded'}")
        if st.get("pinned_sglang_version"):
            bits.append(f"pinned sglang {st['pinned_sglang_version']}")
        return "; ".join(bits)
    return str(st)[:200]


def _status_json(text: str) -> dict[str, Any] | None:
    """The JSON object `python -m v4flash_kernels.hook.hook` prints (pretty-printed, possibly after log lines)."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        data = json.loads(text[start:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def check_patches(inp: DoctorInput) -> list[Check]:
    """One row per kernel patch of the registry: run the hook's own report in the workers' interpreter and env."""
    p, e = inp.probe, inp.expect
    switches = dict(e.patches)
    specs = list(PATCHES)
    rows = [f"patch-{s.name}" for s in specs]
    python = e.python  # the plan's: what its workers run
    # The workers' interpreter and environment, as the plan starts them: the hook reports every patch.
    r = p.run([python, "-m", "v4flash_kernels.hook.hook"], 300.0, dict(e.worker_env))
    st = _status_json(r.out)
    if st is None or not isinstance(st.get("patches"), dict):
        last = r.text.splitlines()[-1] if r.text else f"exit {r.rc}"
        return [error(rows[0], f"`{python} -m v4flash_kernels.hook.hook` gave no status: {last}",
                      "install the v4flash-pd wheel into the workers' interpreter (it ships v4flash_kernels and "
                      "the .pth hook); run that command by hand to see the traceback")] + \
            [skip(x, "no hook status") for x in rows[1:]]
    reasons = [str(v.get("reason", "")) for v in st["patches"].values() if isinstance(v, dict)]
    if reasons and all("No module named 'sglang" in x for x in reasons):
        return [skip(r, f"sglang is not installed for {python}: the {s.title} patch cannot be "
                        "checked here" + (" (switch off)" if not switches.get(s.switch, True) else ""))
                for r, s in zip(rows, specs)]
    note = _hook_note(st)
    out = []
    for row, spec in zip(rows, specs):
        rec = st["patches"].get(spec.name)
        title, on, var = spec.title, switches.get(spec.switch, True), spec.switch_env
        if not isinstance(rec, dict):
            out.append(error(row, f"the installed hook does not know the {title} patch",
                             "install the v4flash-pd wheel of this release (launcher and kernels must match)"))
            continue
        active, reason = bool(rec.get("active")), str(rec.get("reason", ""))
        if not on:
            out.append(error(row, f"{var}=0 but the {title} patch is still applied", "report a bug: the switch "
                                  "must leave SGLang untouched") if active else
                       ok(row, f"off ({var}=0): upstream {rec.get('upstream_function', title)} in use"))
        elif active:
            out.append(ok(row, f"{rec.get('upstream_function', title)} -> {rec.get('ours_function', 'ours')}"
                               + (f" ({note})" if note else "")))
        else:
            out.append(error(row, f"{title} patch NOT applied: {reason}" + (f" ({note})" if note else ""),
                             f"check the hook's warning (sglang not the pinned version?) and that the v4flash-pd "
                             f".pth is in site-packages; or turn it off on purpose: {switch_by_name(spec.switch).flag} off"))
    return out


def check_context(inp: DoctorInput) -> Check:
    e = inp.expect
    ctx = e.context_length
    if ctx is None:
        return skip("context-length", "engine.context_length not set: SGLang uses the model's maximum")
    if not dict(e.patches).get("indexer", True) and ctx > LARGE_CONTEXT:
        return warn("context-length", f"context_length {ctx} with the indexer patch off: the upstream indexer "
                                      "scores every cached token each decode step, so long contexts decode slowly",
                    f"turn the indexer patch on (--indexer on), or --set engine.context_length={LARGE_CONTEXT} "
                    "if long contexts are not needed")
    return ok("context-length", f"{ctx} tokens (KV pool and CUDA-graph buffers are sized from it)")


def run(inp: DoctorInput) -> list[Check]:
    return [check_versions(inp), *check_patches(inp), check_context(inp)]
