"""Put our kernels (`patches.PATCHES`) into SGLang: decide, patch, say so once, record it.

Each upstream function we replace is looked up by its SGLang caller as a module attribute *at call
time* (e.g. the sm_120 sparse-MLA dispatcher imports `flash_mla_sparse_decode_triton` inside the
call), so replacing that attribute right after the module executes (via the finder in `hook_boot`)
reroutes every call of every worker without touching site-packages. Each patch decides on its own
and all-or-nothing: applied only when its switch is on, the installed sglang is the pinned version
and upstream's signature equals ours; otherwise that module is left alone and one warning says why.

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
import types
from dataclasses import dataclass
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from typing import Any, Callable, Dict, Tuple, cast

from v4flash_kernels import __version__ as OURS_VERSION
from v4flash_kernels.hook import hook_boot
from v4flash_kernels.hook.hook_boot import installed as _finder_installed
from v4flash_kernels.hook.patches import PATCHES, SPARSE_DECODE, PatchSpec, by_name, switch_by_name

PINNED_SGLANG = "0.5.13.post1"
ENV_STATUS_DIR = "V4FLASH_PATCH_STATUS_DIR"
# sglang 0.5.13.post1's own switch: "1" (default) = Triton path (the one we replace), else torch.
SGLANG_BACKEND_ENV = "SGLANG_SM120_TRITON_FLASHMLA"
# The sparse-decode patch's names, kept for callers written before the registry.
TARGET_MODULE = SPARSE_DECODE.target_module
TARGET_ATTR = SPARSE_DECODE.target_attr
ENV_SWITCH = SPARSE_DECODE.switch_env

_ON = {"", "1", "on", "true", "yes"}
_OFF = {"0", "off", "false", "no"}

log = logging.getLogger("v4flash_kernels.hook.hook")


def upstream_keep_attr(spec: PatchSpec) -> str:
    """Module attribute that keeps upstream's function next to ours, for A/B debugging and rollback."""
    return "_v4flash_upstream_" + spec.target_attr


# ----------------------------------------------------------------------------- pure core


@dataclass(frozen=True)
class Decision:
    """What the hook decided for one patch in this process; `active` only when the patch is complete."""

    active: bool
    reason: str
    warn: bool  # True when the user expected the patch (switch on) but it was refused
    sglang_version: str | None


def parse_switch(value: str | None) -> bool | None:
    """A patch switch's value -> True (on, the default), False (off), None (unrecognised)."""
    if value is None:
        return True
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    return None


def signature_params(fn: Callable[..., Any]) -> Tuple[Any, ...]:
    """(name, kind, default) per parameter: what a positional/keyword caller relies on."""
    return tuple((p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values())


def signature_mismatch(upstream: Callable[..., Any], ours: Callable[..., Any]) -> str | None:
    """None when ours accepts exactly upstream's calls, else what differs.

    Names, kinds and defaults must match one for one; ours may add keyword-only parameters with
    defaults after them (extra options no upstream caller can pass by accident).
    """
    a, b = signature_params(upstream), signature_params(ours)
    extra = b[len(a):]
    if b[: len(a)] == a and all(k == "KEYWORD_ONLY" and d is not inspect.Parameter.empty for _, k, d in extra):
        return None

    def fmt(params: Tuple[Any, ...]) -> str:
        parts = []
        for name, kind, default in params:
            s = name if default is inspect.Parameter.empty else f"{name}={default!r}"
            parts.append(("*" if kind == "VAR_POSITIONAL" else "**" if kind == "VAR_KEYWORD" else "") + s)
        return "(" + ", ".join(parts) + ")"

    return f"upstream{fmt(a)} != ours{fmt(b)}"


def decide(
    switch: str | None,
    sglang_version: str | None,
    upstream: Any,
    ours: Any,
    ours_error: str | None,
    pinned: str = PINNED_SGLANG,
    spec: PatchSpec = SPARSE_DECODE,
) -> Decision:
    """The whole policy, in order: switch, version, upstream present, ours importable, signature."""
    on = parse_switch(switch)
    if on is False:
        return Decision(False, f"disabled by {spec.switch_env}={switch}", False, sglang_version)
    if on is None:
        return Decision(
            False, f"{spec.switch_env}={switch!r} is not one of 1/0/on/off/true/false", True, sglang_version
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
        return Decision(False, f"{spec.upstream_function} not found", True, sglang_version)
    if ours_error is not None or not callable(ours):
        return Decision(False, f"{spec.ours_function} failed to import: {ours_error}", True, sglang_version)
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
_decisions: Dict[str, Decision] = {}
_installed: Dict[str, Any] = {}  # patch name -> the function we put into the target module


def status(probe: bool = False) -> Dict[str, Any]:
    """This process's view of every patch (for `doctor`, `status` and the run dir's patch/ files).

    With `probe=True` each target module not yet imported is imported first (heavy: sglang, torch,
    triton), so every patch decides now instead of reporting "not decided".
    """
    undecided: Dict[str, str] = {}
    if probe:
        for spec in PATCHES:
            if spec.name in _decisions:
                continue
            try:
                importlib.import_module(spec.target_module)
            except Exception as exc:  # sglang missing or broken: report, don't raise
                undecided[spec.name] = f"cannot import {spec.target_module}: {type(exc).__name__}: {exc}"
    return {
        "pid": os.getpid(),
        "ours_version": OURS_VERSION,
        "pinned_sglang_version": PINNED_SGLANG,
        "hook_installed": _finder_installed(),
        "hook_booted_by_pth": hook_boot.booted,
        "patches": {s.name: patch_status(s.name, undecided.get(s.name)) for s in PATCHES},
    }


def patch_status(name: str, why_undecided: str | None = None) -> Dict[str, Any]:
    """One patch's record: decided?, active (the attribute really is ours right now), why."""
    spec = by_name(name)
    d = _decisions.get(name)
    rec = {
        "active": bool(d and d.active) and _really_patched(spec),
        "decided": d is not None,
        "reason": d.reason if d else (why_undecided or f"{spec.target_module} not imported in this process"),
        "switch_name": spec.switch,
        "switch_env": spec.switch_env,
        "switch": os.environ.get(spec.switch_env, "1" if switch_by_name(spec.switch).default_on else "0"),
        "ours_function": spec.ours_function,
        "upstream_function": spec.upstream_function,
        "sglang_version": d.sglang_version if d else None,
    }
    if spec is SPARSE_DECODE:
        rec["sglang_sm120_triton_flashmla"] = _sglang_backend()
    if spec.detail and rec["active"]:
        try:
            mod_name, _, fn_name = spec.detail.partition(":")
            detail = getattr(importlib.import_module(mod_name), fn_name)()
            rec["detail"] = detail
            if detail.get("summary"):
                rec["reason"] = f"{rec['reason']}; {detail['summary']}"
        except Exception as exc:  # a report must not break the status
            rec["detail"] = {"error": f"{type(exc).__name__}: {exc}"}
    return rec


def refresh_status_file() -> None:
    """Rewrite this process's status file now (a patch's `detail` changed, e.g. a layer was loaded)."""
    with _lock:
        _write_status_file()


def apply() -> Dict[str, Any]:
    """Patch every target module already imported, and make sure the finder will patch the rest.

    Idempotent; returns `status()`.
    """
    with _lock:
        _install_finder_only()
        for name in {s.target_module for s in PATCHES}:
            mod = sys.modules.get(name)
            if mod is not None:
                on_module_executed(mod, name)
    return status()


def _install_finder_only() -> None:
    # Not hook_boot.install(): that calls apply() when a module is already in; we are that call.
    if not _finder_installed():
        sys.meta_path.insert(0, hook_boot.SglangKernelFinder())


def on_module_executed(module: Any, fullname: str | None = None) -> None:
    """Decide once per patch per process, then (re)apply each patch that targets `module`; never raises.

    A failure while patching rolls that patch back to upstream's function and records the error, so
    the process never runs with a half-applied patch; other patches are unaffected.
    """
    name = fullname or getattr(module, "__name__", None)
    with _lock:
        for spec in PATCHES:
            if spec.target_module == name:
                _apply_one(spec, module)


def _apply_one(spec: PatchSpec, module: Any) -> None:
    first = spec.name not in _decisions
    try:
        if first:
            _decisions[spec.name] = _decide_for(spec, module)
        if _decisions[spec.name].active:
            _patch(spec, module)
    except Exception as exc:  # a bug here must not take SGLang down with it
        _rollback(spec, module)
        prior = _decisions.get(spec.name)
        was_active = bool(prior and prior.active)
        version = prior.sglang_version if prior else None
        _decisions[spec.name] = Decision(False, f"hook error: {type(exc).__name__}: {exc}", True, version)
        first = first or was_active
    if first:
        try:
            _announce(spec, _decisions[spec.name])
        except Exception:  # logging/status file must not break the import either
            pass


def _decide_for(spec: PatchSpec, module: Any) -> Decision:
    switch = os.environ.get(spec.switch_env)
    version = _sglang_version()
    if switch is None and not switch_by_name(spec.switch).default_on:
        return Decision(False, f"off by default ({spec.switch_env} unset; {spec.switch_env}=1 turns it on)",
                        False, version)
    if parse_switch(switch) is False:
        return decide(switch, version, None, None, None, spec=spec)
    upstream = target_function(module, spec)
    ours, err = None, None
    if version == PINNED_SGLANG and parse_switch(switch):
        try:
            ours = getattr(importlib.import_module(spec.ours_module), spec.ours_attr)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
    return decide(switch, version, upstream, ours, err, spec=spec)


def _sglang_backend() -> str:
    return os.environ.get(SGLANG_BACKEND_ENV, "1")


def _sglang_version() -> str | None:
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


def _replacement(spec: PatchSpec) -> Any:
    """The function to install: ours, or what the patch's adapter makes of it (built once)."""
    if spec.name in _installed:
        return _installed[spec.name]
    ours = getattr(importlib.import_module(spec.ours_module), spec.ours_attr)
    if spec.adapter:
        mod_name, _, fn_name = spec.adapter.partition(":")
        ours = getattr(importlib.import_module(mod_name), fn_name)(ours)
    _installed[spec.name] = ours
    return ours


def _owner(module: Any, spec: PatchSpec) -> Tuple[Any, str]:
    """(object holding the target, attribute name): the module itself, or a class of it for "Cls.attr"."""
    owner_name, _, attr = spec.target_attr.rpartition(".")
    return (getattr(module, owner_name) if owner_name else module), attr


def target_function(module: Any, spec: PatchSpec) -> Any:
    """The plain function the target names now (a staticmethod/classmethod unwrapped), or None."""
    try:
        owner, attr = _owner(module, spec)
    except AttributeError:
        return None
    raw = _own_attr(owner, attr) if isinstance(owner, type) else getattr(owner, attr, None)
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _set_target(module: Any, spec: PatchSpec, fn: Any) -> None:
    """Install `fn` at the target, keeping a class attribute's staticmethod/classmethod wrapper."""
    owner, attr = _owner(module, spec)
    raw = _own_attr(owner, attr) if isinstance(owner, type) else None
    if isinstance(raw, (staticmethod, classmethod)):
        fn = type(raw)(fn)
    setattr(owner, attr, fn)


def _patch(spec: PatchSpec, module: Any) -> None:
    ours = _replacement(spec)
    upstream = target_function(module, spec)
    if upstream is ours:
        return
    setattr(module, upstream_keep_attr(spec), upstream)
    _set_target(module, spec, ours)
    if "." in spec.target_attr:
        return  # a class attribute is found through the class at call time: nothing else holds it
    # Modules that did `from <target> import <attr>` at import time hold their own reference.
    for name, other in list(sys.modules.items()):
        if name.startswith("sglang.") and other is not module and _own_attr(other, spec.target_attr) is upstream:
            setattr(other, spec.target_attr, ours)


def _own_attr(mod: Any, attr: str) -> Any:
    """The module's own binding, without running a module-level `__getattr__` (lazy imports)."""
    d = getattr(mod, "__dict__", None)
    return d.get(attr) if isinstance(d, (dict, types.MappingProxyType)) else None


def _rollback(spec: PatchSpec, module: Any) -> None:
    upstream = getattr(module, upstream_keep_attr(spec), None)
    if upstream is None:
        return
    ours = _installed.get(spec.name)
    if "." in spec.target_attr:
        if ours is not None and target_function(module, spec) is ours:
            try:
                _set_target(module, spec, upstream)
            except Exception:
                pass
        return
    for name, other in list(sys.modules.items()):
        held = _own_attr(other, spec.target_attr)
        if (other is module or name.startswith("sglang.")) and ours is not None and held is ours:
            try:
                setattr(other, spec.target_attr, upstream)
            except Exception:
                pass


def _really_patched(spec: PatchSpec) -> bool:
    """The module attribute is our installed function right now (not just "we decided to")."""
    mod = sys.modules.get(spec.target_module)
    ours = _installed.get(spec.name)
    return mod is not None and ours is not None and target_function(mod, spec) is ours


def _announce(spec: PatchSpec, d: Decision) -> None:
    _ensure_handler()
    if d.active:
        unused = spec is SPARSE_DECODE and _sglang_backend() != "1"
        (log.warning if unused else log.info)(
            "%s patch ACTIVE: %s (sglang %s) -> %s (v4flash-kernels %s) [pid %d]%s",
            spec.title, spec.upstream_function, d.sglang_version, spec.ours_function, OURS_VERSION, os.getpid(),
            f"; but {SGLANG_BACKEND_ENV}={_sglang_backend()} makes SGLang use its torch fallback, "
            "so neither Triton kernel runs" if unused else "",
        )
    elif d.warn:
        log.warning(
            "%s patch NOT applied, SGLang's own kernel is used: %s [pid %d]", spec.title, d.reason, os.getpid(),
        )
    else:
        log.info("%s patch off (%s): SGLang's own kernel is used [pid %d]", spec.title, d.reason, os.getpid())
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
    """`patch-<pid>.json`: every patch of this process, rewritten as each one decides."""
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
        on_module_executed(module, getattr(getattr(module, "__spec__", None), "name", None))

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, path, ... for inspect/linecache
        return getattr(self._inner, name)


def find_spec_after(finder: Any, fullname: str, path: Any, target: Any) -> ModuleSpec | None:
    """Spec from the finders behind ours, with its loader wrapped; None if nobody finds it."""
    spec: ModuleSpec | None = None
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
        spec.loader = cast(Loader, _PatchingLoader(spec.loader))  # a Loader by delegation, not by base class
    return spec


__all__ = [
    "Decision", "PINNED_SGLANG", "PATCHES", "apply", "decide", "parse_switch", "patch_status",
    "refresh_status_file", "signature_mismatch", "status",
]


def _main() -> None:
    """`python -m v4flash_kernels.hook.hook`: import SGLang's modules here and print every patch's status.

    Exit 0 when every patch whose switch is on is active, 1 otherwise.
    """
    from v4flash_kernels.hook import hook as this  # the imported module, not this __main__ copy

    st = this.status(probe=True)
    print(json.dumps(st, indent=2, sort_keys=True))
    wanted = [p for p in st["patches"].values() if this.parse_switch(p["switch"]) is not False]
    sys.exit(0 if all(p["active"] for p in wanted) else 1)


if __name__ == "__main__":
    _main()
