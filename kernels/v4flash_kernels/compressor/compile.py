"""The fused compressor binaries the drop-in can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def compile_plan(plan: Any, arch: int) -> CompileResult:
    """One `compressor_decode_kernel` binary as `op.compress_decode` launches it for `plan`."""
    from v4flash_kernels.compressor import kernel as k

    sig = {"X": "*bf16", "stride_x": "i32", "W": "*bf16", "PLAN": "*i32", "STATE": "*fp32", "APE": "*fp32",
           "NORM_W": "*fp32", "eps": "fp32", "FREQS": "*fp32", "stride_f": "i32", "OUT_LOC": "*i32", "CACHE": "*u8",
           "CACHE_W": "*fp32" if plan.indexer else "*bf16", "page_bytes": "i32", "page_bits": "i32",
           "POOLED": "*fp32", "CNT": "*i32", "T": "i32"}
    const = {"K": plan.k, "HD": plan.head_dim, "RATIO": plan.ratio, "INDEXER": plan.indexer, "BD": plan.bd,
             "ROWS_PAD": plan.rows_pad, "BK": plan.bk, "BLOCK_T": plan.block_t, "EPI_T": plan.epi_t,
             "MMA": plan.mma, "INTERPRET": False}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_x", "stride_f", "page_bytes"]
    ck = compile_kernel(k.compressor_decode_kernel, sig, const, hinted, arch, plan.num_warps, plan.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("compressor_decode", plan.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def binaries(arch: int) -> List[CompileResult]:
    """Every plan the drop-in can launch (`op.launchable`: the attention c4 and c128, the indexer's c4, each
    on the CUDA cores (<= 4 rows) and on the tensor cores (5-16 rows))."""
    from v4flash_kernels.compressor.op import launchable

    return [compile_plan(p, arch) for p in launchable()]
