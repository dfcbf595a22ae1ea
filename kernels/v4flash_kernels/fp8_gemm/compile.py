"""The block-FP8 binaries the entries can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def compile_fp8_gemm(binary: Any, arch: int) -> CompileResult:
    """One block-FP8 GEMM binary (`fp8_gemm.op.Binary`) as `fp8_gemm.op.launch` passes it."""
    from v4flash_kernels.fp8_gemm import kernel as k
    from v4flash_kernels.fp8_gemm.op import FIXUP_CODE

    cfg, quant_a = binary.config, binary.a_dtype != "fp8"
    split = binary.fixup != "whole"
    ptr = {"bf16": "*bf16", "fp32": "*fp32", "fp8": "*fp8e4nv"}
    sig = {"A": ptr[binary.a_dtype], "stride_am": "i32", "AS": "*fp32", "stride_asm": "i32",
           "stride_ask": "i32", "B": "*fp8e4nv", "stride_bn": "i32", "BS": "*fp32", "stride_bsn": "i32",
           "stride_bsk": "i32", "C": ptr[binary.c_dtype], "stride_cm": "i32",
           "WS": "*fp32" if split else ptr[binary.c_dtype], "stride_ws": "i32",
           "CNT": "*i32" if binary.fixup == "ticket" else "*fp32" if split else ptr[binary.c_dtype],
           "M": "i32", "N": "i32", "K": "i32", "groups_per_split": "i32"}
    const = {"QUANT_A": quant_a, "SWAP": cfg.swap, "FIXUP": FIXUP_CODE[binary.fixup], "SP": binary.sp,
             "EVEN_K": binary.even_k, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "GROUP_M": cfg.group_m}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_am", "stride_bn", "stride_cm", "N"]
    if binary.even_k:
        hinted.append("K")
    ck = compile_kernel(k.gemm_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("fp8_gemm", binary.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def compile_fp8_gemv(binary: Any, arch: int) -> CompileResult:
    """One block-FP8 GEMV binary (`fp8_gemm.op.GemvBinary`) as `fp8_gemm.op.launch_gemv` passes it."""
    from v4flash_kernels.fp8_gemm import kernel as k

    ptr = {"bf16": "*bf16", "fp32": "*fp32"}
    sig = {"X": ptr[binary.x_dtype], "stride_xm": "i32", "B": "*fp8e4nv", "stride_bn": "i32", "BS": "*fp32",
           "stride_bsn": "i32", "stride_bsk": "i32", "C": ptr[binary.c_dtype], "stride_cm": "i32", "M": "i32",
           "N": "i32"}
    const = {"BM": binary.bm, "BLOCK_N": binary.config.block_n, "K": binary.k}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_xm", "stride_bn", "stride_cm"]
    ck = compile_kernel(k.gemv_kernel, sig, const, hinted, arch, binary.config.num_warps, 1)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("fp8_gemv", binary.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def binaries(arch: int) -> List[CompileResult]:
    """Every block-FP8 binary the entries can launch: the GEMM tiles with each fix-up, the GEMVs,
    the split-K reduce and the standalone activation quant."""
    from v4flash_kernels.fp8_gemm import kernel as k
    from v4flash_kernels.fp8_gemm.op import (
        QUANT_BLOCK_R,
        QUANT_NUM_WARPS,
        REDUCE_BLOCK,
        REDUCE_NUM_WARPS,
        launchable,
        launchable_gemv,
        launchable_reduce,
    )

    results = [compile_fp8_gemm(b, arch) for b in launchable()]
    results += [compile_fp8_gemv(b, arch) for b in launchable_gemv()]
    for sp in launchable_reduce():
        for c in ("bf16", "fp32"):
            sig = {"WS": "*fp32", "C": f"*{c}", "stride_cm": "i32", "total": "i32", "N": "i32", "S": "i32"}
            ck = compile_kernel(k.reduce_kernel, sig, {"SP": sp, "BLOCK": REDUCE_BLOCK}, ["WS", "C", "stride_cm"], arch,
                          REDUCE_NUM_WARPS, 1)
            regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
            results.append(CompileResult("fp8_reduce", f"sp{sp}_b{REDUCE_BLOCK}_w{REDUCE_NUM_WARPS}/{c}", arch,
                                         int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch]))
    for x in ("bf16", "fp32"):
        sig = {"X": f"*{x}", "stride_xm": "i32", "Q": "*fp8e4nv", "stride_qm": "i32", "S": "*fp32",
               "stride_sm": "i32", "M": "i32"}
        hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_xm", "stride_qm"]
        ck = compile_kernel(k.act_quant_kernel, sig, {"BLOCK_R": QUANT_BLOCK_R}, hinted, arch, QUANT_NUM_WARPS, 1)
        regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
        results.append(CompileResult("fp8_act_quant", f"r{QUANT_BLOCK_R}_w{QUANT_NUM_WARPS}/{x}", arch,
                                     int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch]))
    return results
