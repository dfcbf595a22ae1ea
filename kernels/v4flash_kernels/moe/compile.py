"""The MoE binaries the planners can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, Dict, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def _moe_gemm_signature(scale_mode: int) -> Dict[str, Any]:
    from v4flash_kernels.moe.kernel import SCALE_F32

    return {"A": "*bf16", "stride_am": "i32", "W": "*u8", "stride_we": "i64", "stride_wn": "i32",
            "SC": "*fp32" if scale_mode == SCALE_F32 else "*u8", "stride_se": "i64", "stride_sn": "i32", "OUT": "*bf16",
            "stride_om": "i32", "IDS": "*i32", "TW": "*fp32", "SORTED": "*i32", "BLK_E": "*i32", "BLK_R": "*i32",
            "S": "i32", "N": "i32", "KD": "i32", "A_DIV": "i32", "clamp_limit": "fp32", "out_scale": "fp32",
            "stride_ap": "i32"}


def compile_moe_gemm(cfg: Any, gated: bool, inline: bool, scale_mode: int, arch: int, nibbles: int = 0) -> CompileResult:
    """One MoE GEMM binary; inline grouping at its largest slot block (the most registers)."""
    import triton
    import triton.language as tl

    from v4flash_kernels.moe import kernel as k
    from v4flash_kernels.moe.op import INLINE_MAX_SLOTS

    const = {"GATED": gated, "HAS_CLAMP": True, "INLINE": inline,
                 "BLOCK_S": triton.next_power_of_2(INLINE_MAX_SLOTS) if inline else 1, "BLOCK_M": cfg.block_m,
                 "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SCALE_MODE": scale_mode, "DEQ_ASM": True,
                 "DOT_DTYPE": tl.bfloat16, "SPLIT_K": cfg.split_k, "A_PARTS": 0, "MODE": cfg.mode, "NIBBLES": nibbles}
    sig = _moe_gemm_signature(scale_mode)
    if nibbles == 1:
        sig["W"] = "*i32"  # PAIR_SPLIT words
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_am", "stride_we", "stride_wn", "stride_se",
                                                                 "stride_sn", "stride_om", "KD"]
    ck = compile_kernel(k.gemm_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    scales = {k.SCALE_FAST: "fast", k.SCALE_F32: "f32", k.SCALE_E8M0: "e8m0"}[scale_mode] + ("/pairsplit" if nibbles else "")
    name = f"{'w13' if gated else 'w2'}/{'inline' if inline else 'sorted'}/{scales}/{cfg.name}"
    return CompileResult("moe_gemm", name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def compile_moe_aux(arch: int) -> List[CompileResult]:
    """The MoE routing-prep kernels and the top-k combine, as moe.py launches them."""
    import triton

    from v4flash_kernels.moe import kernel as k
    from v4flash_kernels.moe import op as moe

    e_p2 = triton.next_power_of_2(256)
    from v4flash_kernels.moe import repacked_op

    bms = sorted({c.block_m for c, _, inline in moe.launchable() if not inline}
                 | {c.block_t for c, _, inline in repacked_op.launchable() if not inline})  # v2 sorts into BLOCK_T rows
    jobs = [("moe_hist", k.hist_kernel, {"IDS": "*i32", "HIST": "*i32", "RANK": "*i32", "S": "i32", "E": "i32"},
             {"CHUNK": moe.PREP_CHUNK, "E_P2": e_p2}, 8, "")]
    for bm in bms:
        jobs.append(("moe_scan", k.scan_kernel, {"HIST": "*i32", "OFFS": "*i32", "BLK_E": "*i32", "BLK_R": "*i32",
                                                 "NCH": "i32", "E": "i32", "NB": "i32"},
                     {"BLOCK_M": bm, "E_P2": e_p2, "CB": moe.PREP_SCAN_CB, "BB": moe.PREP_SCAN_BB}, 8, f"m{bm}"))
    jobs.append(("moe_scatter", k.scatter_kernel, {"IDS": "*i32", "HIST": "*i32", "RANK": "*i32", "OFFS": "*i32",
                                                   "SORTED": "*i32", "S": "i32", "E": "i32"},
                 {"CHUNK": moe.PREP_CHUNK}, 4, ""))
    jobs.append(("moe_combine", k.combine_kernel, {"DOWN": "*bf16", "IDS": "*i32", "OUT": "*bf16", "stride_om": "i32",
                                                   "K": "i32"},
                 {"TOPK": 6, "BLOCK": moe.COMBINE_BLOCK}, moe.COMBINE_NUM_WARPS, ""))
    out = []
    for kernel, fn, sig, const, warps, tag in jobs:
        hinted = [n for n, t in sig.items() if t.startswith("*")]
        ck = compile_kernel(fn, sig, const, hinted, arch, warps, 1)
        regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
        out.append(CompileResult(kernel, tag or f"w{warps}", arch, int(ck.metadata.shared), regs, st, ld,
                                 SMEM_LIMIT[arch]))
    return out


def compile_moe_v2(cfg: Any, gated: bool, inline: bool, arch: int) -> CompileResult:
    """One v2 (repacked experts) MoE GEMM binary; inline grouping at its largest slot block."""
    import triton
    import triton.language as tl

    from v4flash_kernels.moe import repacked_kernel as k
    from v4flash_kernels.moe.kernel import SCALE_FAST
    from v4flash_kernels.moe.repacked_op import INLINE_MAX_SLOTS

    split = gated and cfg.split_k > 1
    const = {"GATED": gated, "HAS_CLAMP": True, "INLINE": inline,
             "BLOCK_S": triton.next_power_of_2(INLINE_MAX_SLOTS) if inline else 1, "BLOCK_T": cfg.block_t,
             "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "DEQ_ASM": True, "DOT_DTYPE": tl.bfloat16,
             "SPLIT_K": cfg.split_k if gated else 1}
    sig = _moe_gemm_signature(SCALE_FAST)
    sig.pop("stride_ap")
    sig["W"] = "*i32"  # PAIR_SPLIT words
    if split:
        sig.update({"WS": "*fp32", "CNT": "*i32"})
    else:
        const.update({"WS": None, "CNT": None})
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_am", "stride_we", "stride_wn", "stride_se",
                                                                 "stride_sn", "stride_om", "KD"]
    ck = compile_kernel(k.mma_gemm_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    name = f"{'w13' if gated else 'w2'}/{'inline' if inline else 'sorted'}/{cfg.name}"
    return CompileResult("moe_v2_gemm", name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def binaries(arch: int) -> List[CompileResult]:
    """Every MoE binary the planners can launch plus the helper kernels: v1 in the drop-in's scale
    modes, v1's prefill tiles and the v2 GEMMs on the repacked layers (fast scales, PAIR_SPLIT)."""
    from v4flash_kernels.moe import repacked_op
    from v4flash_kernels.moe.kernel import SCALE_E8M0, SCALE_F32, SCALE_FAST
    from v4flash_kernels.moe.op import launchable

    results = [compile_moe_gemm(cfg, gated, inline, mode, arch)
               for cfg, gated, inline in launchable() for mode in (SCALE_F32, SCALE_E8M0)]
    results += [compile_moe_gemm(cfg, gated, inline, SCALE_FAST, arch, nibbles=1)
                for cfg, gated, inline in repacked_op.launchable_v1()]
    results += [compile_moe_v2(cfg, gated, inline, arch) for cfg, gated, inline in repacked_op.launchable()]
    return results + compile_moe_aux(arch)
