"""The kernel patches: the one table the hook, the launcher's switches, doctor/status and the step bench read.

A *switch* is what a user turns on or off (`--<name>` / config `patches.<name>` / env `V4FLASH_<NAME>`);
a *patch* is one upstream function (or class attribute) we replace. A switch covers one or more
patches (e.g. a kernel and the load-time weight repack it needs), and each patch decides on its own
(version, presence, signature) with its own status record. Adding a kernel is adding its `Switch` and
its `PatchSpec`s here (and the target modules to `hook_boot.TARGET_MODULES`, which must stay
import-free); `hook` does the rest. This module imports nothing heavy: the torch-free launcher reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


def switch_env_of(switch: str) -> str:
    """The environment variable every worker process reads for a switch (one naming rule, no table)."""
    return "V4FLASH_" + switch.upper()


@dataclass(frozen=True)
class Switch:
    """One user-facing on/off for a kernel; on unless the user says off.

    `selfcheck` names the module whose `cases(target)` check this switch's kernels against their
    fp64 reference and upstream on each GPU before workers start (`python -m v4flash_kernels.selfcheck`,
    docs/selfcheck.md); None = no self-check yet, and the launcher says so instead of vouching for it.
    """

    name: str  # config key patches.<name>; launcher flag --<name with dashes>
    title: str  # for log lines and tables
    help: str  # the launcher flag's help, one sentence
    selfcheck: Optional[str] = None

    @property
    def env(self) -> str:
        return switch_env_of(self.name)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class PatchSpec:
    """Where an upstream function lives, what replaces it, and the switch that controls it.

    `adapter` ("module:function") is called once as `adapter(ours)` when the patch is applied and
    returns the function actually installed, for patches that need per-process facts the upstream
    call does not pass (e.g. the attention-TP rank); it must keep upstream's signature.
    `target_attr` is a module attribute (`"f"`) or a class attribute of one (`"Cls.method"`).
    """

    name: str  # unique key of the status records
    title: str  # for log lines
    switch: str  # the Switch that turns this patch on or off
    target_module: str
    target_attr: str
    ours_module: str
    ours_attr: str
    adapter: Optional[str] = None

    @property
    def switch_env(self) -> str:
        return switch_env_of(self.switch)

    @property
    def ours_function(self) -> str:
        return f"{self.ours_module}.{self.ours_attr}"

    @property
    def upstream_function(self) -> str:
        return f"{self.target_module}.{self.target_attr}"


SWITCHES: Tuple[Switch, ...] = (
    Switch("sparse_decode", "sparse-MLA decode",
           "Our Triton sparse-MLA decode attention in SGLang workers (on) or upstream's (off).",
           selfcheck="v4flash_kernels.attention.selfcheck"),
    Switch("moe", "MXFP4 MoE", "Our Triton routed-MXFP4 MoE experts in SGLang workers (on) or upstream's (off).",
           selfcheck="v4flash_kernels.moe.selfcheck"),
    Switch("indexer", "indexer logits", "Our Triton indexer logits in SGLang workers (on) or upstream's (off).",
           selfcheck="v4flash_kernels.indexer.selfcheck"),
    Switch("fp8_gemm", "block-FP8 linear",
           "Our Triton 128x128-block FP8 linears (activation quant fused) in SGLang workers (on) or upstream's (off)."),
)

SPARSE_DECODE = PatchSpec(
    name="sparse_decode",
    title="sparse-MLA decode",
    switch="sparse_decode",
    target_module="sglang.srt.layers.attention.flash_mla_sm120_triton",
    target_attr="flash_mla_sparse_decode_triton",
    ours_module="v4flash_kernels.attention.op",
    ours_attr="sparse_mla_decode",
    # At attention-TP > 1 only this rank's heads of the 64-head q are real: compute just those.
    adapter="v4flash_kernels.hook.tp_heads:make_tp_aware",
)

MOE = PatchSpec(
    name="moe",
    title="MXFP4 MoE",
    switch="moe",
    target_module="sglang.srt.layers.moe.fused_moe_triton.mxfp4_moe_sm120_triton",
    target_attr="mxfp4_moe_forward_triton",
    ours_module="v4flash_kernels.moe.op",
    ours_attr="mxfp4_moe_forward",
)

INDEXER = PatchSpec(
    name="indexer",
    title="indexer logits",
    switch="indexer",
    target_module="sglang.srt.layers.attention.dsv4.indexer",
    target_attr="fp8_paged_mqa_logits_torch_sm120",
    ours_module="v4flash_kernels.indexer.op",
    ours_attr="fp8_paged_mqa_logits",
)

# What SGLang's sm_120 FP8 dispatch (`dispatch_w8a8_block_fp8_linear`, Triton backend) hands every
# block-FP8 linear, looked up in the module at dispatch time: the quant + GEMM pair is replaced whole.
FP8_GEMM = PatchSpec(
    name="fp8_gemm",
    title="block-FP8 linear",
    switch="fp8_gemm",
    target_module="sglang.srt.layers.quantization.fp8_utils",
    target_attr="triton_w8a8_block_fp8_linear",
    ours_module="v4flash_kernels.fp8_gemm.op",
    ours_attr="w8a8_block_fp8_linear",
)

PATCHES: Tuple[PatchSpec, ...] = (SPARSE_DECODE, MOE, INDEXER, FP8_GEMM)


def by_name(name: str) -> PatchSpec:
    for p in PATCHES:
        if p.name == name:
            return p
    raise KeyError(f"unknown kernel patch {name!r}; known: {', '.join(p.name for p in PATCHES)}")


def switch_by_name(name: str) -> Switch:
    for s in SWITCHES:
        if s.name == name:
            return s
    raise KeyError(f"unknown kernel switch {name!r}; known: {', '.join(s.name for s in SWITCHES)}")


def patches_of(switch: str) -> Tuple[PatchSpec, ...]:
    """The patches one switch turns on or off, in registry order."""
    return tuple(p for p in PATCHES if p.switch == switch)
