"""The kernel patches the import hook knows: one entry per sm_120 fallback we replace.

Each patch is independent: its own switch, its own decision (version, presence, signature), its
own status record. Adding a patch is adding an entry here (and its module name to
`hook_boot.TARGET_MODULES`, which must stay import-free); `hook` does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class PatchSpec:
    """Where an upstream function lives, what replaces it, and the switch that controls it.

    `adapter` ("module:function") is called once as `adapter(ours)` when the patch is applied and
    returns the function actually installed, for patches that need per-process facts the upstream
    call does not pass (e.g. the attention-TP rank); it must keep upstream's signature.

    `selfcheck` names the module whose `cases(target)` check ours against its fp64 reference and
    upstream on a GPU before workers start (`python -m v4flash_kernels.selfcheck`); None = the
    patch has no self-check yet, and the launcher says so instead of vouching for it.
    """

    name: str  # short key: status records, launcher config keys
    title: str  # for log lines
    switch_env: str
    target_module: str
    target_attr: str
    ours_module: str
    ours_attr: str
    adapter: Optional[str] = None
    selfcheck: Optional[str] = None

    @property
    def ours_function(self) -> str:
        return f"{self.ours_module}.{self.ours_attr}"

    @property
    def upstream_function(self) -> str:
        return f"{self.target_module}.{self.target_attr}"


SPARSE_DECODE = PatchSpec(
    name="sparse_decode",
    title="sparse-MLA decode",
    switch_env="V4FLASH_SPARSE_DECODE",
    target_module="sglang.srt.layers.attention.flash_mla_sm120_triton",
    target_attr="flash_mla_sparse_decode_triton",
    ours_module="v4flash_kernels.attention.op",
    ours_attr="sparse_mla_decode",
    # At attention-TP > 1 only this rank's heads of the 64-head q are real: compute just those.
    adapter="v4flash_kernels.hook.tp_heads:make_tp_aware",
    selfcheck="v4flash_kernels.attention.selfcheck",
)

MOE = PatchSpec(
    name="moe",
    title="MXFP4 MoE",
    switch_env="V4FLASH_MOE",
    target_module="sglang.srt.layers.moe.fused_moe_triton.mxfp4_moe_sm120_triton",
    target_attr="mxfp4_moe_forward_triton",
    ours_module="v4flash_kernels.moe.op",
    ours_attr="mxfp4_moe_forward",
    selfcheck="v4flash_kernels.moe.selfcheck",
)

INDEXER = PatchSpec(
    name="indexer",
    title="indexer logits",
    switch_env="V4FLASH_INDEXER",
    target_module="sglang.srt.layers.attention.dsv4.indexer",
    target_attr="fp8_paged_mqa_logits_torch_sm120",
    ours_module="v4flash_kernels.indexer.op",
    ours_attr="fp8_paged_mqa_logits",
    selfcheck="v4flash_kernels.indexer.selfcheck",
)

PATCHES: Tuple[PatchSpec, ...] = (SPARSE_DECODE, MOE, INDEXER)


def by_name(name: str) -> PatchSpec:
    for p in PATCHES:
        if p.name == name:
            return p
    raise KeyError(f"unknown kernel patch {name!r}; known: {', '.join(p.name for p in PATCHES)}")
