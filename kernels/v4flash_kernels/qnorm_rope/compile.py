"""The fused q-path binaries the drop-in can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def compile_qnorm_rope(cfg: Any, arch: int) -> CompileResult:
    """One `qnorm_rope_kernel` binary (`qnorm_rope.op.QConfig`) as `qnorm_rope.op.launch` passes it: bf16 in
    and out, int64 positions (int32 compiles the same code with a narrower load), K = `FUSED_K`."""
    from v4flash_kernels.qnorm_rope import kernel as k
    from v4flash_kernels.qnorm_rope.op import BM, FUSED_K, HEAD_DIM, ROPE_DIM

    sig = {"X": "*bf16", "B": "*fp8e4nv", "BS": "*fp32", "FREQ": "*fp32", "stride_fp": "i32", "POS": "*i64",
           "OUT": "*bf16", "stride_om": "i32", "M": "i32", "eps": "fp32"}
    const = {"K": FUSED_K, "HEAD_DIM": HEAD_DIM, "ROPE": ROPE_DIM, "BM": BM, "BLOCK_K": cfg.block_k}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_fp", "stride_om"]
    ck = compile_kernel(k.qnorm_rope_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("qnorm_rope", cfg.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def binaries(arch: int) -> List[CompileResult]:
    """Every fused q-path binary: the plan's config and the sweep's candidates (`qnorm_rope.op.launchable`)."""
    from v4flash_kernels.qnorm_rope.op import launchable

    return [compile_qnorm_rope(cfg, arch) for cfg in launchable()]
