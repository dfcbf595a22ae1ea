"""Interpreter-start half of the SGLang import hook, run by `v4flash_kernels_hook.pth` (`boot()`).

The .pth runs in *every* Python process of the environment (pip, the router, each SGLang TP rank),
so this module imports nothing but `sys` and only puts a meta-path finder in front of the import
system. The finder reacts to the few module names in TARGET_MODULES; everything that costs anything (`inspect`,
`logging`, `importlib.metadata`, torch, our kernel) lives in `v4flash_kernels.hook.hook` and is loaded
only when SGLang imports that module.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # mypy reads the block below as true; at run time this module imports nothing else
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

# The sglang 0.5.13.post1 modules whose functions `v4flash_kernels.hook.patches.PATCHES` replace; a
# literal here (this module imports nothing), checked against the registry by the hook tests.
TARGET_MODULE = "sglang.srt.layers.attention.flash_mla_sm120_triton"
TARGET_MODULES = frozenset({
    TARGET_MODULE,
    "sglang.srt.layers.moe.fused_moe_triton.mxfp4_moe_sm120_triton",
    "sglang.srt.layers.quantization.mxfp4_marlin_moe",
    "sglang.srt.layers.attention.dsv4.indexer",
    "sglang.srt.layers.quantization.fp8_utils",
    "sglang.srt.models.deepseek_v4",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.attention.dsv4.compressor_v2",
})


class SglangKernelFinder:
    """Meta-path finder: wraps the loaders of TARGET_MODULES so the patches run right after they load.

    It never finds a module itself; for a target it asks the finders behind it and hands back
    their spec with a loader that patches after `exec_module`.
    """

    _v4flash_hook = True  # marker: one finder per interpreter, whatever imported this module

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname not in TARGET_MODULES:
            return None
        from v4flash_kernels.hook import hook

        return hook.find_spec_after(self, fullname, path, target)

    def invalidate_caches(self) -> None:
        return None


def installed() -> bool:
    """True when some SglangKernelFinder is on `sys.meta_path`."""
    return any(getattr(f, "_v4flash_hook", False) for f in sys.meta_path)


def install() -> None:
    """Put the finder first on `sys.meta_path` (once); patch now if a target module is already in."""
    if not installed():
        sys.meta_path.insert(0, SglangKernelFinder())
    if any(m in sys.modules for m in TARGET_MODULES):
        from v4flash_kernels.hook import hook

        hook.apply()


booted = False  # set by boot(): the .pth ran in this interpreter


def boot() -> None:
    """Entry point of the .pth line; must never break interpreter start."""
    global booted
    try:
        install()
        booted = True
    except Exception as exc:  # pragma: no cover - defensive
        sys.stderr.write(f"[v4flash] kernel hook not installed: {type(exc).__name__}: {exc}\n")
