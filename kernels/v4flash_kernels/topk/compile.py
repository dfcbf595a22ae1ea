"""The top-K transform binaries the planner can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def compile_topk(cfg: Any, k: int, spec: bool, ptb: int, arch: int) -> CompileResult:
    """One top-K transform binary as `topk.run` launches it (raw indices written too)."""
    from v4flash_kernels.topk import kernel as tk

    sig = {"SC": "*fp32", "stride_sb": "i32", "SEQ": "*i32", "PT": "*i32", "stride_pb": "i32", "pt_cols": "i32",
           "OUT": "*i32", "RAW": "*i32", "WS": "*i64", "AUX": "*i32", "B": "i32", "W": "i32", "page_bits": "i32"}
    const = {"K": k, "CAP": cfg.cap * k // 512, "SMALL": cfg.small, "SPEC": spec, "PTB": ptb, "HAS_RAW": True}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_sb", "stride_pb"]
    ck = compile_kernel(tk.topk_transform_kernel, sig, const, hinted, arch, cfg.num_warps, 1)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    name = f"{cfg.name}/k{k}{'_spec' if spec else ''}_pt{ptb}"
    return CompileResult("topk_transform", name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def binaries(arch: int) -> List[CompileResult]:
    """Every top-K binary the planner can launch (`topk.op.launch_variants` of each config)."""
    from v4flash_kernels.topk.op import CONFIGS, launch_variants

    return [compile_topk(cfg, k, spec, ptb, arch) for cfg in CONFIGS for k, spec, ptb in launch_variants()]
