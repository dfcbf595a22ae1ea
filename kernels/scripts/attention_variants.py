"""The sparse-MLA decode's measured-and-dropped 16-head kernel paths, kept runnable for A/B runs.

No plan in `v4flash_kernels.attention.op` launches these, so they live here and not in the shipped
`split_kernel` (whose code is then exactly what runs). Each walks one split of one cache for a
block of 16 heads, as `split_kernel` does, and writes the normalised partial and its base-2 LSE;
the shipped `combine_kernel` merges them. Tile gather, dequantization and the online-softmax step
are the shipped kernel's own helpers.

* ``prefetch``: register double buffering: the next tile's gather is in flight while this tile's
  math runs, and indices run two tiles ahead. H200 (kernels/BENCH.md): no faster, more registers.
* ``dsplit``: the 512-wide latent as 4 parts of 128 (2 fp8 groups each; part 3 = group 6 + RoPE),
  one per warp through batched dots, so each warp keeps only its quarter of q and of the
  accumulator. H200: 9 instead of 18 barriers per tile but more instructions, slower.

Each variant is checked against the fp64 reference on NaN-poisoned outputs, then timed under
CUDA-graph replay (L2 flushed, median) next to the shipped kernel running the same plan (same tile,
same splits, split + combine):

    PYTHONPATH=kernels python kernels/scripts/attention_variants.py [--json PATH]   # GPU, ~1 min
    TRITON_INTERPRET=1 PYTHONPATH=kernels python kernels/scripts/attention_variants.py --cpu   # check only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

import torch
import triton
import triton.language as tl

from v4flash_kernels.attention import op as decode
from v4flash_kernels.attention.kernel import (
    _dequant_tile,
    _gather_tile,
    _online_softmax_step,
    _tile_addr,
    _to_dot,
    combine_kernel,
)

MODE_PREFETCH = 1
MODE_DSPLIT = 2
MODES = {"prefetch": MODE_PREFETCH, "dsplit": MODE_DSPLIT}


@triton.jit
def variant_split_kernel(
    Q, stride_qb, stride_qh,
    K8_A, KS_A, KBF_A, IDX_A, LEN_A, W_A, PS_A, PB_A, SI_A,
    K8_B, KS_B, KBF_B, IDX_B, LEN_B, W_B, PS_B, PB_B, SI_B,
    WS_O,  # fp32 [B, H, NS, 512]
    WS_L,  # fp32 [B, H, NS] base-2 LSE
    H, S_A, NS, CHUNK, qk_scale,
    HAS_LEN_A: tl.constexpr,
    HAS_LEN_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    MODE: tl.constexpr,  # MODE_PREFETCH or MODE_DSPLIT
):
    sid = tl.program_id(0)
    hb = tl.program_id(1)
    b = tl.program_id(2)

    # The split's cache, exactly as split_kernel picks it.
    if sid < S_A:
        k8 = K8_A
        ks64 = KS_A
        kbf = KBF_A
        idx_row = IDX_A + b.to(tl.int64) * SI_A
        page_size = PS_A
        page_bytes = PB_A.to(tl.int64)
        n_valid = W_A
        if HAS_LEN_A:
            n_valid = tl.minimum(tl.load(LEN_A + b), W_A)
        split = sid
    else:
        k8 = K8_B
        ks64 = KS_B
        kbf = KBF_B
        idx_row = IDX_B + b.to(tl.int64) * SI_B
        page_size = PS_B
        page_bytes = PB_B.to(tl.int64)
        n_valid = W_B
        if HAS_LEN_B:
            n_valid = tl.minimum(tl.load(LEN_B + b), W_B)
        split = sid - S_A

    start = split * CHUNK
    end = tl.minimum(start + CHUNK, n_valid)
    scale_section = (page_size * 576).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, 512)
    offs_t = tl.arange(0, BLOCK_T)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    t = start + offs_t
    idx = tl.load(idx_row + t, mask=t < end, other=-1)

    if MODE == 1:  # MODE_PREFETCH
        q_ptrs = Q + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :]
        q = _to_dot(tl.load(q_ptrs, mask=hmask[:, None], other=0.0).to(tl.float32), DOT_DTYPE)
        acc = tl.zeros([BLOCK_H, 512], tl.float32)
        t = start + BLOCK_T + offs_t
        idx_nxt = tl.load(idx_row + t, mask=t < end, other=-1)
        nope, sc, rope = _gather_tile(k8, ks64, kbf, idx, page_size, page_bytes, scale_section)
        valid = idx >= 0
        for t0 in range(start, end, BLOCK_T):
            nope_n, sc_n, rope_n = _gather_tile(k8, ks64, kbf, idx_nxt, page_size, page_bytes, scale_section)
            valid_n = idx_nxt >= 0
            t = t0 + 2 * BLOCK_T + offs_t
            idx_nxt = tl.load(idx_row + t, mask=t < end, other=-1)
            kv = _dequant_tile(nope, sc, rope, BLOCK_T, DOT_DTYPE)
            m_i, l_i, acc = _online_softmax_step(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_DTYPE)
            nope = nope_n
            sc = sc_n
            rope = rope_n
            valid = valid_n
    else:  # MODE_DSPLIT
        offs_p = tl.arange(0, 4)
        offs_c = tl.arange(0, 64)
        p4 = offs_p[:, None, None, None]
        half = tl.arange(0, 2)[None, None, :, None]
        c4 = offs_c[None, None, None, :]
        grp = p4 * 2 + half  # [4,1,2,1] fp8 group (7 = RoPE)
        q4 = tl.load(Q + b.to(tl.int64) * stride_qb + offs_h[None, :, None, None] * stride_qh + grp * 64 + c4,
                     mask=hmask[None, :, None, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
        q3 = tl.reshape(q4, [4, BLOCK_H, 128])
        acc3 = tl.zeros([4, BLOCK_H, 128], tl.float32)
        for t0 in range(start, end, BLOCK_T):
            base, sc, valid = _tile_addr(ks64, idx, page_size, page_bytes, scale_section)
            t = t0 + BLOCK_T + offs_t
            idx = tl.load(idx_row + t, mask=t < end, other=-1)
            b4 = base[None, :, None, None]
            v4 = valid[None, :, None, None]
            rb = tl.multiple_of(base // 2 + 224, 8)
            nope = tl.load(k8 + b4 + grp * 64 + c4, mask=v4 & (grp < 7), other=0.0)  # [4,T,2,64]
            rope = tl.load(kbf + rb[None, :, None, None] + c4, mask=v4, other=0.0)  # [1,T,1,64]
            byte = ((sc[None, :, None, None] >> (grp.to(tl.int64) * 8)) & 0xFF).to(tl.int32)  # [4,T,2,1]
            scale = (byte << 23).to(tl.float32, bitcast=True)
            kv4 = tl.where(grp == 7, rope.to(tl.float32).to(DOT_DTYPE), nope.to(DOT_DTYPE) * scale.to(DOT_DTYPE))
            kv3 = tl.reshape(kv4, [4, BLOCK_T, 128])
            s = tl.sum(tl.dot(q3, tl.permute(kv3, (0, 2, 1))), axis=0) * qk_scale  # [BLOCK_H, BLOCK_T]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p3 = tl.broadcast_to(p.to(DOT_DTYPE)[None, :, :], [4, BLOCK_H, BLOCK_T])
            acc3 = tl.dot(p3, kv3, acc=acc3 * alpha[None, :, None])
            m_i = m_new
        acc = tl.reshape(tl.permute(acc3, (1, 0, 2)), [BLOCK_H, 512])

    has = l_i > 0.0
    lse2 = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (b * H + offs_h).to(tl.int64) * NS + sid
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(WS_O + row[:, None] * 512 + offs_d[None, :], o, mask=hmask[:, None])
    tl.store(WS_L + row, lse2, mask=hmask)


@dataclass(frozen=True)
class Variant:
    mode: str  # a key of MODES
    block_t: int
    num_warps: int
    f16: bool = False  # fp16 dot operands (as the shipped 16-head configs); bf16 otherwise

    @property
    def config(self) -> decode.KernelConfig:
        """The shipped-path config with the same tile: its plan is this variant's plan."""
        return decode.KernelConfig(block_h=16, block_t=self.block_t, num_warps=self.num_warps, f16=self.f16)

    @property
    def name(self) -> str:
        return f"{self.mode}/{self.config.name}"


# What the H200 rounds measured (kernels/BENCH.md): prefetch at both shipped tiles and the bench's
# old 2-warp exploration config, the latent across warps at the 32-token tile (bf16, as measured).
VARIANTS = (
    Variant("prefetch", 32, 4, f16=True),
    Variant("prefetch", 16, 4, f16=True),
    Variant("prefetch", 16, 2),
    Variant("dsplit", 32, 4),
)


def plan_for(kw: dict, variant: Variant, heads: int) -> decode.Plan:
    """The planner's split layout for the variant's tile, always two launches (split + combine)."""
    w_a = kw["indices"].shape[-1]
    w_b = kw["extra_indices"].shape[-1] if kw.get("extra_indices") is not None else 0
    sms, smem = decode._device_info(kw["q"].device)
    return decode.make_plan(kw["q"].shape[0], heads, w_a, w_b, sms, config=variant.config, smem_per_sm=smem,
                            fused=False)


def run_variant(kw: dict, variant: Variant, plan: decode.Plan, poison: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decode call through the variant kernel and the shipped combine -> (out [B,1,H,512], lse [B,H,1]).

    `poison`: the outputs start as NaN so an unwritten element cannot pass a check (off when timing:
    the fill would be a kernel in the timed graph)."""
    q = kw["q"]
    B, _, H, _ = q.shape
    dev = q.device
    k8_a, ks_a, kbf_a, ps_a, pb_a = decode._cache_views(kw["k_cache"])
    idx_a = decode._flat_indices(kw["indices"], B)
    len_a = decode._lengths(kw["topk_length"])
    if kw.get("extra_k_cache") is not None:
        k8_b, ks_b, kbf_b, ps_b, pb_b = decode._cache_views(kw["extra_k_cache"])
        idx_b = decode._flat_indices(kw["extra_indices"], B)
        len_b = decode._lengths(kw.get("extra_topk_length"))
        w_b = idx_b.shape[1]
    else:
        k8_b, ks_b, kbf_b, ps_b, pb_b = k8_a, ks_a, kbf_a, ps_a, pb_a
        idx_b, len_b, w_b = idx_a, None, 0
    ns = plan.num_splits
    ws_o = torch.empty((B, H, ns, 512), dtype=torch.float32, device=dev)
    ws_l = torch.empty((B, H, ns), dtype=torch.float32, device=dev)
    out = torch.empty((B, 1, H, 512), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((B, 1, H), dtype=torch.float32, device=dev)
    if poison:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    sink = kw["attn_sink"].float() if kw.get("attn_sink") is not None else None
    cfg = variant.config
    variant_split_kernel[(ns, triton.cdiv(H, 16), B)](
        q, q.stride(0), q.stride(2),
        k8_a, ks_a, kbf_a, idx_a, len_a if len_a is not None else idx_a, idx_a.shape[1], ps_a, pb_a, idx_a.stride(0),
        k8_b, ks_b, kbf_b, idx_b, len_b if len_b is not None else idx_b, w_b, ps_b, pb_b, idx_b.stride(0),
        ws_o, ws_l, H, plan.splits_main, ns, plan.chunk, float(kw["softmax_scale"]) * decode.LOG2E,
        HAS_LEN_A=len_a is not None, HAS_LEN_B=len_b is not None, BLOCK_H=16, BLOCK_T=cfg.block_t,
        DOT_DTYPE=decode._dot_dtype(cfg), MODE=MODES[variant.mode], num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    combine_kernel[(H, B)](
        ws_o, ws_l, out, out.stride(0), out.stride(2), lse, lse.stride(0), sink if sink is not None else ws_l, H, ns,
        HAS_SINK=sink is not None, SPLIT_BLOCK=decode.COMBINE_SPLIT_BLOCK, num_warps=decode.COMBINE_NUM_WARPS,
    )
    return out, lse.permute(0, 2, 1)


def run_shipped(kw: dict, plan: decode.Plan) -> Tuple[torch.Tensor, torch.Tensor]:
    return decode.run(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"],
                      kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices"),
                      kw.get("extra_topk_length"), plan=plan)


def check(kw: dict, out: torch.Tensor, lse: torch.Tensor, ref: Tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Against the fp64 reference: no NaN (the outputs start as NaN), output and finite-lse errors."""
    from v4flash_kernels.kit.compare import rel_err

    ref_out, ref_lse = ref
    nan = bool(torch.isnan(out.float()).any() or torch.isnan(lse).any())
    fin = torch.isfinite(ref_lse)
    lse_d = lse.double()
    lse_err = float((lse_d[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    err = rel_err(out, ref_out)
    ok = not nan and err <= 1e-2 and lse_err <= 1e-2 and bool(torch.equal(torch.isfinite(lse_d), fin))
    return {"ok": ok, "rel_err": err, "lse_abs_err": lse_err, "nan": nan}


def run_shape(kw: dict, variants: Tuple[Variant, ...], timer=None) -> Dict[str, dict]:
    """Check every variant (and, with `timer`, time it next to the shipped kernel over the same plan)."""
    from v4flash_kernels.attention.reference import sparse_mla_decode_ref

    ref = sparse_mla_decode_ref(**kw)
    heads = kw["q"].shape[2]
    res: Dict[str, dict] = {}
    for v in variants:
        plan = plan_for(kw, v, heads)
        rec = dict(check(kw, *run_variant(kw, v, plan), ref), plan=f"chunk={plan.chunk} splits={plan.num_splits}")
        if timer is not None:
            rec["us"] = timer(lambda v=v, plan=plan: run_variant(kw, v, plan, poison=False)) if rec["ok"] else float("nan")
            rec["shipped_us"] = timer(lambda plan=plan: run_shipped(kw, plan))
        res[v.name] = rec
    return res


def cpu_check() -> int:
    """Every variant on tiny shapes under the interpreter (no GPU): correctness only."""
    from v4flash_kernels.attention.reference import Case, make_inputs
    from v4flash_kernels.interpreter import fix_index, interpreting

    if not interpreting():
        print("--cpu needs TRITON_INTERPRET=1 (set before Triton is imported)", file=sys.stderr)
        return 2
    fix_index()
    cases = {
        "c4_b2_h16": Case(batch=2, heads=16, width=64, page_size=64, extra_width=64, extra_page_size=64),
        "c128_b3_h8": Case(batch=3, heads=8, width=64, page_size=64, extra_width=96, extra_page_size=2,
                           extra_dense=True, hole_frac=0.1),
    }
    bad = 0
    for name, case in cases.items():
        for vname, rec in run_shape(make_inputs(case, seed=7), VARIANTS).items():
            print(name, vname, rec, flush=True)
            bad += not rec["ok"]
    return 1 if bad else 0


GPU_SHAPES = (("c4", 1), ("c4", 16), ("c128@128K", 1), ("c128@128K", 16), ("swa", 1), ("c4", 64))


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="check every variant on tiny shapes (TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention_variants.json"))
    ap.add_argument("--budget-s", type=float, default=80)
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_check()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from v4flash_bench.attention import KINDS
    from v4flash_kernels.attention.reference import Case, make_inputs
    from v4flash_kernels.kit.measure import time_graph

    t0 = time.time()
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "variants": [asdict(v) for v in VARIANTS], "rows": []}
    for i, (kind, batch) in enumerate(GPU_SHAPES):
        if time.time() - t0 > args.budget_s:
            break
        # 16 heads: the TP4 rank's share, which is what the 16-head paths serve.
        kw = make_inputs(Case(batch=batch, heads=16, hole_frac=0.01, **KINDS[kind]), device="cuda", seed=600 + i)
        row: dict = {"kind": kind, "batch": batch, "heads": 16, "variants": run_shape(kw, VARIANTS, time_graph)}
        res["rows"].append(row)
        for name, rec in row["variants"].items():
            print(f"[{time.time() - t0:5.1f}s] {kind} B={batch} {name}: ok={rec['ok']} err={rec['rel_err']:.1e} "
                  f"{rec.get('us', float('nan')):.1f} us vs shipped {rec.get('shipped_us', float('nan')):.1f} us",
                  flush=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        del kw
        torch.cuda.empty_cache()
    return 0 if all(r["ok"] for row in res["rows"] for r in row["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
