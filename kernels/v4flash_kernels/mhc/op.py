"""Host side of the mHC boundary: the shape planner, the functional ops and SGLang's drop-ins.

What the pinned sglang 0.5.13.post1 runs per boundary on sm_120 (`server_args` turns the TileLang
pre and DeepGEMM's prenorm GEMM off there, which also keeps the fused post+pre path unreachable):
`DeepseekV4DecoderLayer.hc_pre` = a torch fp32 GEMV + RMS, the TileLang `hc_split_sinkhorn`, the
torch combine, then the sub-layer's RMSNorm as its own kernel; `hc_post` = the TileLang `mhc_post`.

The drop-ins (the registry's `V4FLASH_MHC` patch installs them together):
- `hc_pre` / `hc_post`: the two `DeepseekV4DecoderLayer` methods, same signature and results
  (`hc_pre` returns `norm_fused=False`, as the sm_120 path does: the caller applies the norm).
- `mhc_fused_post_pre`: `sglang.srt.layers.mhc.mhc_fused_post_pre` as `deepseek_v4` imported it,
  same signature and results (the post's streams, post, comb, the normalised sub-layer input).
- `fused_post_pre_enabled`: replaces `deepseek_v4._is_fused_mhc_post_pre_enabled`, which decides
  once per layer at construction whether the model uses the fused path. Ours says yes: with our
  fused op installed the model's own fused structure (the post of one sub-layer and the pre of the
  next in one call, across the layer boundary too) is available on any GPU.

The functional ops (`mhc_pre`, `mhc_post`, `mhc_post_pre`) are what the step bench times.

Shapes: `hc_mult` must be 4 (DeepSeek-V4's value; anything else raises), any hidden size, bf16
streams, fp32 `hc_fn`/scale/base/post/comb, as upstream asserts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Tuple

import torch
import triton

from v4flash_kernels.kit.device import arrival_counters, num_sms
from v4flash_kernels.mhc import kernel as _k

HC = 4
MIX = (2 + HC) * HC
MIX_PAD = int(_k.MIX_PAD)
POST_MULT = 2.0  # hc_split_sinkhorn's fixed post multiplier (deepseek_v4._MHC_POST_MULT_VALUE)
DECODE_MAX_TOKENS = 64  # up to here one launch per boundary (mix + ticketed finish)
DECODE_BLOCK_TOKENS = 4  # the fewest tokens per ticketed block
DECODE_MAX_BLOCKS = 4  # each block re-reads hc_fn (from L2) and is finished by one program, token by token
DECODE_PROGRAMS = 128  # blocks x splits: one wave (the fused variant runs one 8-warp program per SM)
DECODE_WARPS = 8  # the finisher holds two tokens' four full-width streams (this one and the next)
PREFILL_BLOCK_T = 64
MAX_SPLITS = 128
BLOCK_H = 32


@dataclass(frozen=True)
class MixPlan:
    """One `mix_kernel` launch: token block, hidden split, inner tile; `finish_kernel`'s warps.

    `tokens` > 0: one launch, `tokens` tokens per ticketed block (the tile keeps `block_t` >= 16
    rows for the MMA), finished by the block's last program; 0: two launches (mix, then
    `finish_kernel`), `block_t` tokens per block.
    """

    block_t: int
    splits: int  # programs along the hidden dimension (after rounding to whole tiles)
    h_per_split: int
    block_h: int
    num_warps: int = 4
    finish_warps: int = 8
    tokens: int = 0

    @property
    def one_launch(self) -> bool:
        return self.tokens > 0

    @property
    def block_tokens(self) -> int:
        return self.tokens or self.block_t

    @property
    def name(self) -> str:
        return f"t{self.block_t}_s{self.splits}_h{self.block_h}_w{self.num_warps}" + (
            f"_k{self.tokens}" if self.tokens else "_2launch")


def make_plan(block_t: int, splits: int, block_h: int, hidden: int, num_warps: int = 0,
              finish_warps: int = 8, tokens: int = 0) -> MixPlan:
    """A plan with `splits` rounded so every split is a whole number of `block_h` tiles.

    `num_warps` 0 = the default: one launch `DECODE_WARPS`; two launches 4 up to 32 tokens, else 8
    (the fused variant keeps 20 per-token coefficients and four fp32 stream tiles live).
    """
    per = triton.cdiv(triton.cdiv(hidden, splits), block_h) * block_h
    warps = num_warps or (DECODE_WARPS if tokens else (4 if block_t <= 32 else 8))
    return MixPlan(block_t, triton.cdiv(hidden, per), per, block_h, warps, finish_warps, tokens)


def decode_plan(tokens: int, splits: int, hidden: int, block_h: int = BLOCK_H, num_warps: int = 0) -> MixPlan:
    """A one-launch plan: `tokens` (a power of two up to 16) per ticketed block, the hidden dimension
    split `splits` ways."""
    if tokens not in (1, 2, 4, 8, 16):
        raise ValueError(f"tokens per block must be a power of two up to 16, got {tokens}")
    return make_plan(max(16, triton.next_power_of_2(tokens)), splits, block_h, hidden, num_warps, tokens=tokens)


def plan_for(n_tokens: int, hidden: int, num_sms: int) -> MixPlan:
    """The launch plan for a shape: a pure function of (tokens, hidden, SM count); graph-safe.

    Few tokens (decode): one launch of ~128 programs (one wave): at most `DECODE_MAX_BLOCKS` token
    blocks (each finished by its last program), the hidden dimension split over the rest, so at one
    token every program's 12 KB share of the 1.5 MB `hc_fn` is in flight at once (the blocks share
    it through L2; a program with several hidden tiles requests the next before using this one).
    Many tokens (prefill): two launches, 64-token blocks, split only as far as needed for about two
    programs per SM (each split adds a `[tokens, 32]` fp32 partial). 32-wide hidden tiles everywhere.
    """
    if n_tokens <= DECODE_MAX_TOKENS:
        tokens = max(DECODE_BLOCK_TOKENS, triton.next_power_of_2(triton.cdiv(n_tokens, DECODE_MAX_BLOCKS)))
        return decode_plan(tokens, DECODE_PROGRAMS // triton.cdiv(n_tokens, tokens), hidden)
    blocks = triton.cdiv(n_tokens, PREFILL_BLOCK_T)
    splits = 1
    while blocks * splits < 2 * num_sms and splits < MAX_SPLITS:
        splits *= 2
    return make_plan(PREFILL_BLOCK_T, splits, BLOCK_H, hidden)


_PROBE_TOKENS = (1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 1024, 2048, 4096, 8192, 16384, 65536)
_PROBE_SMS = (84, 132, 188)  # RTX PRO 6000 has 188 SMs, the H200 132


def launchable(hidden: int = 4096) -> Tuple[MixPlan, ...]:
    """One plan per distinct compiled mix-kernel variant `plan_for` can launch (for check_sm120).

    The variant is (block_t, block_h, warps); `splits` and `h_per_split` are run-time values.
    """
    seen = {}
    for n in _PROBE_TOKENS:
        for sms in _PROBE_SMS:
            p = plan_for(n, hidden, sms)
            seen[(p.block_t, p.block_h, p.num_warps, p.finish_warps, p.tokens)] = p
    return tuple(seen.values())


def launchable_splits(hidden: int = 4096) -> Tuple[int, ...]:
    """Every partial count a two-launch plan can produce (`finish_kernel` is compiled per its power of two)."""
    return tuple(sorted({p.splits for n in _PROBE_TOKENS for sms in _PROBE_SMS
                         if not (p := plan_for(n, hidden, sms)).one_launch} | {1, MAX_SPLITS}))



def _check(cond: bool, msg: str) -> None:
    # Upstream's asserts, raised even under `python -O` (same exception type as upstream).
    if not cond:
        raise AssertionError(msg)


def _interpret() -> bool:
    """Under Triton's CPU interpreter the kernels spell out bf16 rounding and take fp32 dots (kernel.py)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _check_common(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> None:
    if residual.dim() < 2 or residual.shape[-2] != HC:
        raise NotImplementedError(f"v4flash mHC kernels support hc_mult={HC} only; residual is {tuple(residual.shape)}")
    hidden = residual.shape[-1]
    _check(residual.dtype == torch.bfloat16, f"residual must be bf16, got {residual.dtype}")
    _check(fn.dtype == torch.float32, f"hc_fn must be fp32, got {fn.dtype}")
    _check(scale.dtype == torch.float32 and base.dtype == torch.float32, "hc_scale / hc_base must be fp32")
    _check(tuple(fn.shape) == (MIX, HC * hidden), f"hc_fn must be [{MIX}, {HC * hidden}], got {tuple(fn.shape)}")
    _check(scale.numel() == 3 and base.numel() == MIX, "hc_scale must have 3 and hc_base 24 elements")


# The finish-only constexprs of a two-launch mix (unused there): fixed, so there is one variant.
MIX_ONLY = {"BLOCK_HF": 16, "HAS_NORM": False}


def _pre_launch(
    streams: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    rms_eps: float,
    pre_eps: float,
    sinkhorn_eps: float,
    sinkhorn_iters: int,
    post_mult: float,
    norm_weight: torch.Tensor | None,
    norm_eps: float | None,
    plan: MixPlan | None,
    fused: Tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The boundary on flat `[N, 4, H]` streams (one launch or two, per the plan); `fused` = (x, post,
    comb) of the post to apply first.

    Returns (streams the pre read: the post's output when fused, y, post, comb).
    """
    n, _, hidden = streams.shape
    dev = streams.device
    if plan is None:
        plan = plan_for(n, hidden, num_sms(dev))
    fn = _contig(fn)
    scale = _contig(scale.reshape(3))
    base = _contig(base.reshape(MIX))
    part = torch.empty((plan.splits, n, MIX_PAD), dtype=torch.float32, device=dev)
    if fused is not None:
        x_in, post_in, comb_in = fused
        cur = torch.empty((n, HC, hidden), dtype=torch.bfloat16, device=dev)
        args = (streams, x_in, post_in, comb_in, cur)
    else:
        cur = streams
        args = (streams, streams, fn, fn, streams)  # unused pointer slots
    post = torch.empty((n, HC), dtype=torch.float32, device=dev)
    comb = torch.empty((n, HC, HC), dtype=torch.float32, device=dev)
    y = torch.empty((n, hidden), dtype=torch.bfloat16, device=dev)
    has_norm = norm_weight is not None
    if norm_weight is None:
        w, norm_eps_arg = y, 0.0
    else:
        if norm_eps is None:  # _check's failure, spelled out so the type checker sees norm_eps narrowed
            raise AssertionError("norm_eps required when norm_weight is provided")
        _check(tuple(norm_weight.shape) == (hidden,), f"norm_weight must be [{hidden}]")
        w = _contig(norm_weight if norm_weight.dtype == torch.bfloat16 else norm_weight.bfloat16())
        norm_eps_arg = float(norm_eps)
    eps = (float(rms_eps), float(pre_eps), float(sinkhorn_eps), float(post_mult), norm_eps_arg, int(sinkhorn_iters))
    blocks = triton.cdiv(n, plan.block_tokens)
    grid = (blocks, plan.splits)
    if plan.one_launch:
        cnt = arrival_counters(dev, blocks)
        _k.mix_kernel[grid](
            *args, fn, part, cnt, scale, base, post, comb, y, w, n, plan.h_per_split, *eps,
            H=hidden, BLOCK_T=plan.block_t, TOKENS=plan.tokens, BLOCK_H=plan.block_h, FUSED=fused is not None,
            FINISH=True, BLOCK_HF=triton.next_power_of_2(hidden), HAS_NORM=has_norm, INTERPRET=_interpret(),
            num_warps=plan.num_warps, num_stages=1,
        )
        return cur, y, post, comb
    _k.mix_kernel[grid](
        *args, fn, part, part, fn, fn, fn, fn, y, y, n, plan.h_per_split, *eps,
        H=hidden, BLOCK_T=plan.block_t, TOKENS=plan.block_t, BLOCK_H=plan.block_h, FUSED=fused is not None,
        FINISH=False, **MIX_ONLY, INTERPRET=_interpret(), num_warps=plan.num_warps, num_stages=1,
    )
    _k.finish_kernel[(n,)](
        part, n, plan.splits, cur, scale, base, post, comb, y, w, *eps,
        H=hidden, BLOCK_H=triton.next_power_of_2(hidden), S_PAD=triton.next_power_of_2(plan.splits),
        HAS_NORM=has_norm, INTERPRET=_interpret(), num_warps=plan.finish_warps,
        num_stages=1,
    )
    return cur, y, post, comb


# ----------------------------------------------------------------------------- functional ops


def mhc_pre(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = POST_MULT,
    sinkhorn_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    plan: MixPlan | None = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre of streams `x` `[N, 4, H]` bf16 -> (y `[N, H]` bf16, post `[N, 4]`, comb `[N, 4, 4]`).

    y is RMS-normalised with `norm_weight` when one is given. One launch at decode sizes, else two.
    """
    _check_common(x, hc_fn, hc_scale, hc_base)
    n, hidden = x.shape[0], x.shape[-1]
    if n == 0:
        return (x.new_empty((0, hidden)), x.new_empty((0, HC), dtype=torch.float32),
                x.new_empty((0, HC, HC), dtype=torch.float32))
    _, y, post, comb = _pre_launch(
        _contig(x), hc_fn, hc_scale, hc_base, rms_eps=rms_eps, pre_eps=hc_eps,
        sinkhorn_eps=hc_eps if sinkhorn_eps is None else sinkhorn_eps, sinkhorn_iters=sinkhorn_iters,
        post_mult=post_mult, norm_weight=norm_weight, norm_eps=norm_eps, plan=plan)
    return y, post, comb


def _post_args(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    if residual.dim() != 3 or residual.shape[1] != HC:
        raise NotImplementedError(f"v4flash mHC kernels support hc_mult={HC} only; residual is {tuple(residual.shape)}")
    n, _, hidden = residual.shape
    _check(residual.dtype == torch.bfloat16 and x.dtype == torch.bfloat16, "x and residual must be bf16")
    _check(post.dtype == torch.float32 and comb.dtype == torch.float32, "post and comb must be fp32")
    _check(x.numel() == n * hidden, f"x must be [{n}, {hidden}], got {tuple(x.shape)}")
    _check(post.numel() == n * HC, f"post must be [{n}, {HC}] or [{n}, {HC}, 1], got {tuple(post.shape)}")
    _check(comb.numel() == n * HC * HC, f"comb must be [{n}, {HC}, {HC}], got {tuple(comb.shape)}")
    return (_contig(x.reshape(n, hidden)), _contig(residual), _contig(post.reshape(n, HC)),
            _contig(comb.reshape(n, HC, HC)))


POST_BLOCK_H = 1024
POST_NUM_WARPS = 4


def mhc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The post: `[N, 4, H]` bf16 streams `post_j * x + sum_k comb[k, j] * residual_k`. One launch."""
    x, residual, post, comb = _post_args(x, residual, post, comb)
    n, _, hidden = residual.shape
    out = torch.empty_like(residual)
    if n == 0:
        return out
    block_h = min(POST_BLOCK_H, triton.next_power_of_2(hidden))
    _k.post_kernel[(n, triton.cdiv(hidden, block_h))](
        x, residual, post, comb, out, H=hidden, BLOCK_H=block_h, INTERPRET=_interpret(), num_warps=POST_NUM_WARPS,
        num_stages=1)
    return out


def mhc_post_pre(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = POST_MULT,
    sinkhorn_eps: float | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    plan: MixPlan | None = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A post and the next pre -> (streams `[N, 4, H]`, y `[N, H]`, post, comb); one launch at decode
    sizes, else two.

    The post's streams are written once (bf16, as the model keeps them) and the pre reads them
    as those bf16 values, exactly as the unfused sequence does.
    """
    _check_common(residual, hc_fn, hc_scale, hc_base)
    x, residual, post, comb = _post_args(x, residual, post, comb)
    n, _, hidden = residual.shape
    if n == 0:
        return (torch.empty_like(residual), x.new_empty((0, hidden)), post.new_empty((0, HC)),
                post.new_empty((0, HC, HC)))
    return _pre_launch(
        residual, hc_fn, hc_scale, hc_base, rms_eps=rms_eps, pre_eps=hc_eps,
        sinkhorn_eps=hc_eps if sinkhorn_eps is None else sinkhorn_eps, sinkhorn_iters=sinkhorn_iters,
        post_mult=post_mult, norm_weight=norm_weight, norm_eps=norm_eps, plan=plan, fused=(x, post, comb))


# ----------------------------------------------------------------------------- SGLang drop-ins


def hc_pre(self: Any, x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
           norm: torch.nn.Module | None = None) -> Any:
    """`DeepseekV4DecoderLayer.hc_pre` on sm_120: (y bf16 `[N, H]`, post `[N, 4]`, comb `[N, 4, 4]`, False).

    `norm` is not applied (False says so; the layer then runs its RMSNorm), as on upstream's
    sm_120 path. The post multiplier is upstream `hc_split_sinkhorn`'s fixed 2.
    """
    _ = norm
    if x.shape[0] == 0:
        return (torch.empty((0, x.shape[-1]), dtype=x.dtype, device=x.device),
                torch.empty((0, self.hc_mult), dtype=torch.float32, device=x.device),
                torch.empty((0, self.hc_mult, self.hc_mult), dtype=torch.float32, device=x.device), False)
    y, post, comb = mhc_pre(x, hc_fn, hc_scale, hc_base, rms_eps=self.rms_norm_eps, hc_eps=self.hc_eps,
                            sinkhorn_iters=self.hc_sinkhorn_iters, post_mult=POST_MULT)
    return y, post, comb, False


def hc_post(self: Any, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> Any:
    """`DeepseekV4DecoderLayer.hc_post`: the next streams `[N, 4, H]` bf16."""
    if x.shape[0] == 0:
        return torch.empty((0, self.hc_mult, x.shape[-1]), dtype=x.dtype, device=x.device)
    return mhc_post(x, residual, post, comb)


def mhc_fused_post_pre(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 1,
    tile_n: int = 1,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sglang.srt.layers.mhc.mhc_fused_post_pre`: (streams, post `[..., 4, 1]`, comb, layer input).

    `n_splits` / `tile_n` are tuning hints upstream overrides itself; ignored here too.
    """
    _ = (n_splits, tile_n)
    _check_common(residual, fn, hc_scale, hc_base)
    _check(x.dtype == torch.bfloat16, f"x must be bf16, got {x.dtype}")
    _check(post_layer_mix.dtype == torch.float32 and comb_res_mix.dtype == torch.float32,
           "post_layer_mix / comb_res_mix must be fp32")
    hidden = residual.shape[-1]
    outer = tuple(residual.shape[:-2])
    _check(tuple(x.shape) == (*outer, hidden), "x must be residual's outer shape + [hidden]")
    _check(tuple(post_layer_mix.shape) in ((*outer, HC, 1), (*outer, HC)), "post_layer_mix shape")
    _check(tuple(comb_res_mix.shape) == (*outer, HC, HC), "comb_res_mix shape")
    n = residual.numel() // (HC * hidden) if hidden else 0
    cur, y, post, comb = mhc_post_pre(
        x.reshape(n, hidden), residual.reshape(n, HC, hidden), post_layer_mix.reshape(n, HC),
        comb_res_mix.reshape(n, HC, HC), fn, hc_scale, hc_base, rms_eps=rms_eps, hc_eps=hc_pre_eps,
        sinkhorn_eps=hc_sinkhorn_eps, sinkhorn_iters=sinkhorn_repeat, post_mult=hc_post_mult_value,
        norm_weight=norm_weight, norm_eps=norm_eps)
    return (cur.view(*outer, HC, hidden), post.view(*outer, HC, 1), comb.view(*outer, HC, HC),
            y.view(*outer, hidden))


DSV4_MODULE = "sglang.srt.models.deepseek_v4"


def fused_post_pre_enabled() -> bool:
    """`deepseek_v4._is_fused_mhc_post_pre_enabled`, asked once per layer at construction.

    Yes exactly when the `mhc_fused_post_pre` that `deepseek_v4` calls is ours (the registry installs
    both under one switch; if ours were refused there, the model stays on its unfused path rather
    than reach upstream's TileLang fused kernel, which the pinned code keeps off on sm_120).
    """
    mod = sys.modules.get(DSV4_MODULE)
    return mod is not None and getattr(mod, "mhc_fused_post_pre", None) is mhc_fused_post_pre
