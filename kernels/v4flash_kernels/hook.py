"""Put `v4flash_kernels.sparse_mla_decode` into SGLang: decide, patch, say so once, record it.

SGLang 0.5.13.post1's dispatcher `flash_mla_sm120.flash_mla_with_kvcache_sm120` imports
`flash_mla_sparse_decode_triton` from TARGET_MODULE *at call time*, so replacing that module
attribute (right after the module executes, via the finder in `hook_boot`) reroutes every decode
call of every worker without touching site-packages. The decision is all-or-nothing: the patch is
applied only when the switch is on, the installed sglang is the pinned version and upstream's
signature equals ours; otherwise nothing is changed and one warning says why.

The core (`parse_switch`, `signature_mismatch`, `decide`) is pure; the edges (finding the module,
setting attributes, logging, the status file) are the small functions at the bottom.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from v4flash_kernels import __version__ as OURS_VERSION
from v4flash_kernels import hook_boot
from v4flash_kernels.hook_boot import TARGET_MODULE, installed as _finder_installed

PINNED_SGLANG = "0.5.13.post1"
TARGET_ATTR = "flash_mla_sparse_decode_triton"
OURS_MODULE = "v4flash_kernels.decode"
OURS_ATTR = "sparse_mla_decode"
ENV_SWITCH = "V4FLASH_SPARSE_DECODE"
ENV_STATUS_DIR = "V4FLASH_PATCH_STATUS_DIR"
# sglang 0.5.13.post1's own switch: "1" (default) = Triton path (the one we replace), else torch.
SGLANG_BACKEND_ENV = "SGLANG_SM120_TRITON_FLASHMLA"
UPSTREAM_KEEP_ATTR = "_v4flash_upstream_" + TARGET_ATTR  # upstream function, kept for A/B debugging

_ON = {"", "1", "on", "true", "yes"}
_OFF = {"0", "off", "false", "no"}

log = logging.getLogger("v4flash_kernels.hook")


# ----------------------------------------------------------------------------- pure core


@dataclass(frozen=True)
class Decision:
    """What the hook decided for this process; `active` is True only when the patch is complete."""

    active: bool
    reason: str
    warn: bool  # True when the user expected the patch (switch on) but it was refused
    sglang_version: Optional[str]


def parse_switch(value: Optional[str]) -> Optional[bool]:
    """`V4FLASH_SPARSE_DECODE` -> True (on, the default), False (off), None (unrecognised)."""
    if value is None:
        return True
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    return None


def signature_params(fn: Callable[..., Any]) -> tuple:
    """(name, kind, default) per parameter: what a positional/keyword caller relies on."""
    return tuple((p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values())


def signature_mismatch(upstream: Callable[..., Any], ours: Callable[..., Any]) -> Optional[str]:
    """None when both take the same parameters (names, kinds, defaults), else what differs."""
    a, b = signature_params(upstream), signature_params(ours)
    if a == b:
        return None

    def fmt(params: tuple) -> str:
        parts = []
        for name, kind, default in params:
            s = name if default is inspect.Parameter.empty else f"{name}={default!r}"
            parts.append(("*" if kind == "VAR_POSITIONAL" else "**" if kind == "VAR_KEYWORD" else "") + s)
        return "(" + ", ".join(parts) + ")"

    return f"upstream{fmt(a)} != ours{fmt(b)}"


def decide(
    switch: Optional[str],
    sglang_version: Optional[str],
    upstream: Any,
    ours: Any,
    ours_error: Optional[str],
    pinned: str = PINNED_SGLANG,
) -> Decision:
    """The whole policy, in order: switch, version, upstream present, ours importable, signature."""
    on = parse_switch(switch)
    if on is False:
        return Decision(False, f"disabled by {ENV_SWITCH}={switch}", False, sglang_version)
    if on is None:
        return Decision(
            False, f"{ENV_SWITCH}={switch!r} is not one of 1/0/on/off/true/false", True, sglang_version
        )
    if sglang_version != pinned:
        return Decision(
            False,
            f"installed sglang {sglang_version} is not the pinned {pinned} "
            f"that v4flash-kernels {OURS_VERSION} was built against",
            True,
            sglang_version,
        )
    if not callable(upstream):
        return Decision(False, f"{TARGET_MODULE}.{TARGET_ATTR} not found", True, sglang_version)
    if ours_error is not None or not callable(ours):
        return Decision(False, f"{OURS_MODULE}.{OURS_ATTR} failed to import: {ours_error}", True, sglang_version)
    try:
        diff = signature_mismatch(upstream, ours)
    except (TypeError, ValueError) as exc:
        diff = f"signature unreadable: {exc}"
    if diff is not None:
        return Decision(
            False,
            f"signature differs in sglang {sglang_version} vs v4flash-kernels {OURS_VERSION}: {diff}",
            True,
            sglang_version,
        )
    return Decision(True, "patched", False, sglang_version)


# ----------------------------------------------------------------------------- process state

_lock = threading.RLock()
_decision: Optional[Decision] = None


def status(probe: bool = False) -> dict:
    """Whether the patch is active in *this* process, and why (for `doctor` and the run dir).

    With `probe=True` the SGLang module is imported first (heavy: imports sglang, torch, triton)
    so the hook decides now instead of reporting "not decided".
    """
    if probe and _decision is None:
        try:
            importlib.import_module(TARGET_MODULE)
        except Exception as exc:  # sglang missing or broken: report, don't raise
            return _status_dict(None, f"cannot import {TARGET_MODULE}: {type(exc).__name__}: {exc}")
    return _status_dict(_decision, None)


def _status_dict(d: Optional[Decision], why_undecided: Optional[str]) -> dict:
    return {
        "active": bool(d and d.active) and _really_patched(),
        "decided": d is not None,
        "reason": d.reason if d else (why_undecided or f"{TARGET_MODULE} not imported in this process"),
        "switch": os.environ.get(ENV_SWITCH, "1"),
        "pid": os.getpid(),
        "ours_function": f"{OURS_MODULE}.{OURS_ATTR}",
        "ours_version": OURS_VERSION,
        "upstream_function": f"{TARGET_MODULE}.{TARGET_ATTR}",
        "sglang_version": d.sglang_version if d else None,
        "pinned_sglang_version": PINNED_SGLANG,
        "sglang_sm120_triton_flashmla": _sglang_backend(),
        "hook_installed": _finder_installed(),
        "hook_booted_by_pth": hook_boot.booted,
    }


def apply() -> dict:
    """Patch SGLang's module now if it is already imported, else make sure the finder will.

    Idempotent; returns `status()`.
    """
    with _lock:
        _install_finder_only()
        mod = sys.modules.get(TARGET_MODULE)
        if mod is not None:
            on_module_executed(mod)
    return status()


def _install_finder_only() -> None:
    # Not hook_boot.install(): that calls apply() when the module is already in; we are that call.
    if not _finder_installed():
        sys.meta_path.insert(0, hook_boot.SglangKernelFinder())


def on_module_executed(module: Any) -> None:
    """Decide once per process, then (re)apply the patch to `module`; never raises.

    A failure while patching rolls the module back to upstream's function and records the error,
    so the process never runs with a half-applied patch.
    """
    global _decision
    with _lock:
        first = _decision is None
        try:
            if first:
                _decision = _decide_for(module)
            if _decision.active:
                _patch(module)
        except Exception as exc:  # a bug here must not take SGLang down with it
            _rollback(module)
            was_active = bool(_decision and _decision.active)
            version = _decision.sglang_version if _decision else None
            _decision = Decision(False, f"hook error: {type(exc).__name__}: {exc}", True, version)
            first = first or was_active
        if first:
            try:
                _announce(_decision)
            except Exception:  # logging/status file must not break the import either
                pass


def _decide_for(module: Any) -> Decision:
    switch = os.environ.get(ENV_SWITCH)
    if parse_switch(switch) is False:
        return decide(switch, _sglang_version(), None, None, None)
    version = _sglang_version()
    upstream = getattr(module, TARGET_ATTR, None)
    ours, err = None, None
    if version == PINNED_SGLANG and parse_switch(switch):
        try:
            ours = getattr(importlib.import_module(OURS_MODULE), OURS_ATTR)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
    return decide(switch, version, upstream, ours, err)


def _sglang_backend() -> str:
    return os.environ.get(SGLANG_BACKEND_ENV, "1")


def _sglang_version() -> Optional[str]:
    """The installed distribution's version; a disagreeing `sglang.__version__` makes it unknown."""
    from importlib import metadata

    try:
        dist_version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        dist_version = None
    mod_version = getattr(sys.modules.get("sglang"), "__version__", None)
    if dist_version and mod_version and dist_version != mod_version:
        return f"{dist_version} (dist-info) / {mod_version} (sglang.__version__)"
    return dist_version or mod_version


def _patch(module: Any) -> None:
    ours = getattr(importlib.import_module(OURS_MODULE), OURS_ATTR)
    upstream = getattr(module, TARGET_ATTR)
    if upstream is ours:
        return
    setattr(module, UPSTREAM_KEEP_ATTR, upstream)
    setattr(module, TARGET_ATTR, ours)
    # Modules that did `from <target> import flash_mla_sparse_decode_triton` at import time hold
    # their own reference (none in 0.5.13.post1, whose dispatcher imports at call time).
    for name, other in list(sys.modules.items()):
        if name.startswith("sglang.") and other is not module and _own_attr(other) is upstream:
            setattr(other, TARGET_ATTR, ours)


def _own_attr(mod: Any) -> Any:
    """The module's own binding, without running a module-level `__getattr__` (lazy imports)."""
    d = getattr(mod, "__dict__", None)
    return d.get(TARGET_ATTR) if isinstance(d, dict) else None


def _rollback(module: Any) -> None:
    upstream = getattr(module, UPSTREAM_KEEP_ATTR, None)
    if upstream is None:
        return
    ours = getattr(sys.modules.get(OURS_MODULE), OURS_ATTR, None)
    for name, other in list(sys.modules.items()):
        if (other is module or name.startswith("sglang.")) and ours is not None and _own_attr(other) is ours:
            try:
                setattr(other, TARGET_ATTR, upstream)
            except Exception:
                pass


def _really_patched() -> bool:
    """The module attribute is ours right now (not just "we decided to")."""
    mod = sys.modules.get(TARGET_MODULE)
    ours = getattr(sys.modules.get(OURS_MODULE), OURS_ATTR, None)
    return mod is not None and ours is not None and getattr(mod, TARGET_ATTR, None) is ours


def _announce(d: Decision) -> None:
    _ensure_handler()
    if d.active:
        unused = _sglang_backend() != "1"
        (log.warning if unused else log.info)(
            "sparse-MLA decode patch ACTIVE: %s.%s (sglang %s) -> %s.%s (v4flash-kernels %s) [pid %d]%s",
            TARGET_MODULE, TARGET_ATTR, d.sglang_version, OURS_MODULE, OURS_ATTR, OURS_VERSION, os.getpid(),
            f"; but {SGLANG_BACKEND_ENV}={_sglang_backend()} makes SGLang use its torch fallback, "
            "so neither Triton kernel runs" if unused else "",
        )
    elif d.warn:
        log.warning(
            "sparse-MLA decode patch NOT applied, SGLang's own kernel is used: %s [pid %d]",
            d.reason, os.getpid(),
        )
    else:
        log.info("sparse-MLA decode patch off (%s): SGLang's own kernel is used [pid %d]", d.reason, os.getpid())
    _write_status_file()


def _ensure_handler() -> None:
    """One stderr line per decision, visible even before SGLang configures logging."""
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[v4flash-kernels] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def _write_status_file() -> None:
    out_dir = os.environ.get(ENV_STATUS_DIR)
    if not out_dir:
        return
    path = os.path.join(out_dir, f"patch-{os.getpid()}.json")
    try:
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(status(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write patch status to %s: %s", path, exc)


# ----------------------------------------------------------------------------- import machinery


class _PatchingLoader:
    """Delegates to SGLang's real loader and patches the module right after it executes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        on_module_executed(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, path, ... for inspect/linecache
        return getattr(self._inner, name)


def find_spec_after(finder: Any, fullname: str, path: Any, target: Any) -> Any:
    """Spec from the finders behind ours, with its loader wrapped; None if nobody finds it."""
    spec = None
    for f in list(sys.meta_path):
        if f is finder or getattr(f, "_v4flash_hook", False):
            continue
        find = getattr(f, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            break
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    if not isinstance(spec.loader, _PatchingLoader):
        spec.loader = _PatchingLoader(spec.loader)
    return spec


__all__ = [
    "Decision", "PINNED_SGLANG", "TARGET_MODULE", "TARGET_ATTR", "apply", "decide", "parse_switch",
    "signature_mismatch", "status",
]


def _main() -> None:
    """`python -m v4flash_kernels.hook`: import SGLang's module here and print this process's status."""
    from v4flash_kernels import hook as this  # the imported module, not this __main__ copy

    print(json.dumps(this.status(probe=True), indent=2, sort_keys=True))
    sys.exit(0 if this.status()["active"] else 1)


if __name__ == "__main__":
    _main()
