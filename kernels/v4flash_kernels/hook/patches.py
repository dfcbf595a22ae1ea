"""The kernel patches: the one table the hook, the launcher's switches, doctor/status and the step bench read.

A *switch* is what a user turns on or off (`--<name>` / config `patches.<name>` / env `V4FLASH_<NAME>`);
a *patch* is one upstream function (or class attribute) we replace. A switch covers one or more
patches (e.g. a kernel and the load-time weight repack it needs), and each patch decides on its own
(version, presence, signature) with its own status record. Adding a kernel is adding its op folder,
its `Switch` (which names the folder's self-check, compile list and step-bench builders) and its
`PatchSpec`s here (and the target modules to `hook_boot.TARGET_MODULES`, which must stay import-free);
`hook`, `check_sm120`, the self-check and the step bench do the rest (docs/architecture.md has the
checklist). This module imports nothing: the torch-free launcher reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


def switch_env_of(switch: str) -> str:
    """The environment variable every worker process reads for a switch (one naming rule, no table)."""
    return "V4FLASH_" + switch.upper()


@dataclass(frozen=True)
class Switch:
    """One user-facing on/off for a kernel (one op folder); on unless the user says off.

    The op folder's contract, named here as module paths so that nothing is imported to read it:
    `selfcheck`: its `cases(target)` check this switch's kernels against their fp64 reference and
    upstream on each GPU before workers start (`python -m v4flash_kernels.selfcheck`, docs/selfcheck.md);
    None = no self-check yet, and the launcher says so instead of vouching for it. `compile`: its
    `binaries(arch)` compile every kernel config the op can launch (`python -m v4flash_kernels.check_sm120`).
    `step`: the step bench's builders of the op (`build(op, impl, l2, seed)`) and their references,
    on the bench side (`python -m v4flash_bench.step`). tests/kernels/test_registry.py holds every
    switch to all three. `scope`: "gpu" (each GPU checked on its own) or "group" (the
    check spans the GPUs of a worker, one process per GPU meeting as the TP group: the all-reduce).
    `verified_only`: on by default only where its self-check passed on this box: `plan` shows it
    pending (`auto`), `up` switches it on for the run once the check passed and leaves it off without
    one (`--no-selfcheck`). `default_on`: False where our own step bench measured the patch slower than
    what it replaces: it stays off unless asked for (the launcher's default, and a worker whose variable
    is unset), and the help says why.
    """

    name: str  # config key patches.<name>; launcher flag --<name with dashes>
    title: str  # for log lines and tables
    help: str  # the launcher flag's help, one sentence
    selfcheck: str | None = None
    compile: str | None = None
    step: str | None = None
    scope: str = "gpu"
    verified_only: bool = False
    default_on: bool = True
    # a fusion's kernel computes another op's work too (the q path fuses fp8_gemm's linear): the op
    # folders whose public `op` module it may import (to take the fused path only where that op serves)
    fuses: Tuple[str, ...] = ()

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
    `detail` ("module:function") returns a JSON-able dict added to the patch's status record while
    it is active (e.g. what a load-time hook did to each layer); its "summary" string, if any, is
    appended to the record's reason, which `status` prints.
    """

    name: str  # unique key of the status records
    title: str  # for log lines
    switch: str  # the Switch that turns this patch on or off
    target_module: str
    target_attr: str
    ours_module: str
    ours_attr: str
    adapter: str | None = None
    detail: str | None = None

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
           selfcheck="v4flash_kernels.attention.selfcheck", compile="v4flash_kernels.attention.compile",
           step="v4flash_bench.step.ops.attention"),
    Switch("moe", "MXFP4 MoE", "Our Triton routed-MXFP4 MoE experts in SGLang workers (on) or upstream's (off).",
           selfcheck="v4flash_kernels.moe.selfcheck", compile="v4flash_kernels.moe.compile",
           step="v4flash_bench.step.ops.moe"),
    Switch("indexer", "indexer logits", "Our Triton indexer logits in SGLang workers (on) or upstream's (off).",
           selfcheck="v4flash_kernels.indexer.selfcheck", compile="v4flash_kernels.indexer.compile",
           step="v4flash_bench.step.ops.indexer"),
    Switch("fp8_gemm", "block-FP8 linear",
           "Our Triton 128x128-block FP8 linears (activation quant fused) in SGLang workers (on) or upstream's (off).",
           selfcheck="v4flash_kernels.fp8_gemm.selfcheck", compile="v4flash_kernels.fp8_gemm.compile",
           step="v4flash_bench.step.ops.fp8_gemm"),
    Switch("mhc", "mHC pre/post",
           "Our Triton hyper-connection pre/post, fused across sub-layer boundaries, in SGLang workers (on) or "
           "upstream's sm_120 torch + TileLang path (off).",
           selfcheck="v4flash_kernels.mhc.selfcheck", compile="v4flash_kernels.mhc.compile",
           step="v4flash_bench.step.ops.mhc"),
    Switch("topk", "top-512 transform",
           "Our Triton top-512 of the indexer scores (with the page translation) in SGLang workers (on) or "
           "upstream's JIT kernel (off).", selfcheck="v4flash_kernels.topk.selfcheck",
           compile="v4flash_kernels.topk.compile", step="v4flash_bench.step.ops.topk"),
    Switch("qnorm_rope", "q norm + RoPE fusion",
           "DeepSeek-V4's q path after wq_b (block-FP8 GEMM, per-head RMSNorm, RoPE) as one Triton kernel at decode "
           "rows in SGLang workers, where wq_b runs our block-FP8 linear (on), or upstream's two kernels (off); "
           "off by default: at B=1 it measured 20.0 us against 9.5 for the two kernels it replaces (H200, "
           "docs/decode-step.md).",
           selfcheck="v4flash_kernels.qnorm_rope.selfcheck", compile="v4flash_kernels.qnorm_rope.compile",
           step="v4flash_bench.step.ops.qnorm_rope", fuses=("fp8_gemm",), default_on=False),
    Switch("allreduce", "IPC all-reduce",
           "Our CUDA-IPC one-/two-shot all-reduce for TP groups SGLang sends to NCCL (> 2 PCIe GPUs) (on) or NCCL "
           "(off); by default on only once its self-check passed across the TP group's GPUs in `up`.",
           selfcheck="v4flash_kernels.allreduce.selfcheck", compile="v4flash_kernels.allreduce.compile",
           step="v4flash_bench.step.ops.allreduce", scope="group", verified_only=True),
    Switch("compressor", "fused compressor",
           "Our one-kernel DeepSeek-V4 compressor decode step (wkv_gate GEMV, state ring, window pooling, norm + "
           "RoPE (+ Hadamard), FP8 cache store) in SGLang workers (on) or upstream's cuBLAS GEMM + JIT kernels (off).",
           selfcheck="v4flash_kernels.compressor.selfcheck", compile="v4flash_kernels.compressor.compile",
           step="v4flash_bench.step.ops.compressor"),
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

# The MoE switch also repacks the sm_120 layers' experts at load time and runs the decode kernel v2
# on them (v4flash_kernels/moe/sglang_patch.py). A layer is repacked only while moe_apply is installed
# (nothing else reads the repacked order); moe_apply sends every other layer to upstream's apply.
MOE_REPACK = PatchSpec(
    name="moe_repack",
    title="MXFP4 MoE load-time repack",
    switch="moe",
    target_module="sglang.srt.layers.quantization.mxfp4_marlin_moe",
    target_attr="Mxfp4MarlinMoEMethod.process_weights_after_loading",
    ours_module="v4flash_kernels.moe.sglang_patch",
    ours_attr="process_weights_after_loading",
    detail="v4flash_kernels.moe.sglang_patch:status_detail",
)

MOE_APPLY = PatchSpec(
    name="moe_apply",
    title="MXFP4 MoE repacked-layer dispatch",
    switch="moe",
    target_module="sglang.srt.layers.quantization.mxfp4_marlin_moe",
    target_attr="Mxfp4MarlinMoEMethod.apply",
    ours_module="v4flash_kernels.moe.sglang_patch",
    ours_attr="apply",
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


# DeepSeek-V4's hyper-connections (mHC). On sm_120 upstream runs `hc_pre` as torch + the TileLang
# Sinkhorn + torch (then its RMSNorm as a separate kernel) and `hc_post` as TileLang, and keeps its
# fused post+pre unreachable. The switch installs our two methods and our fused op, and then lets the
# model take its own fused structure (the enable check says yes only while our fused op is the one
# `deepseek_v4` calls, so a refused fused patch leaves the model unfused).
_DSV4 = "sglang.srt.models.deepseek_v4"
MHC_PRE = PatchSpec(name="mhc_pre", title="mHC pre", switch="mhc", target_module=_DSV4,
                    target_attr="DeepseekV4DecoderLayer.hc_pre", ours_module="v4flash_kernels.mhc.op",
                    ours_attr="hc_pre")
MHC_POST = PatchSpec(name="mhc_post", title="mHC post", switch="mhc", target_module=_DSV4,
                     target_attr="DeepseekV4DecoderLayer.hc_post", ours_module="v4flash_kernels.mhc.op",
                     ours_attr="hc_post")
MHC_FUSED = PatchSpec(name="mhc_fused", title="mHC fused post+pre", switch="mhc", target_module=_DSV4,
                      target_attr="mhc_fused_post_pre", ours_module="v4flash_kernels.mhc.op",
                      ours_attr="mhc_fused_post_pre")
MHC_FUSED_ON = PatchSpec(name="mhc_fused_on", title="mHC fused path enable", switch="mhc", target_module=_DSV4,
                         target_attr="_is_fused_mhc_post_pre_enabled", ours_module="v4flash_kernels.mhc.op",
                         ours_attr="fused_post_pre_enabled")

# The c4 indexer's top-K of the logits, page-translated: the indexer module imports the JIT wrapper
# by name (`from sglang.jit_kernel.dsv4 import topk_transform_512`) and calls that global at call
# time, so the name is replaced where it is resolved, in the indexer module.
TOPK = PatchSpec(
    name="topk",
    title="top-512 transform",
    switch="topk",
    target_module="sglang.srt.layers.attention.dsv4.indexer",
    target_attr="topk_transform_512",
    ours_module="v4flash_kernels.topk.op",
    ours_attr="topk_transform_512",
)

# DeepSeek-V4's q path after wq_a: `MQALayer._compute_q_b` runs `self.wq_b(q)` (the block-FP8 linear) and
# the JIT `fused_q_norm_rope`; the smallest method that encloses both, replaced whole (the fused kernel at
# decode rows where wq_b is our linear, upstream's method for everything else).
QNORM_ROPE = PatchSpec(
    name="qnorm_rope",
    title="q norm + RoPE fusion",
    switch="qnorm_rope",
    target_module=_DSV4,
    target_attr="MQALayer._compute_q_b",
    ours_module="v4flash_kernels.qnorm_rope.op",
    ours_attr="compute_q_b",
    detail="v4flash_kernels.qnorm_rope.op:status_detail",
)

# Where SGLang's all-reduce lands when no custom all-reduce takes it (NCCL: PyNccl in graphs,
# torch.distributed eagerly), found through the class at call time: the in-place method replaced whole.
ALLREDUCE = PatchSpec(
    name="allreduce",
    title="IPC all-reduce",
    switch="allreduce",
    target_module="sglang.srt.distributed.parallel_state",
    target_attr="GroupCoordinator._all_reduce_in_place",
    ours_module="v4flash_kernels.allreduce.op",
    ours_attr="group_all_reduce_in_place",
)

# The compressors (the attention c4 / c128 one and the c4 indexer's): on CUDA sglang runs them through
# compressor_v2's backend mixin (`SGLANG_OPT_USE_COMPRESSOR_V2` is on by default and on sm_120), whose
# `forward_unified` (the cuBLAS wkv_gate GEMM, the JIT compress and the JIT norm + RoPE + store) the model
# and the indexer reach under two class attributes. Both are replaced by the same drop-in, found through
# the backend's class at call time; it hands every call it does not fuse to upstream's `forward_unified`.
_COMPRESSOR_V2 = "sglang.srt.layers.attention.dsv4.compressor_v2"
COMPRESSOR_CORE = PatchSpec(name="compressor_core", title="fused compressor (attention)", switch="compressor",
                            target_module=_COMPRESSOR_V2, target_attr="CompressorBackendMixin.forward_core_compressor",
                            ours_module="v4flash_kernels.compressor.op", ours_attr="forward_unified")
COMPRESSOR_INDEXER = PatchSpec(name="compressor_indexer", title="fused compressor (indexer)", switch="compressor",
                               target_module=_COMPRESSOR_V2,
                               target_attr="CompressorBackendMixin.forward_indexer_compressor",
                               ours_module="v4flash_kernels.compressor.op", ours_attr="forward_unified")

PATCHES: Tuple[PatchSpec, ...] = (SPARSE_DECODE, MOE, MOE_REPACK, MOE_APPLY, INDEXER, FP8_GEMM, MHC_PRE, MHC_POST,
                                  MHC_FUSED, MHC_FUSED_ON, TOPK, QNORM_ROPE, ALLREDUCE, COMPRESSOR_CORE,
                                  COMPRESSOR_INDEXER)


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
