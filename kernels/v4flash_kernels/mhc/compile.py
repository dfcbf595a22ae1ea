"""The mHC binaries `mhc.op` can launch, compiled for a target (`check_sm120`)."""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats


def mhc_mix_config(plan: Any, fused: bool, norm: bool) -> str:
    """The compiled variant of a mix plan (its split count is a run-time value); one launch: `_k` tokens
    per ticketed block, with or without the norm."""
    name = f"{'fused' if fused else 'pre'}/t{plan.block_t}_h{plan.block_h}_w{plan.num_warps}"
    return name + (f"_k{plan.tokens}{'_norm' if norm else ''}" if plan.one_launch else "")


def binaries(arch: int, hidden: int = 4096) -> List[CompileResult]:
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
                ck = compile_kernel(k.mix_kernel, mix_sig, const, hinted, arch, plan.num_warps, 1)
                regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
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
                ck = compile_kernel(k.finish_kernel, fin_sig, const, [n for n, t in fin_sig.items() if t.startswith("*")],
                              arch, w, 1)
                regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
                out.append(CompileResult("mhc_finish", f"s{s_pad}{'_norm' if norm else ''}_w{w}", arch,
                                         int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch]))
    post_sig = {"XIN": "*bf16", "RES": "*bf16", "POST": "*fp32", "COMB": "*fp32", "OUT": "*bf16"}
    const = {"H": hidden, "BLOCK_H": min(mhc.POST_BLOCK_H, triton.next_power_of_2(hidden)), "INTERPRET": False}
    ck = compile_kernel(k.post_kernel, post_sig, const, list(post_sig), arch, mhc.POST_NUM_WARPS, 1)
    regs, st, ld = ptxas_stats(ck.asm["ptx"], arch)
    out.append(CompileResult("mhc_post", f"h{const['BLOCK_H']}_w{mhc.POST_NUM_WARPS}", arch, int(ck.metadata.shared),
                             regs, st, ld, SMEM_LIMIT[arch]))
    return out
