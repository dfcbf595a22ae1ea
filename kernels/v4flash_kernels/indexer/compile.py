"""The indexer-logits binaries the planner can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def compile_indexer(cfg: Any, arch: int) -> CompileResult:
    """One indexer-logits binary as `indexer.run` launches it for SGLang (64 heads, fp8 q, fp16 MMA)."""
    from v4flash_kernels.indexer import kernel as k

    sig = {"Q": "*fp8e4nv", "stride_qb": "i32", "stride_qh": "i32", "K8": "*fp8e4nv", "KS": "*fp32",
           "stride_kp8": "i32", "stride_kps": "i32", "W": "*fp32", "stride_wb": "i32", "stride_wh": "i32",
           "SEQ": "*i32", "stride_sb": "i32", "PT": "*i32", "stride_pb": "i32", "OUT": "*fp32", "stride_ob": "i32",
           "H": "i32", "max_seq_len": "i32", "num_pages": "i32"}
    const = {"BLOCK_H": 64, "PAGES": cfg.pages, "FILL": cfg.fill, "DOT_F16": True}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_qb", "stride_qh", "stride_kp8", "stride_kps"]
    ck = compile_kernel(k.indexer_logits_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("indexer_logits", cfg.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch],
                         cfg.shared_bytes)


def binaries(arch: int) -> List[CompileResult]:
    from v4flash_kernels.indexer.op import CONFIGS

    return [compile_indexer(c, arch) for c in CONFIGS]
