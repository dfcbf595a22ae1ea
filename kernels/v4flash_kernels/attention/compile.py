"""The sparse-MLA decode binaries the dispatcher can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def _split_signature() -> Dict[str, Any]:
    sig = {"Q": "*bf16", "stride_qb": "i32", "stride_qh": "i32"}
    for c in "AB":
        sig.update({
            f"K8_{c}": "*fp8e4nv", f"KS_{c}": "*i64", f"KBF_{c}": "*bf16", f"IDX_{c}": "*i32",
            f"LEN_{c}": "*i32", f"W_{c}": "i32", f"PS_{c}": "i32", f"PB_{c}": "i32", f"SI_{c}": "i32",
        })
    sig.update({"WS_O": "*fp32", "WS_L": "*fp32", "H": "i32", "S_A": "i32", "NS": "i32",
                "CHUNK": "i32", "qk_scale": "fp32", "OUT": "*bf16", "stride_ob": "i32", "stride_oh": "i32",
                "LSE": "*fp32", "stride_lb": "i32", "SINK": "*fp32", "CNT": "*i32"})
    return sig


def compile_split(cfg: Any, arch: int, epilogue: int = 1) -> CompileResult:
    """One split-kernel binary; `epilogue` 0 = partials for the combine kernel, 1 = cooperative
    merge, 2 = one split finishes the row (see decode.epilogue_for)."""
    import triton.language as tl

    from v4flash_kernels.attention import kernel as k
    from v4flash_kernels.attention.op import MERGE_COLS, merge_splits_per_load

    const = {"HAS_LEN_A": True, "HAS_LEN_B": True, "BLOCK_H": cfg.block_h,
             "BLOCK_T": cfg.block_t,
             "KSPLIT": cfg.ksplit,
             "DOT_DTYPE": tl.float16 if getattr(cfg, "f16", False) else tl.bfloat16, "EPILOGUE": epilogue,
             "HAS_SINK": True,
             "MERGE_SB": merge_splits_per_load(cfg), "MERGE_COLS": MERGE_COLS}
    sig = _split_signature()
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_qb", "stride_qh", "CHUNK", "stride_ob",
                                                                 "stride_oh", "stride_lb"]
    ck = compile_kernel(k.split_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    expected = cfg.shared_bytes_sm90 if arch == 90 and cfg.shared_bytes_sm90 else cfg.shared_bytes
    return CompileResult("split_kernel", f"{cfg.name}/e{epilogue}", arch, int(ck.metadata.shared), regs, st, ld,
                         SMEM_LIMIT[arch], expected)


def compile_combine(arch: int) -> CompileResult:
    from v4flash_kernels.attention import kernel as k
    from v4flash_kernels.attention.op import COMBINE_NUM_WARPS, COMBINE_SPLIT_BLOCK

    sig = {"WS_O": "*fp32", "WS_L": "*fp32", "OUT": "*bf16", "stride_ob": "i32", "stride_oh": "i32",
           "LSE": "*fp32", "stride_lb": "i32", "SINK": "*fp32", "H": "i32", "NS": "i32"}
    const = {"HAS_SINK": True, "SPLIT_BLOCK": COMBINE_SPLIT_BLOCK}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_ob", "stride_oh"]
    ck = compile_kernel(k.combine_kernel, sig, const, hinted, arch, COMBINE_NUM_WARPS, 1)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    name = f"sb{COMBINE_SPLIT_BLOCK}_w{COMBINE_NUM_WARPS}"
    return CompileResult("combine_kernel", name, arch, int(ck.metadata.shared), regs, st, ld,
                         SMEM_LIMIT[arch])


def binaries(arch: int, configs: Sequence[Any] | None = None) -> List[CompileResult]:
    """Every split-kernel config of the dispatcher's table (or `configs`) with each epilogue it can
    take, and the combine kernel."""
    from v4flash_kernels.attention.op import SPLIT_CONFIGS, launchable_epilogues

    out = [compile_split(cfg, arch, epilogue) for cfg in (configs if configs is not None else SPLIT_CONFIGS)
           for epilogue in launchable_epilogues(cfg)]
    return out + [compile_combine(arch)]
