"""Cross-compile every kernel config the dispatcher can launch for sm_120 and sm_90, no GPU needed.

Why: `triton.compile` does not fail when a config needs more shared memory than the target has
(that is only checked when a GPU loads the binary), and a config that fits Hopper's 227 KB can be
far over sm_120's 99 KB. So CI compiles each config in `decode.SPLIT_CONFIGS` (and the combine
kernel, the MoE, indexer, block-FP8 GEMM, fused q path and all-reduce kernels) and fails on more than 101376 B of
shared memory per block on sm_120 or any register spill, reading registers and spills from the bundled
ptxas. The all-reduce kernels' PTX must also carry the memory scopes their flag protocol relies on.

    python -m v4flash_kernels.check_sm120 [--arch 120 --arch 90] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Iterable, List, Sequence

SMEM_LIMIT = {120: 101376, 90: 232448}


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    config: str
    arch: int
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    smem_limit: int

    expected_shared: int = 0  # the table's recorded value (0 = not recorded)
    ptx_problem: str = ""  # what the PTX lacks (the all-reduce's memory scopes); "" = fine or not checked

    @property
    def ok(self) -> bool:
        recorded = self.expected_shared in (0, self.shared_bytes)
        return (recorded and self.shared_bytes <= self.smem_limit and self.spill_stores == 0 and self.spill_loads == 0
                and not self.ptx_problem)


def _ptxas_stats(ptx: str, arch: int) -> tuple:
    """Run the ptxas Triton bundles (ptxas-blackwell for sm_120) with -v; return regs, spills."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    gpu = f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.o")],
            capture_output=True, text=True, check=True, timeout=600,
        )
    log = proc.stdout + proc.stderr
    used = re.search(r"Used (\d+) registers", log)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if used is None or m is None:
        # A ptxas whose -v report changed format: show what it printed instead of failing on None.group.
        raise RuntimeError(f"{ptxas} -v --gpu-name={gpu}: no register/spill report in its output:\n{log}")
    return int(used.group(1)), int(m.group(1)), int(m.group(2))


def _compile(fn, signature: dict, constexprs: dict, hinted: Sequence[str], arch: int, num_warps: int,
             num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _split_signature() -> dict:
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


def compile_split(cfg, arch: int, epilogue: int = 1) -> CompileResult:
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
    ck = _compile(k.split_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
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
    ck = _compile(k.combine_kernel, sig, const, hinted, arch, COMBINE_NUM_WARPS, 1)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    name = f"sb{COMBINE_SPLIT_BLOCK}_w{COMBINE_NUM_WARPS}"
    return CompileResult("combine_kernel", name, arch, int(ck.metadata.shared), regs, st, ld,
                         SMEM_LIMIT[arch])


def _moe_gemm_signature(scale_mode: int) -> dict:
    from v4flash_kernels.moe.kernel import SCALE_F32

    return {"A": "*bf16", "stride_am": "i32", "W": "*u8", "stride_we": "i64", "stride_wn": "i32",
            "SC": "*fp32" if scale_mode == SCALE_F32 else "*u8", "stride_se": "i64", "stride_sn": "i32", "OUT": "*bf16",
            "stride_om": "i32", "IDS": "*i32", "TW": "*fp32", "SORTED": "*i32", "BLK_E": "*i32", "BLK_R": "*i32",
            "S": "i32", "N": "i32", "KD": "i32", "A_DIV": "i32", "clamp_limit": "fp32", "out_scale": "fp32",
            "stride_ap": "i32"}


def compile_moe_gemm(cfg, gated: bool, inline: bool, scale_mode: int, arch: int, nibbles: int = 0) -> CompileResult:
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
    ck = _compile(k.gemm_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    scales = {k.SCALE_FAST: "fast", k.SCALE_F32: "f32", k.SCALE_E8M0: "e8m0"}[scale_mode] + ("/pairsplit" if nibbles else "")
    name = f"{'w13' if gated else 'w2'}/{'inline' if inline else 'sorted'}/{scales}/{cfg.name}"
    return CompileResult("moe_gemm", name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def compile_moe_aux(arch: int) -> List[CompileResult]:
    """The MoE routing-prep kernels and the top-k combine, as moe.py launches them."""
    import triton

    from v4flash_kernels.moe import kernel as k
    from v4flash_kernels.moe import op as moe

    e_p2 = triton.next_power_of_2(256)
    from v4flash_kernels.moe import op_v2

    bms = sorted({c.block_m for c, _, inline in moe.launchable() if not inline}
                 | {c.block_t for c, _, inline in op_v2.launchable() if not inline})  # v2 sorts into BLOCK_T rows
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
        ck = _compile(fn, sig, const, hinted, arch, warps, 1)
        regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
        out.append(CompileResult(kernel, tag or f"w{warps}", arch, int(ck.metadata.shared), regs, st, ld,
                                 SMEM_LIMIT[arch]))
    return out


def compile_moe_v2(cfg, gated: bool, inline: bool, arch: int) -> CompileResult:
    """One v2 (repacked experts) MoE GEMM binary; inline grouping at its largest slot block."""
    import triton
    import triton.language as tl

    from v4flash_kernels.moe import kernel_v2 as k
    from v4flash_kernels.moe.kernel import SCALE_FAST
    from v4flash_kernels.moe.op_v2 import INLINE_MAX_SLOTS

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
    ck = _compile(k.mma_gemm_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    name = f"{'w13' if gated else 'w2'}/{'inline' if inline else 'sorted'}/{cfg.name}"
    return CompileResult("moe_v2_gemm", name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def check_moe(arch: int) -> List[CompileResult]:
    """Every MoE binary the planners can launch plus the helper kernels: v1 in the drop-in's scale
    modes, v1's prefill tiles and the v2 GEMMs on the repacked layers (fast scales, PAIR_SPLIT)."""
    from v4flash_kernels.moe import op_v2
    from v4flash_kernels.moe.kernel import SCALE_E8M0, SCALE_F32, SCALE_FAST
    from v4flash_kernels.moe.op import launchable

    results = [compile_moe_gemm(cfg, gated, inline, mode, arch)
               for cfg, gated, inline in launchable() for mode in (SCALE_F32, SCALE_E8M0)]
    results += [compile_moe_gemm(cfg, gated, inline, SCALE_FAST, arch, nibbles=1)
                for cfg, gated, inline in op_v2.launchable_v1()]
    results += [compile_moe_v2(cfg, gated, inline, arch) for cfg, gated, inline in op_v2.launchable()]
    return results + compile_moe_aux(arch)


def compile_indexer(cfg, arch: int) -> CompileResult:
    """One indexer-logits binary as `indexer.run` launches it for SGLang (64 heads, fp8 q, fp16 MMA)."""
    from v4flash_kernels.indexer import kernel as k

    sig = {"Q": "*fp8e4nv", "stride_qb": "i32", "stride_qh": "i32", "K8": "*fp8e4nv", "KS": "*fp32",
           "stride_kp8": "i32", "stride_kps": "i32", "W": "*fp32", "stride_wb": "i32", "stride_wh": "i32",
           "SEQ": "*i32", "stride_sb": "i32", "PT": "*i32", "stride_pb": "i32", "OUT": "*fp32", "stride_ob": "i32",
           "H": "i32", "max_seq_len": "i32", "num_pages": "i32"}
    const = {"BLOCK_H": 64, "PAGES": cfg.pages, "FILL": cfg.fill, "DOT_F16": True}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_qb", "stride_qh", "stride_kp8", "stride_kps"]
    ck = _compile(k.indexer_logits_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("indexer_logits", cfg.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch],
                         cfg.shared_bytes)


def mhc_mix_config(plan, fused: bool, norm: bool) -> str:
    """The compiled variant of a mix plan (its split count is a run-time value); one launch: `_k` tokens
    per ticketed block, with or without the norm."""
    name = f"{'fused' if fused else 'pre'}/t{plan.block_t}_h{plan.block_h}_w{plan.num_warps}"
    return name + (f"_k{plan.tokens}{'_norm' if norm else ''}" if plan.one_launch else "")


def check_mhc(arch: int, hidden: int = 4096) -> List[CompileResult]:
    """The mHC kernels as `mhc.op` launches them: every mix plan (pre and fused; the one-launch decode
    plans with and without the norm), the finish kernel for every partial count a two-launch plan can
    produce (with and without the norm), the post kernel."""
    import triton

    from v4flash_kernels.mhc import kernel as k
    from v4flash_kernels.mhc import op as mhc

    out = []
    mix_sig = {"X": "*bf16", "XIN": "*bf16", "POST_IN": "*fp32", "COMB_IN": "*fp32", "R_OUT": "*bf16",
               "FN": "*fp32", "PART": "*fp32", "CNT": "*i32", "SCALE": "*fp32", "BASE": "*fp32", "POST": "*fp32",
               "COMB": "*fp32", "Y": "*bf16", "NORM_W": "*bf16", "n_tokens": "i32", "h_per_split": "i32",
               "rms_eps": "fp32", "pre_eps": "fp32", "sinkhorn_eps": "fp32", "post_mult": "fp32", "norm_eps": "fp32",
               "iters": "i32"}
    hinted = [n for n, t in mix_sig.items() if t.startswith("*")] + ["h_per_split"]
    for plan in mhc.launchable(hidden):
        for fused in (False, True):
            for norm in ((False, True) if plan.one_launch else (False,)):
                const = {"H": hidden, "BLOCK_T": plan.block_t, "TOKENS": plan.block_tokens, "BLOCK_H": plan.block_h,
                         "FUSED": fused, "FINISH": plan.one_launch, "INTERPRET": False}
                if plan.one_launch:
                    const.update(BLOCK_HF=triton.next_power_of_2(hidden), HAS_NORM=norm)
                else:
                    const.update(mhc.MIX_ONLY)
                ck = _compile(k.mix_kernel, mix_sig, const, hinted, arch, plan.num_warps, 1)
                regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
                out.append(CompileResult("mhc_mix", mhc_mix_config(plan, fused, norm), arch, int(ck.metadata.shared),
                                         regs, st, ld, SMEM_LIMIT[arch]))
    fin_sig = {"PART": "*fp32", "n_tokens": "i32", "n_splits": "i32", "X": "*bf16", "SCALE": "*fp32",
               "BASE": "*fp32", "POST": "*fp32", "COMB": "*fp32", "Y": "*bf16", "NORM_W": "*bf16",
               "rms_eps": "fp32", "pre_eps": "fp32", "sinkhorn_eps": "fp32", "post_mult": "fp32", "norm_eps": "fp32",
               "iters": "i32"}
    warps = {p.finish_warps for p in mhc.launchable(hidden)}
    s_pads = sorted({triton.next_power_of_2(s) for s in mhc.launchable_splits(hidden)})
    for w in sorted(warps):
        for s_pad in s_pads:
            for norm in (False, True):
                const = {"H": hidden, "BLOCK_H": triton.next_power_of_2(hidden), "S_PAD": s_pad,
                         "HAS_NORM": norm, "INTERPRET": False}
                ck = _compile(k.finish_kernel, fin_sig, const, [n for n, t in fin_sig.items() if t.startswith("*")],
                              arch, w, 1)
                regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
                out.append(CompileResult("mhc_finish", f"s{s_pad}{'_norm' if norm else ''}_w{w}", arch,
                                         int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch]))
    post_sig = {"XIN": "*bf16", "RES": "*bf16", "POST": "*fp32", "COMB": "*fp32", "OUT": "*bf16"}
    const = {"H": hidden, "BLOCK_H": min(mhc.POST_BLOCK_H, triton.next_power_of_2(hidden)), "INTERPRET": False}
    ck = _compile(k.post_kernel, post_sig, const, list(post_sig), arch, mhc.POST_NUM_WARPS, 1)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    out.append(CompileResult("mhc_post", f"h{const['BLOCK_H']}_w{mhc.POST_NUM_WARPS}", arch, int(ck.metadata.shared),
                             regs, st, ld, SMEM_LIMIT[arch]))
    return out


def compile_fp8_gemm(binary, arch: int) -> CompileResult:
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
    ck = _compile(k.gemm_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("fp8_gemm", binary.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def compile_fp8_gemv(binary, arch: int) -> CompileResult:
    """One block-FP8 GEMV binary (`fp8_gemm.op.GemvBinary`) as `fp8_gemm.op.launch_gemv` passes it."""
    from v4flash_kernels.fp8_gemm import kernel as k

    ptr = {"bf16": "*bf16", "fp32": "*fp32"}
    sig = {"X": ptr[binary.x_dtype], "stride_xm": "i32", "B": "*fp8e4nv", "stride_bn": "i32", "BS": "*fp32",
           "stride_bsn": "i32", "stride_bsk": "i32", "C": ptr[binary.c_dtype], "stride_cm": "i32", "M": "i32",
           "N": "i32"}
    const = {"BM": binary.bm, "BLOCK_N": binary.config.block_n, "K": binary.k}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_xm", "stride_bn", "stride_cm"]
    ck = _compile(k.gemv_kernel, sig, const, hinted, arch, binary.config.num_warps, 1)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("fp8_gemv", binary.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def check_fp8_gemm(arch: int) -> List[CompileResult]:
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
            ck = _compile(k.reduce_kernel, sig, {"SP": sp, "BLOCK": REDUCE_BLOCK}, ["WS", "C", "stride_cm"], arch,
                          REDUCE_NUM_WARPS, 1)
            regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
            results.append(CompileResult("fp8_reduce", f"sp{sp}_b{REDUCE_BLOCK}_w{REDUCE_NUM_WARPS}/{c}", arch,
                                         int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch]))
    for x in ("bf16", "fp32"):
        sig = {"X": f"*{x}", "stride_xm": "i32", "Q": "*fp8e4nv", "stride_qm": "i32", "S": "*fp32",
               "stride_sm": "i32", "M": "i32"}
        hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_xm", "stride_qm"]
        ck = _compile(k.act_quant_kernel, sig, {"BLOCK_R": QUANT_BLOCK_R}, hinted, arch, QUANT_NUM_WARPS, 1)
        regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
        results.append(CompileResult("fp8_act_quant", f"r{QUANT_BLOCK_R}_w{QUANT_NUM_WARPS}/{x}", arch,
                                     int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch]))
    return results


def compile_topk(cfg, k: int, spec: bool, ptb: int, arch: int) -> CompileResult:
    """One top-K transform binary as `topk.run` launches it (raw indices written too)."""
    from v4flash_kernels.topk import kernel as tk

    sig = {"SC": "*fp32", "stride_sb": "i32", "SEQ": "*i32", "PT": "*i32", "stride_pb": "i32", "pt_cols": "i32",
           "OUT": "*i32", "RAW": "*i32", "WS": "*i64", "AUX": "*i32", "B": "i32", "W": "i32", "page_bits": "i32"}
    const = {"K": k, "CAP": cfg.cap * k // 512, "SMALL": cfg.small, "SPEC": spec, "PTB": ptb, "HAS_RAW": True}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_sb", "stride_pb"]
    ck = _compile(tk.topk_transform_kernel, sig, const, hinted, arch, cfg.num_warps, 1)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    name = f"{cfg.name}/k{k}{'_spec' if spec else ''}_pt{ptb}"
    return CompileResult("topk_transform", name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def check_topk(arch: int) -> List[CompileResult]:
    """Every top-K binary the planner can launch (`topk.op.launch_variants` of each config)."""
    from v4flash_kernels.topk.op import CONFIGS, launch_variants

    return [compile_topk(cfg, k, spec, ptb, arch) for cfg in CONFIGS for k, spec, ptb in launch_variants()]


def compile_qnorm_rope(cfg, arch: int) -> CompileResult:
    """One fused q-path binary (`qnorm_rope.op.QConfig`) as `qnorm_rope.op.launch` passes it: bf16 in and
    out, int64 positions (int32 compiles the same code with a narrower load)."""
    from v4flash_kernels.qnorm_rope import kernel as k
    from v4flash_kernels.qnorm_rope.op import BM, FUSED_K, HEAD_DIM, ROPE_DIM

    sig = {"X": "*bf16", "B": "*fp8e4nv", "BS": "*fp32", "FREQ": "*fp32", "stride_fp": "i32", "POS": "*i64",
           "OUT": "*bf16", "stride_om": "i32", "M": "i32", "eps": "fp32"}
    const = {"K": FUSED_K, "HEAD_DIM": HEAD_DIM, "ROPE": ROPE_DIM, "BM": BM, "BLOCK_K": cfg.block_k}
    hinted = [n for n, t in sig.items() if t.startswith("*")] + ["stride_fp", "stride_om"]
    ck = _compile(k.qnorm_rope_kernel, sig, const, hinted, arch, cfg.num_warps, cfg.num_stages)
    regs, st, ld = _ptxas_stats(ck.asm["ptx"], arch)
    return CompileResult("qnorm_rope", cfg.name, arch, int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch])


def check_qnorm_rope(arch: int) -> List[CompileResult]:
    """Every fused q-path binary: the plan's config and the sweep's candidates (`qnorm_rope.op.launchable`)."""
    from v4flash_kernels.qnorm_rope.op import launchable

    return [compile_qnorm_rope(cfg, arch) for cfg in launchable()]


# What the all-reduce's flag protocol needs from the PTX (kernel.py): flags raised with a release at
# system scope after the CTA barrier, polled with acquire at system scope (peers write them over
# PCIe/NVLink), the epoch bookkeeping at GPU scope, received data read through L2 (.cg), and the
# pushes vectorised (16-byte stores: the alignment hints on the IPC pointers took effect).
ALLREDUCE_PTX_NEEDS = (  # Triton prints scope and semantic in either order (exch: .sys.release, cas: .acquire.sys)
    (r"atom\.global\.(sys\.release|release\.sys)\.exch\.b64", "flag raise: atom.release.sys"),
    (r"atom\.global\.(sys\.acquire|acquire\.sys)\.cas\.b64", "flag wait: atom.acquire.sys (cas)"),
    (r"atom\.global\.(gpu\.acq_rel|acq_rel\.gpu)\.add", "CTA arrival: atom.acq_rel.gpu"),
    (r"atom\.global\.(gpu\.release|release\.gpu)\.exch\.b64", "epoch store: atom.release.gpu"),
    (r"ld\.global\.cg\.v4", "received data: 16-byte ld.cg"),
    (r"st\.global\.v4", "pushes: 16-byte stores"),
)
ALLREDUCE_PTX_FORBIDDEN = (
    (r"\b(atom|ld|st|red)\.global(\.\w+)*?\.cta\.", "a CTA-scoped memory operation (flags cross GPUs)"),
    (r"\b(atom|ld|st|red)\.global(\.\w+)*?\.(sys\.relaxed|relaxed\.sys)\.",
     "a relaxed system-scope operation (flags need release/acquire)"),
)


def allreduce_ptx_problem(ptx: str, vectorised: bool = True) -> str:
    """'' when the PTX has every scope the all-reduce protocol needs and none it must not use
    (`vectorised=False`: a size that is not a multiple of 16 elements, whose accesses are scalar)."""
    needs = ALLREDUCE_PTX_NEEDS if vectorised else [n for n in ALLREDUCE_PTX_NEEDS if "16-byte" not in n[1]]
    missing = [what for pat, what in needs if not re.search(pat, ptx)]
    wrong = [what for pat, what in ALLREDUCE_PTX_FORBIDDEN if re.search(pat, ptx)]
    return "; ".join([f"missing {m}" for m in missing] + [f"has {w}" for w in wrong])


def compile_allreduce(two_shot: bool, world: int, dtype: str, arch: int, spin_limit: int = 0) -> CompileResult:
    """One all-reduce binary as `allreduce.launch.launch` passes it (spin_limit 0: production's unbounded
    waits; the start-up probe's bounded ones otherwise)."""
    from v4flash_kernels.allreduce import kernel as k
    from v4flash_kernels.allreduce import plan as P

    esize = {"bf16": 2, "fp32": 4}[dtype]
    sig = {"X": f"*{dtype}", "OUT": f"*{dtype}", **{f"P{i}": "i64" for i in range(P.MAX_RANKS)},
           "rank": "i32", "n": "i32", "slot": "i32", "span": "i32"}
    const = {"WORLD": world, "BLOCK": P.BLOCK_BYTES // esize, "DATA_OFF": P.DATA_OFF,
             "HALF_BYTES": P.Layout().half_bytes, "FLAGS1_OFF": P.FLAGS1_OFF, "MAX_CTAS": P.MAX_CTAS,
             "SPIN_LIMIT": spin_limit}
    if two_shot:
        const["FLAGS2_OFF"] = P.FLAGS2_OFF
    # what Triton's specialisation gives a real call: 16-byte aligned tensors and IPC addresses,
    # numel a multiple of 16 (n % 16 != 0 compiles a variant with scalar tails, same scopes)
    hinted = ["X", "OUT", *(f"P{i}" for i in range(P.MAX_RANKS)), "n", "slot", "span"]
    fn = k.two_shot_kernel if two_shot else k.one_shot_kernel
    ck = _compile(fn, sig, const, hinted, arch, P.NUM_WARPS, 1)
    ptx = ck.asm["ptx"]
    regs, st, ld = _ptxas_stats(ptx, arch)
    name = f"{'two' if two_shot else 'one'}_shot/n{world}/{dtype}" + ("/probe" if spin_limit else "")
    return CompileResult("allreduce", name, arch,
                         int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch], ptx_problem=allreduce_ptx_problem(ptx))


def check_allreduce(arch: int) -> List[CompileResult]:
    """Every all-reduce binary `launch` can start: both algorithms, every rank count of `plan.WORLDS`, bf16 and fp32, and the
    start-up probe's bf16 binaries with bounded waits."""
    from v4flash_kernels.allreduce import plan as P
    from v4flash_kernels.allreduce.comm import PROBE_SPINS

    worlds = P.WORLDS
    return ([compile_allreduce(two, world, dt, arch) for two in (False, True) for world in worlds
             for dt in ("bf16", "fp32")]
            + [compile_allreduce(two, world, "bf16", arch, PROBE_SPINS) for two in (False, True) for world in worlds])


def check(configs: Iterable | None = None, archs: Sequence[int] = (120, 90)) -> List[CompileResult]:
    """Compile `configs` (default: the dispatcher's table) and the combine kernel for `archs`."""
    from v4flash_kernels.attention.op import SPLIT_CONFIGS, launchable_epilogues

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="v4flash-triton-"))
    results = []
    for arch in archs:
        for cfg in configs if configs is not None else SPLIT_CONFIGS:
            for epilogue in launchable_epilogues(cfg):
                results.append(compile_split(cfg, arch, epilogue))
        results.append(compile_combine(arch))
        if configs is None:  # the shipped tables: the MoE kernels too
            results += check_moe(arch)
            from v4flash_kernels.indexer.op import CONFIGS as INDEXER_CONFIGS

            results += [compile_indexer(c, arch) for c in INDEXER_CONFIGS]
            results += check_mhc(arch)
            results += check_fp8_gemm(arch)
            results += check_topk(arch)
            results += check_qnorm_rope(arch)
            results += check_allreduce(arch)
    return results


def check_parallel(archs: Sequence[int], jobs: int) -> List[CompileResult]:
    """`check` of the shipped tables, one process per arch (up to `jobs`): compiling is CPU-bound and one
    arch's ~150 binaries are independent of the other's, so CI's two cores halve the wall time."""
    jobs = max(1, min(jobs, len(archs)))
    if jobs == 1:
        return check(archs=archs)
    import concurrent.futures
    import multiprocessing

    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="v4flash-triton-"))
    ctx = multiprocessing.get_context("spawn")  # no forked Triton/LLVM state
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        per_arch = list(pool.map(_check_one_arch, archs))
    return [r for rs in per_arch for r in rs]


def _check_one_arch(arch: int) -> List[CompileResult]:
    return check(archs=(arch,))


def format_table(results: Sequence[CompileResult]) -> str:
    head = f"{'kernel':<15} {'config':<36} {'arch':>5} {'smem B':>8} {'limit':>7} {'regs':>5} {'spill st/ld':>12}  ok"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.kernel:<15} {r.config:<36} {'sm_' + str(r.arch):>5} {r.shared_bytes:>8} {r.smem_limit:>7} "
            f"{r.registers:>5} {f'{r.spill_stores}/{r.spill_loads}':>12}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


ONLY = {"fp8_gemm": check_fp8_gemm, "qnorm_rope": check_qnorm_rope}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v4flash_kernels.check_sm120", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, action="append", help="SM arch (default: 120 and 90)")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--only", choices=tuple(ONLY), help="just this op's kernels (a quick check while editing it)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="compile the archs in this many processes (default: the CPU count; 1 = in this one)")
    args = ap.parse_args(argv)
    archs = tuple(args.arch or (120, 90))
    if args.only:
        os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="v4flash-triton-"))
        results = [r for a in archs for r in ONLY[args.only](a)]
    else:
        results = check_parallel(archs, args.jobs)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), ok=r.ok) for r in results], f, indent=1)
    bad = [r for r in results if not r.ok]
    for r in bad:
        if r.ptx_problem:
            print(f"{r.kernel} {r.config} sm_{r.arch}: {r.ptx_problem}", file=sys.stderr)
    if bad:
        print(f"FAIL: {len(bad)} config(s) exceed shared memory, spill registers or differ from the "
              "table's recorded shared_bytes (the dispatcher's occupancy choice relies on it)", file=sys.stderr)
        return 1
    print(f"OK: {len(results)} kernel configs fit (sm_120 limit {SMEM_LIMIT[120]} B, no spills)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
