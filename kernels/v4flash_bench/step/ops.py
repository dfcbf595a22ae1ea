"""GPU builders for the ops of `model`: real TP4 shapes and formats, a reference check, a timed closure.

Each builder turns one `model.Op` and one implementation ("upstream" = the pinned sglang code
loaded from the wheel at run time, "ours" = a v4flash_kernels patch) into a `Prepared`: `run()`
does `calls` calls on inputs rotated so that streamed weights are not in L2 from the previous
call, and `check()` compares one call against a reference (fp64 torch from the format's
definition; torch for the GEMMs) and returns the relative error. Nothing here is timed; `runner`
does that under CUDA-graph replay.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from v4flash_bench.step import model as M
from v4flash_kernels import upstream as _up
from v4flash_kernels.kit.compare import rel_err

FP8 = torch.float8_e4m3fn
# Everything runs on "cuda"; CPU tests set "cpu" to run the builders' checks under the Triton interpreter.
DEVICE = "cuda"
REL_TOL = 1e-2
MAX_ROTATIONS = 16

FP8_KERNEL_PATH = "sglang/srt/layers/quantization/fp8_kernel.py"
MOE_PATH = "sglang/srt/layers/moe/fused_moe_triton/mxfp4_moe_sm120_triton.py"
INDEXER_PATH = "sglang/srt/layers/attention/dsv4/indexer.py"

# DeepSeek-V4-Flash's MoE epilogue as the pinned `apply` passes it (runner config).
ROUTED_SCALING = 1.5
SWIGLU_LIMIT = 10.0

# The pinned FP8 linear on sm_120 is `triton_w8a8_block_fp8_linear` -> `w8a8_block_fp8_matmul_triton`.
# There is no tuned JSON for the RTX PRO 6000 in the wheel, so the default config is what runs there;
# the prelude pins that (the real lookup would find the H200's tuned files on the bench GPU).
_FP8_PRELUDE = """
import torch
import triton
import triton.language as tl
from typing import Any, Dict, List, Optional, Tuple


def get_w8a8_block_fp8_configs(N, K, block_n, block_k):
    return None


def select_w8a8_block_fp8_matmul_kernel(M, N, META):
    return _w8a8_block_fp8_matmul
"""
_INDEXER_PRELUDE = """
import torch
import torch.nn.functional as F
from typing import Any

FP8_DTYPE = torch.float8_e4m3fn
"""


@dataclass(frozen=True)
class Check:
    ok: bool
    rel_err: float
    detail: str = ""


@dataclass
class Prepared:
    run: Callable[[], None]
    calls: int
    check: Callable[[], Check]
    source: str


class Unavailable(Exception):
    """This implementation of the op does not exist here (e.g. a patch not written yet)."""


def _int(p: Dict[str, object], key: str, default: int | None = None) -> int:
    """An integer shape parameter of a `model.Op` (whose params hold mixed types): checked, not cast."""
    v = p[key] if default is None else p.get(key, default)
    if not isinstance(v, int):
        raise TypeError(f"op parameter {key!r} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


# ---------------------------------------------------------------- implementations


_loaded: Dict[str, object] = {}


def upstream_fp8():
    if "fp8" not in _loaded:
        _loaded["fp8"] = _up.load_defs(
            FP8_KERNEL_PATH,
            ["_per_token_group_quant_8bit", "_w8a8_block_fp8_matmul", "prepare_block_fp8_matmul_inputs",
             "w8a8_block_fp8_matmul_triton"],
            prelude=_FP8_PRELUDE,
        )
    return _loaded["fp8"]


def upstream_moe():
    if "moe" not in _loaded:
        _loaded["moe"] = _up.load_module(MOE_PATH)
    return _loaded["moe"]


def upstream_indexer():
    if "indexer" not in _loaded:
        _loaded["indexer"] = _up.load_defs(INDEXER_PATH, ["fp8_paged_mqa_logits_torch_sm120"],
                                           prelude=_INDEXER_PRELUDE)
    return _loaded["indexer"]


def upstream_attention():
    return _up.load_upstream()


@dataclass(frozen=True)
class Hook:
    """One op's two implementations: what upstream runs on sm_120 (for the report) and where ours
    lives, `(module, attribute)`, called with upstream's exact signature (a drop-in), or None."""

    upstream: str
    ours: Tuple[str, str] | None


# The one table the lead edits when a patch lands: an absent module (or None) is "no patch yet".
HOOKS: Dict[str, Hook] = {
    "attention": Hook("flash_mla_sm120_triton.flash_mla_sparse_decode_triton",
                      ("v4flash_kernels.attention.op", "sparse_mla_decode")),
    "moe": Hook("mxfp4_moe_sm120_triton.mxfp4_moe_forward_triton", ("v4flash_kernels.moe.op", "mxfp4_moe_forward")),
    "indexer": Hook("dsv4/indexer.py::fp8_paged_mqa_logits_torch_sm120",
                    ("v4flash_kernels.indexer.op", "fp8_paged_mqa_logits")),
    # DeepseekV4DecoderLayer.hc_pre(self, x, hc_fn, hc_scale, hc_base, norm=None) -> (y, post, comb, fused)
    "mhc_pre": Hook("models/deepseek_v4.py::DeepseekV4DecoderLayer.hc_pre", ("v4flash_kernels.mhc.op", "hc_pre")),
    # DeepseekV4DecoderLayer.hc_post(self, x, residual, post, comb) -> new residual
    "mhc_post": Hook("models/deepseek_v4.py::DeepseekV4DecoderLayer.hc_post", ("v4flash_kernels.mhc.op", "hc_post")),
    # mhc_fused_post_pre(x, residual, post, comb, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult,
    # iters, *, norm_weight, norm_eps) -> (residual, post, comb, normalised layer input); upstream's TileLang
    # one is gated off on sm_120, so only the patched path has this row
    "mhc_fused": Hook("layers/mhc.py::mhc_fused_post_pre (TileLang; unreachable on sm_120)",
                      ("v4flash_kernels.mhc.op", "mhc_fused_post_pre")),
    # the whole linear the sm_120 dispatch returns: triton_w8a8_block_fp8_linear(input, weight, block_size,
    # weight_scale, input_scale=None, bias=None) = activation group-quant + w8a8_block_fp8_matmul_triton
    "fp8_gemm": Hook("quantization/fp8_utils.py::triton_w8a8_block_fp8_linear (group quant + Triton GEMM, "
                     "default config)", ("v4flash_kernels.fp8_gemm.op", "w8a8_block_fp8_linear")),
    # topk_transform_512(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
    "topk": Hook("jit_kernel/dsv4/topk.py::topk_transform_512 (JIT; timed as a torch.topk proxy)",
                 ("v4flash_kernels.topk.op", "topk_transform_512")),
}
# Kept for callers that patch one entry: kind -> (module, attribute).
PATCHES = {k: h.ours for k, h in HOOKS.items() if h.ours is not None}


def patch_function(kind: str) -> Tuple[Callable | None, str]:
    """(our function or None, why): None with "no patch yet" when its module does not exist."""
    entry = PATCHES.get(kind)
    if entry is None:
        return None, "no patch yet"
    mod_name, attr = entry
    try:
        found = importlib.util.find_spec(mod_name) is not None
    except ModuleNotFoundError:  # the parent package is missing too
        found = False
    if not found:
        return None, "no patch yet"
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # a patch that exists but does not import is reported, not hidden
        return None, f"patch import failed: {type(exc).__name__}: {exc}"
    fn = getattr(mod, attr, None)
    if fn is None:
        return None, f"no patch yet ({mod_name} has no {attr})"
    return fn, f"ours: {mod_name}.{attr}"


# ---------------------------------------------------------------- helpers




def check_of(err: float, detail: str = "", tol: float = REL_TOL) -> Check:
    return Check(ok=err == err and err <= tol, rel_err=err, detail=detail)


def rotations(bytes_per_call: int, l2_bytes: int) -> int:
    """Calls per timed replay, each on its own copy of the streamed operand, so that together they
    exceed 3x the L2 (a real step streams each layer's weights once)."""
    if bytes_per_call <= 0:
        return 1
    return max(1, min(MAX_ROTATIONS, math.ceil(3 * l2_bytes / bytes_per_call)))


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(shape, gen, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype)


# ---------------------------------------------------------------- FP8 block GEMM (upstream Triton)


def fp8_weight(n: int, k: int, gen) -> Tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn((n, k), generator=gen, device=DEVICE).to(FP8)
    s = torch.rand((math.ceil(n / 128), math.ceil(k / 128)), generator=gen, device=DEVICE) * 0.02 + 0.005
    return w, s


def act_quant_ref(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per-token-group fp8 quantization then dequantization (the linear's activation path), fp64."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / torch.finfo(FP8).max
    q = (xf * (1.0 / s)).clamp(-448, 448).to(FP8).float()
    return (q.double() * s.double()).view(m, k)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """sglang's `triton_w8a8_block_fp8_linear` on sm_120: group-quantize x, then the Triton matmul.

    The activation quant runs upstream's Triton `_per_token_group_quant_8bit` (the CUDA build uses
    sgl_kernel's quant, which this GPU does not have; both are one tiny pass over x).
    """
    mod = upstream_fp8()
    m, k = x.shape
    xq = torch.empty((m, k), dtype=FP8, device=x.device)
    xs = torch.empty((m, k // 128), dtype=torch.float32, device=x.device)
    mod._per_token_group_quant_8bit[(m * (k // 128),)](
        x, xq, xs, 128, 128, 1e-10, -448.0, 448.0, BLOCK=128, num_warps=1, num_stages=1)
    return mod.w8a8_block_fp8_matmul_triton(xq, w, xs, s, [128, 128], output_dtype=torch.bfloat16)


def build_fp8_gemm(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    p = op.p
    m, n, k = _int(p, "m"), _int(p, "n"), _int(p, "k")
    g = _gen(seed)
    r = rotations(n * k, l2)
    ws = [fp8_weight(n, k, g) for _ in range(r)]
    x = _randn((m, k), g)
    src = "upstream group quant + Triton _w8a8_block_fp8_matmul, default config"
    if impl == "upstream":
        def linear(w, s):
            return fp8_linear(x, w, s)
    else:
        ours, src = patch_function("fp8_gemm")  # the linear itself: quant fused into the GEMM
        if ours is None:
            raise Unavailable(src)

        def linear(w, s):
            return ours(x, w, [128, 128], s)

    def run() -> None:
        for w, s in ws:
            linear(w, s)

    def check() -> Check:
        """The linear against fp64 on the activation quantized by its definition (group 128, e4m3)."""
        w, s = ws[0]
        wd = w.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        e = rel_err(linear(w, s), act_quant_ref(x) @ wd.t())
        return check_of(e, f"linear vs fp64 of the group-quantized activation {e:.1e}")

    return Prepared(run, r, check, src)


# ---------------------------------------------------------------- bf16 GEMMs (torch / cuBLAS)


def build_bf16_gemm(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    p = op.p
    m, n, k, groups, out_fp32 = _int(p, "m"), _int(p, "n"), _int(p, "k"), _int(p, "groups"), bool(p["out_fp32"])
    g = _gen(seed)
    r = rotations(groups * n * k * 2, l2)
    x = _randn((m, groups, k) if groups > 1 else (m, k), g)
    ws = [_randn((groups, n, k) if groups > 1 else (n, k), g, scale=k ** -0.5) for _ in range(r)]

    if groups > 1:  # wo_a: models/deepseek_v4.py, torch.einsum("tgd,grd->tgr") with the bf16 weight
        def one(w):
            return torch.einsum("tgd,grd->tgr", x, w)
        src = "torch.einsum (cuBLAS), as deepseek_v4.py runs wo_a on sm_120"
    elif out_fp32:  # compressor wkv_gate: jit_kernel/dsv4/gemm.py linear_bf16_fp32, "cublas" algo
        def one(w):
            if DEVICE == "cpu":  # no CPU kernel for mm.dtype; CPU runs only check the plumbing
                return torch.mm(x.float(), w.float().t())
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        src = "torch.mm(out_dtype=fp32) (cuBLAS), as linear_bf16_fp32 runs"
    else:
        def one(w):
            return F.linear(x, w)
        src = "F.linear (cuBLAS)"

    def run() -> None:
        for w in ws:
            one(w)

    def check() -> Check:
        out = one(ws[0])
        if groups > 1:
            ref = torch.einsum("tgd,grd->tgr", x.double(), ws[0].double())
        else:
            ref = x.double() @ ws[0].double().t()
        return check_of(rel_err(out, ref))

    return Prepared(run, r, check, src + " (no patch)")


# ---------------------------------------------------------------- sparse-MLA attention


def decode_attention_inputs(p: Dict[str, object], seed: int) -> dict:
    from v4flash_kernels.attention.reference import Case, make_inputs

    kind, rows, heads = str(p["kind"]), _int(p, "rows"), M.N_HEADS  # q always holds all 64 heads at TP4
    if kind == "window":
        case = Case(batch=rows, heads=heads, hole_frac=0.01)
    elif kind == "c4":
        case = Case(batch=rows, heads=heads, hole_frac=0.01, extra_width=_int(p, "width_extra"), extra_page_size=64,
                    extra_dense=False, ctx_tokens=_int(p, "valid_extra"))
    else:
        case = Case(batch=rows, heads=heads, hole_frac=0.01, extra_width=_int(p, "width_extra"), extra_page_size=2,
                    extra_dense=True, ctx_tokens=_int(p, "valid_extra"))
    return expand_rows(make_inputs(case, device=DEVICE, seed=seed), _int(p, "reps", 1), seed)


def expand_rows(kw: dict, reps: int, seed: int) -> dict:
    """A verify step: each request's row repeated `reps` times (its k+1 draft positions) with fresh q,
    the same indices (one cache, read by all its rows) and consecutive lengths where the index width
    leaves room (a row's window and compressed tokens grow by one position per draft token)."""
    if reps == 1:
        return kw
    out = dict(kw)
    g = _gen(seed + 7)
    step = torch.arange(reps, device=DEVICE, dtype=torch.int32).repeat(kw["q"].shape[0])
    out["q"] = _randn((kw["q"].shape[0] * reps, *kw["q"].shape[1:]), g)
    for key in ("indices", "extra_indices"):
        if kw.get(key) is not None:
            out[key] = kw[key].repeat_interleave(reps, dim=0).contiguous()
    for key, idx in (("topk_length", "indices"), ("extra_topk_length", "extra_indices")):
        if kw.get(key) is not None:
            base = kw[key].repeat_interleave(reps)
            width = kw[idx].shape[-1]
            grown = torch.minimum(base + step, torch.full_like(base, width))
            # a grown slot must hold a real token: keep the base length where the next index is -1
            nxt = torch.gather(out[idx].view(out[idx].shape[0], -1), 1,
                               (grown - 1).clamp(min=0).long().view(-1, 1)).view(-1)
            out[key] = torch.where((grown > base) & (nxt < 0), base, grown).to(torch.int32).contiguous()
    return out


def prefill_attention_inputs(p: Dict[str, object], seed: int) -> dict:
    """One request's chunk of T tokens (positions 0..T-1), one row per token, shared caches.

    Row t: window = tokens max(0, t-127)..t; c4 = a random 512-subset of its (t+1)//4 compressed
    tokens (all of them when fewer); c128 = all (t+1)//128 compressed tokens, length clamped to 1
    like `c128_topk_lengths_clamp1` (an index of -1 marks the empty slot).
    """
    from v4flash_kernels.attention.reference import HEAD_DIM, CacheSpec, make_cache

    kind, T, heads = str(p["kind"]), _int(p, "rows"), M.N_HEADS
    g = torch.Generator().manual_seed(seed)
    gc = _gen(seed)
    dev = DEVICE
    t = torch.arange(T, device=dev)
    win_pos = t[:, None] - (M.WINDOW - 1) + torch.arange(M.WINDOW, device=dev)[None, :]
    win_len = torch.clamp(t + 1, max=M.WINDOW)
    # left-align: row t holds its min(t+1,128) tokens first, then -1
    shift = M.WINDOW - win_len
    col = torch.arange(M.WINDOW, device=dev)[None, :] + shift[:, None]
    win_idx = torch.where(col < M.WINDOW, torch.gather(win_pos, 1, col.clamp(max=M.WINDOW - 1)), -1)
    kw = {
        "q": _randn((T, 1, heads, HEAD_DIM), gc),
        "k_cache": make_cache(CacheSpec(math.ceil(T / 256), 256), dev, g),
        "indices": win_idx.to(torch.int32).view(T, 1, M.WINDOW).contiguous(),
        "topk_length": win_len.to(torch.int32),
        "attn_sink": (torch.randn((heads,), generator=gc, device=dev) * 2.0),
        "head_dim_v": HEAD_DIM,
        "softmax_scale": HEAD_DIM ** -0.5,
    }
    if kind == "c4":
        n_c = max(1, T // 4)
        valid = (t + 1) // 4
        score = torch.rand((T, n_c), generator=gc, device=dev)
        score = torch.where(torch.arange(n_c, device=dev)[None, :] < valid[:, None], score, -1.0)
        k = min(M.INDEX_TOPK, n_c)
        val, idx = score.topk(k, dim=1)
        idx = torch.where(val >= 0, idx, -1).to(torch.int32)
        if k < M.INDEX_TOPK:
            idx = F.pad(idx, (0, M.INDEX_TOPK - k), value=-1)
        kw.update(extra_k_cache=make_cache(CacheSpec(math.ceil(n_c / 64), 64), dev, g),
                  extra_indices=idx.view(T, 1, M.INDEX_TOPK).contiguous(),
                  extra_topk_length=torch.clamp(valid, max=M.INDEX_TOPK).to(torch.int32))
    elif kind == "c128":
        n_c = max(1, T // 128)
        valid = (t + 1) // 128
        ar = torch.arange(n_c, device=dev)[None, :]
        idx = torch.where(ar < valid[:, None], ar, -1).to(torch.int32)
        kw.update(extra_k_cache=make_cache(CacheSpec(math.ceil(n_c / 2), 2), dev, g),
                  extra_indices=idx.view(T, 1, n_c).contiguous(),
                  extra_topk_length=torch.clamp(valid, min=1).to(torch.int32))
    return kw


def _rows_of(kw: dict, rows: torch.Tensor, heads: int) -> dict:
    out = dict(kw)
    for key in ("q", "indices", "topk_length", "extra_indices", "extra_topk_length"):
        if kw.get(key) is not None:
            out[key] = kw[key][rows]
    out["q"] = out["q"][:, :, :heads]
    out["attn_sink"] = kw["attn_sink"][:heads]
    return out


def build_attention(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    from v4flash_kernels.attention.reference import sparse_mla_decode_ref

    p = op.p
    prefill = bool(p["prefill"])
    heads = _int(p, "heads")  # heads computed; q holds all 64 (SGLang pads q at TP4)
    kw = prefill_attention_inputs(p, seed) if prefill else decode_attention_inputs(p, seed)
    if impl == "upstream":
        up = upstream_attention()
        src = "upstream flash_mla_sparse_decode_triton (wheel), all 64 heads (q padded at TP4)"

        def call():
            return up.flash_mla_sparse_decode_triton(
                q=kw["q"], k_cache=kw["k_cache"], indices=kw["indices"], topk_length=kw["topk_length"],
                attn_sink=kw["attn_sink"], head_dim_v=kw["head_dim_v"], softmax_scale=kw["softmax_scale"],
                extra_k_cache=kw.get("extra_k_cache"), extra_indices=kw.get("extra_indices"),
                extra_topk_length=kw.get("extra_topk_length"))
    else:
        fn, why = patch_function("attention")
        if fn is None:
            raise Unavailable(why)
        src = f"{why}, all {heads} heads"
        if heads < M.N_HEADS:  # the registry's TP adapter: rank 0 of TP computes heads 0..64/TP-1
            from v4flash_kernels.hook.tp_heads import AttnTp, make_tp_aware

            fn = make_tp_aware(fn, read=lambda: AttnTp(0, M.N_HEADS // heads))
            src = f"{why} via tp_heads adapter: {heads} of {M.N_HEADS} heads (rank 0 of {M.N_HEADS // heads})"

        def call():
            return fn(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"], kw["head_dim_v"],
                      kw["softmax_scale"], kw.get("extra_k_cache"), kw.get("extra_indices"),
                      kw.get("extra_topk_length"))

    def check() -> Check:
        out, lse = call()
        _sync()
        B = kw["q"].shape[0]
        rows = torch.arange(B, device=DEVICE)
        if B > 64:  # prefill: check 64 rows spread over the chunk (first, last and between)
            rows = torch.linspace(0, B - 1, 64, device=DEVICE).round().long()
        sub = _rows_of(kw, rows, heads)
        ref_out, ref_lse = sparse_mla_decode_ref(**sub)
        err = rel_err(out[rows][:, :, :heads], ref_out)
        fin = torch.isfinite(ref_lse)
        lse_d = lse[rows][:, :heads].reshape(ref_lse.shape).double()
        lse_err = float((lse_d[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
        ok = err == err and err <= REL_TOL and lse_err <= 1e-2
        return Check(ok, err, f"lse abs err {lse_err:.1e}, {len(rows)} rows x {heads} heads checked")

    return Prepared(lambda: call(), 1, check, src)


# ---------------------------------------------------------------- indexer logits + top-k


def indexer_inputs(p: Dict[str, object], seed: int) -> dict:
    """Paged fp8 index-key cache [P, 64, 1, 132] (64x128 fp8 then 64 fp32 scales per page) and a
    page table over the configured context (unused entries 0, as in a fresh req_to_token pool)."""
    rows, conf, actual, prefill = _int(p, "rows"), _int(p, "configured_ctx"), _int(p, "actual_ctx"), bool(p["prefill"])
    g = _gen(seed)
    width = conf // M.RAW_PAGE
    used = math.ceil(actual / M.RAW_PAGE)
    n_pages = used if prefill else rows * used
    n_pages += 1  # page 0 stays a valid garbage page for the unused page-table entries
    vals = torch.randn((n_pages, M.INDEX_PAGE, M.INDEX_DIM), generator=g, device=DEVICE).to(FP8)
    scales = torch.rand((n_pages, M.INDEX_PAGE), generator=g, device=DEVICE) * 0.5 + 0.05
    raw = torch.cat([vals.view(torch.uint8).reshape(n_pages, -1), scales.view(torch.uint8).reshape(n_pages, -1)], 1)
    kv = raw.view(n_pages, M.INDEX_PAGE, 1, M.INDEX_TOKEN_BYTES)
    pt = torch.zeros((rows, width), dtype=torch.int32, device=DEVICE)
    ar = torch.arange(used, device=DEVICE, dtype=torch.int32)
    if prefill:
        pt[:, :used] = 1 + ar[None, :]
        seq = (torch.arange(rows, device=DEVICE, dtype=torch.int32) + 1) // 4
    else:
        pt[:, :used] = 1 + torch.arange(rows, device=DEVICE, dtype=torch.int32)[:, None] * used + ar[None, :]
        seq = torch.full((rows,), actual // 4, dtype=torch.int32, device=DEVICE)
    q = torch.randn((rows, 1, M.INDEX_HEADS, M.INDEX_DIM), generator=g, device=DEVICE).to(FP8)
    w = torch.randn((rows, M.INDEX_HEADS), generator=g, device=DEVICE) * 0.1
    # the caller passes c4 seq lens as [rows, 1] (indexer.py: `_c4sl.unsqueeze(-1)`)
    reps = _int(p, "reps", 1)
    if reps > 1:  # verify: a request's k+1 rows read its pages at consecutive lengths (c4 length of L+j)
        pt = pt.repeat_interleave(reps, dim=0).contiguous()
        j = torch.arange(reps, device=DEVICE, dtype=torch.int32).repeat(rows)
        seq = ((actual + j) // 4).to(torch.int32).clamp(max=used * M.INDEX_PAGE)
        q = torch.randn((rows * reps, 1, M.INDEX_HEADS, M.INDEX_DIM), generator=g, device=DEVICE).to(FP8)
        w = torch.randn((rows * reps, M.INDEX_HEADS), generator=g, device=DEVICE) * 0.1
    return {"q_fp8": q, "kvcache_fp8": kv, "weight": w, "seq_lens": seq.clamp(min=1).unsqueeze(-1), "page_table": pt,
                "deep_gemm_metadata": None, "max_seq_len": width * M.INDEX_PAGE, "clean_logits": False}


def indexer_ref(kw: dict, rows: List[int]) -> torch.Tensor:
    """fp64 logits from the format's definition for `rows`: sum_h relu(q_h . k_t) w_h * scale_t."""
    kv = kw["kvcache_fp8"]
    P = kv.shape[0]
    flat = kv.reshape(P, M.INDEX_PAGE * M.INDEX_TOKEN_BYTES)
    vals = flat[:, : M.INDEX_PAGE * M.INDEX_DIM].contiguous().view(FP8).double().view(P, M.INDEX_PAGE, M.INDEX_DIM)
    scl = flat[:, M.INDEX_PAGE * M.INDEX_DIM:].contiguous().view(torch.float32).double().view(P, M.INDEX_PAGE)
    width = kw["max_seq_len"]
    out = torch.full((len(rows), width), float("-inf"), dtype=torch.float64, device=kv.device)
    for i, r in enumerate(rows):
        n = int(kw["seq_lens"][r].reshape(-1)[0])
        pages = kw["page_table"][r, : math.ceil(n / M.INDEX_PAGE)].long()
        k = vals[pages].reshape(-1, M.INDEX_DIM)[:n]
        s = scl[pages].reshape(-1)[:n]
        q = kw["q_fp8"][r, 0].double()  # [H, D]
        logits = (torch.relu(k @ q.t()) * kw["weight"][r].double()[None, :]).sum(1) * s
        out[i, :n] = logits
    return out


def build_indexer(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    p = op.p
    kw = indexer_inputs(p, seed)
    if impl == "upstream":
        fn = upstream_indexer().fp8_paged_mqa_logits_torch_sm120
        src = "upstream fp8_paged_mqa_logits_torch_sm120 (wheel): torch over every configured page"
    else:
        fn, why = patch_function("indexer")
        if fn is None:
            raise Unavailable(why)
        src = why

    def call():
        return fn(kw["q_fp8"], kw["kvcache_fp8"], kw["weight"], kw["seq_lens"], kw["page_table"],
                  kw["deep_gemm_metadata"], kw["max_seq_len"], kw["clean_logits"])

    def check() -> Check:
        out = call()
        _sync()
        R = kw["q_fp8"].shape[0]
        rows = sorted({0, R // 3, R // 2, R - 1}) if R > 4 else list(range(R))
        if bool(p["prefill"]):
            rows = sorted({0, 7, 100, R // 2, R - 2, R - 1} & set(range(R)))
        ref = indexer_ref(kw, rows)
        got = out[rows].double()
        if tuple(out.shape) != (R, kw["max_seq_len"]):
            return Check(False, float("nan"), f"shape {tuple(out.shape)}")
        fin = torch.isfinite(ref)
        if not torch.equal(torch.isfinite(got), fin):
            return Check(False, float("nan"), "-inf pattern differs from the reference")
        return check_of(rel_err(got[fin], ref[fin]), f"rows {rows}")

    return Prepared(lambda: call(), 1, check, src)


def build_topk(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """Upstream: torch.topk over each row's valid prefix, a stand-in for the JIT radix
    `topk_transform_512` (topk_v1.cuh: one CTA per row over its first seq_len scores, plus the page
    translation), which needs SGLang's CUDA JIT. Ours: the drop-in, called as the indexer calls the
    JIT kernel (scores, c4 seq lens, page table, out page indices, page size 64, out raw indices).
    The rows share one length (decode) or the chunk's longest (prefill, an upper bound)."""
    p = op.p
    rows, width, valid = _int(p, "rows"), _int(p, "width"), _int(p, "valid")
    g = _gen(seed)
    logits = torch.randn((rows, width), generator=g, device=DEVICE)
    logits[:, valid:] = float("-inf")
    head = logits[:, :valid]
    k = min(M.INDEX_TOPK, valid)
    if impl == "upstream":
        def call():
            return torch.topk(head, k, dim=1, largest=True, sorted=False)

        def check() -> Check:
            vals, idx = call()
            ref = torch.sort(logits, dim=1, descending=True).values[:, :k]
            got = torch.sort(vals, dim=1, descending=True).values
            ok = torch.equal(torch.gather(logits, 1, idx), vals) and bool(torch.isfinite(got).all())
            return check_of(rel_err(got, ref) if ok else float("nan"))

        return Prepared(lambda: call(), 1, check, "proxy: torch.topk over the valid prefix (JIT topk_transform_512 "
                        "needs SGLang's CUDA JIT)")
    fn, why = patch_function("topk")
    if fn is None:
        raise Unavailable(why)
    pages = math.ceil(width / M.INDEX_PAGE)
    table = torch.randperm(rows * pages, generator=g, device=DEVICE).to(torch.int32).view(rows, pages)
    seq = torch.full((rows,), valid, dtype=torch.int32, device=DEVICE)
    out_pages = torch.empty((rows, M.INDEX_TOPK), dtype=torch.int32, device=DEVICE)
    out_raw = torch.empty((rows, M.INDEX_TOPK), dtype=torch.int32, device=DEVICE)

    def call2() -> None:
        fn(logits, seq, table, out_pages, M.INDEX_PAGE, out_raw)

    def check2() -> Check:
        out_pages.fill_(-7)
        out_raw.fill_(-7)
        call2()
        _sync()
        raw = out_raw[:, :k].long()
        if bool((raw < 0).any()) or bool((raw >= valid).any()):
            return Check(False, float("nan"), "raw index outside the row's valid prefix")
        got = torch.sort(torch.gather(logits, 1, raw), dim=1, descending=True).values
        ref = torch.sort(logits, dim=1, descending=True).values[:, :k]
        want_pages = torch.gather(table.long(), 1, raw // M.INDEX_PAGE) * M.INDEX_PAGE + raw % M.INDEX_PAGE
        if not torch.equal(out_pages[:, :k].long(), want_pages):
            return Check(False, float("nan"), "page translation differs")
        if k < M.INDEX_TOPK and not bool((out_pages[:, k:] == -1).all()):
            return Check(False, float("nan"), "slots past the row's length are not -1")
        return check_of(rel_err(got, ref))

    return Prepared(call2, 1, check2, why)


# ---------------------------------------------------------------- routed MoE (MXFP4)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, K/2] e2m1 nibbles (low nibble = even k) x [N, K/32] scales -> [N, K] fp64."""
    lut = torch.tensor(E2M1, dtype=torch.float64, device=packed.device)
    b = packed.view(torch.uint8).long()
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    return vals * scale.double().repeat_interleave(M.MXFP4_GROUP, dim=-1)


def moe_ref(x, w13, w2, s13, s2, ids, weights, rows: List[int]) -> torch.Tensor:
    inter = w2.shape[-1] * 2
    out = torch.zeros((len(rows), x.shape[1]), dtype=torch.float64, device=x.device)
    for i, r in enumerate(rows):
        xr = x[r].double()
        for j in range(ids.shape[1]):
            e = int(ids[r, j])
            if e < 0:
                continue
            h = mxfp4_dequant(w13[e], s13[e]) @ xr
            gate, up = h[:inter].clamp(max=SWIGLU_LIMIT), h[inter:].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            act = F.silu(gate) * up
            out[i] += float(weights[r, j]) * (mxfp4_dequant(w2[e], s2[e]) @ act)
    return out * ROUTED_SCALING


def moe_weights(seed: int, tp: int = M.TP):
    """All 256 experts of one layer at `tp` in the pinned load path's layout: int8 nibbles, fp32 scales."""
    g = _gen(seed)
    inter = M.MOE_INTER // tp
    E, K = M.N_EXPERTS, M.HIDDEN
    w13 = torch.randint(-128, 128, (E, 2 * inter, K // 2), generator=g, device=DEVICE, dtype=torch.int8)
    w2 = torch.randint(-128, 128, (E, K, inter // 2), generator=g, device=DEVICE, dtype=torch.int8)
    s13 = torch.pow(2.0, torch.randint(-9, -6, (E, 2 * inter, K // 32), generator=g, device=DEVICE).float())
    s2 = torch.pow(2.0, torch.randint(-8, -5, (E, K, inter // 32), generator=g, device=DEVICE).float())
    return w13, w2, s13, s2


_moe_w: Dict[Any, Any] = {}  # tp -> loader-layout experts; ("repacked", tp) -> their v2 form


def _moe_repacked(tp: int):
    """This TP's bench experts in the load-time repacked layout (None when the repack is absent)."""
    if importlib.util.find_spec("v4flash_kernels.moe.repack") is None:
        return None
    key = ("repacked", tp)
    if key not in _moe_w:
        from v4flash_kernels.moe.repack import repack_experts

        w13, w2, s13, s2 = _moe_w[tp]
        _moe_w[key] = repack_experts(w13, w2, s13, s2)
    return _moe_w[key]


def _moe_v2_call(forward, experts, *, hidden_states, topk_ids, topk_weights, routed_scaling_factor, clamp_limit,
                 **_upstream_only):
    return forward(hidden_states, experts, topk_ids, topk_weights, routed_scaling_factor, clamp_limit)


def build_moe(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    m, tp = _int(op.p, "m"), _int(op.p, "tp", M.TP)
    if tp not in _moe_w:  # one expert set per TP reused by every MoE shape (806 MB + scales at TP4, far past L2)
        _moe_w.clear()  # the run orders shapes by TP, so one set is resident at a time
        _moe_w[tp] = moe_weights(seed, tp)
    w13, w2, s13, s2 = _moe_w[tp]
    g = _gen(seed + 1)
    r = 8 if m == 1 else (2 if m <= 16 else 1)  # routing sets per replay, so B=1 does not hit L2
    x = _randn((m, M.HIDDEN), g)
    routes = []
    for _ in range(r):
        ids = torch.rand((m, M.N_EXPERTS), generator=g, device=DEVICE).topk(M.TOPK_EXPERTS, dim=1).indices
        wts = torch.rand((m, M.TOPK_EXPERTS), generator=g, device=DEVICE)
        routes.append((ids.to(torch.int32), wts / wts.sum(1, keepdim=True)))
    if impl == "upstream":
        fn = upstream_moe().mxfp4_moe_forward_triton
        src = "upstream mxfp4_moe_forward_triton (wheel)"
    else:
        fn, why = patch_function("moe")
        if fn is None:
            raise Unavailable(why)
        src = why
        repacked = _moe_repacked(tp)
        if repacked is not None:  # what the moe switch serves: experts repacked at load time, decode v2
            from v4flash_kernels.moe.op_v2 import moe_forward_repacked

            fn = functools.partial(_moe_v2_call, moe_forward_repacked, repacked)
            src = "ours: v4flash_kernels.moe.op_v2.moe_forward_repacked on experts repacked at load time"

    def one(ids, wts):
        return fn(hidden_states=x, w13_packed=w13, w2_packed=w2, w13_scale=s13, w2_scale=s2, topk_ids=ids,
                  topk_weights=wts, hidden_size=M.HIDDEN, intermediate_size=M.MOE_INTER // tp,
                  routed_scaling_factor=ROUTED_SCALING, clamp_limit=SWIGLU_LIMIT)

    def run() -> None:
        for ids, wts in routes:
            one(ids, wts)

    def check() -> Check:
        ids, wts = routes[0]
        out = one(ids, wts)
        _sync()
        rows = sorted({0, 1, 2, m // 2, m - 1} & set(range(m)))
        ref = moe_ref(x, w13, w2, s13, s2, ids, wts, rows)
        return check_of(rel_err(out[rows], ref), f"rows {rows}")

    return Prepared(run, r, check, src)



# ---------------------------------------------------------------- mHC (hyper-connections)


def upstream_mhc():
    """The pinned `DeepseekV4DecoderLayer.hc_pre` / `hc_post` (their TileLang kernels included) as
    functions of a stand-in layer, compiled once at one token so that a machine without a working
    TileLang says so once (`Unavailable`, the op falls back to its labelled estimate)."""
    if "mhc" in _loaded:
        got = _loaded["mhc"]
        if isinstance(got, Unavailable):
            raise got
        return got
    try:
        mod = _up.load_dsv4_mhc_methods()
        layer = mhc_layer()
        x = torch.randn((1, M.HC_MULT, M.HIDDEN), device=DEVICE).to(torch.bfloat16)
        fn, scale, base = mhc_params(torch.Generator(device=DEVICE).manual_seed(0))
        _y, post, comb, _ = mod.hc_pre(layer, x, fn, scale, base)
        # a fresh [1, hidden] tensor: x[:, 0].contiguous() keeps stride 16384 on its size-1 dim, which
        # PyTorch calls contiguous and TileLang's stride check refuses
        sub = torch.randn((1, M.HIDDEN), device=DEVICE).to(torch.bfloat16)
        mod.hc_post(layer, sub, x, post, comb)
        _sync()
    except Exception as exc:
        err = Unavailable(f"TileLang mHC unavailable here: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        _loaded["mhc"] = err
        raise err from exc
    _loaded["mhc"] = mod
    return mod


def mhc_layer():
    """The attributes `hc_pre`/`hc_post` read from the layer (DeepSeek-V4-Flash config)."""
    from types import SimpleNamespace

    return SimpleNamespace(hc_mult=M.HC_MULT, hc_sinkhorn_iters=M.HC_SINKHORN_ITERS, hc_eps=M.HC_EPS,
                           rms_norm_eps=M.RMS_EPS)


def mhc_params(gen) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 hc_fn [24, 4*4096] scaled so the mixing logits are O(1), hc_scale [3], hc_base [24]."""
    k = M.HC_MULT * M.HIDDEN
    fn = torch.randn((M.HC_MIX, k), generator=gen, device=DEVICE) * k ** -0.5
    scale = torch.rand((3,), generator=gen, device=DEVICE) * 0.5 + 0.75
    base = torch.randn((M.HC_MIX,), generator=gen, device=DEVICE) * 0.5
    return fn, scale, base


def mhc_pre_ref(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor):
    """fp64 hyper-connection pre from its definition: RMS-normalised mix logits of the flattened
    residual, pre = sigmoid + eps, post = 2 sigmoid, comb = row-softmax + eps then 20 alternating
    column/row normalisations (each divisor + eps), y = sum_j pre_j x_j."""
    n, hc, _ = x.shape
    xf = x.double().reshape(n, -1)
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + M.RMS_EPS)
    mix = (xf @ fn.double().t()) * rs
    sc, bs, eps = scale.double(), base.double(), M.HC_EPS
    pre = torch.sigmoid(mix[:, :hc] * sc[0] + bs[:hc]) + eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * sc[1] + bs[hc:2 * hc])
    comb = (mix[:, 2 * hc:] * sc[2] + bs[2 * hc:]).view(n, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(1, keepdim=True) + eps)
    for _ in range(M.HC_SINKHORN_ITERS - 1):
        comb = comb / (comb.sum(2, keepdim=True) + eps)
        comb = comb / (comb.sum(1, keepdim=True) + eps)
    y = (pre.unsqueeze(-1) * x.double()).sum(1)
    return y, post, comb


def mhc_post_ref(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_residual[j] = post_j x + sum_k comb[k, j] residual[k] (fp64)."""
    return post.double().unsqueeze(-1) * x.double().unsqueeze(1) + torch.einsum(
        "nkj,nkh->njh", comb.double(), residual.double())


def mhc_rmsnorm_ref(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 RMSNorm of y as the sub-layer reads it (bf16), weight bf16."""
    yb = y.to(torch.bfloat16).double()
    return yb * torch.rsqrt(yb.square().mean(-1, keepdim=True) + M.RMS_EPS) * w.double()


def build_mhc_fused(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """Ours only (upstream's fused kernel is gated off on sm_120): the post of one sub-layer, the pre of
    the next and its RMSNorm, one call; checked against the fp64 post and the fp64 pre + RMSNorm of the
    streams it wrote (what the unfused pair computes)."""
    if impl != "ours":
        raise Unavailable("upstream runs no fused mHC boundary on sm_120 (its TileLang one is gated off)")
    fn_impl, why = patch_function("mhc_fused")
    if fn_impl is None:
        raise Unavailable(why)
    rows = _int(op.p, "rows")
    g = _gen(seed)
    x = _randn((rows, M.HC_MULT, M.HIDDEN), g)
    r = rotations(M.HC_MIX * M.HC_MULT * M.HIDDEN * 4, l2)
    params = [mhc_params(g) for _ in range(r)]
    fn0, scale0, base0 = params[0]
    _y, post_ref, comb_ref = mhc_pre_ref(x, fn0, scale0, base0)
    post_in, comb_in = post_ref.float(), comb_ref.float()
    sub = _randn((rows, M.HIDDEN), g)
    w = (1.0 + 0.1 * torch.randn((M.HIDDEN,), generator=g, device=DEVICE)).to(torch.bfloat16)
    consts = (M.RMS_EPS, M.HC_EPS, M.HC_EPS, 2.0, M.HC_SINKHORN_ITERS)

    def call(fn, scale, base):  # post as the model passes it, [rows, 4, 1]
        return fn_impl(sub, x, post_in.unsqueeze(-1), comb_in, fn, scale, base, *consts, norm_weight=w,
                       norm_eps=M.RMS_EPS)

    def run() -> None:
        for fn, scale, base in params:
            call(fn, scale, base)

    def check() -> Check:
        cur, post, comb, y = call(fn0, scale0, base0)
        _sync()
        rcur = mhc_post_ref(sub, x, post_in, comb_in)
        ry, rp, rc = mhc_pre_ref(cur, fn0, scale0, base0)
        errs = (rel_err(cur, rcur), rel_err(y, mhc_rmsnorm_ref(ry, w)), rel_err(post.reshape(rp.shape), rp),
                rel_err(comb.reshape(rc.shape), rc))
        return check_of(max(errs), "streams {:.1e}, y {:.1e}, post {:.1e}, comb {:.1e}".format(*errs))

    return Prepared(run, r, check, why)


def build_mhc(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    kind, rows = str(op.p["kind"]), _int(op.p, "rows")
    if kind == "fused":
        return build_mhc_fused(op, impl, l2, seed)
    hook = "mhc_pre" if kind == "pre" else "mhc_post"
    if impl == "upstream":
        mod = upstream_mhc()
        fn_impl = mod.hc_pre if kind == "pre" else mod.hc_post
        src = ("upstream hc_pre: torch.compile'd norm + fp32 mix GEMV, TileLang hc_split_sinkhorn, torch combine"
               if kind == "pre" else "upstream hc_post: TileLang mhc_post")
    else:
        fn_impl, why = patch_function(hook)
        if fn_impl is None:
            raise Unavailable(why)
        src = why
    layer = mhc_layer()
    g = _gen(seed)
    x = _randn((rows, M.HC_MULT, M.HIDDEN), g)
    r = rotations(M.HC_MIX * M.HC_MULT * M.HIDDEN * 4, l2) if kind == "pre" else 1
    params = [mhc_params(g) for _ in range(r)]
    fn0, scale0, base0 = params[0]
    _y, post_ref, comb_ref = mhc_pre_ref(x, fn0, scale0, base0)
    post_in, comb_in = post_ref.float(), comb_ref.float()
    sub = _randn((rows, M.HIDDEN), g)

    if kind == "pre":
        def run() -> None:
            for fn, scale, base in params:
                fn_impl(layer, x, fn, scale, base)

        def check() -> Check:
            y, post, comb, _ = fn_impl(layer, x, fn0, scale0, base0)
            _sync()
            ry, rp, rc = mhc_pre_ref(x, fn0, scale0, base0)
            errs = (rel_err(y, ry), rel_err(post.reshape(rp.shape), rp), rel_err(comb.reshape(rc.shape), rc))
            return check_of(max(errs), "y {:.1e}, post {:.1e}, comb {:.1e}".format(*errs))
    else:
        def run() -> None:
            fn_impl(layer, sub, x, post_in, comb_in)

        def check() -> Check:
            out = fn_impl(layer, sub, x, post_in, comb_in)
            _sync()
            return check_of(rel_err(out, mhc_post_ref(sub, x, post_in, comb_in)))

    return Prepared(run, r, check, src)


# ---------------------------------------------------------------- glue (norms, RoPE, cache writes, compressors)


@triton.jit
def _copy_words(src, dst, n_in, n_out, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src + offs, mask=offs < n_in, other=0)
    tl.store(dst + offs, v, mask=offs < n_out)


def upstream_rmsnorm():
    """deepseek_v4.py's Triton `rms_normalize_triton` (in place, one program per row)."""
    if "rms" not in _loaded:
        _loaded["rms"] = _up.load_defs(_up.DSV4_MODEL_PATH, ["_rms_normalize_kernel", "rms_normalize_triton"],
                                       prelude="import torch\nimport triton\nimport triton.language as tl\n")
    return _loaded["rms"]


def build_glue(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """RMSNorm: the wheel's Triton RMSNorm (one program per row; sgl_kernel's AOT `rmsnorm`, which the
    sm_120 path calls, is not on the bench machine), checked against fp64. Add: torch eager, as
    upstream. Proxy: one copy kernel per JIT launch moving the same bytes, checked to copy exactly."""
    p = op.p
    rows, dim, how = _int(p, "rows"), _int(p, "dim"), str(p["impl"])
    g = _gen(seed)
    if how == "rmsnorm":
        mod = upstream_rmsnorm()
        x = _randn((rows, dim), g)
        work = x.clone()
        w = torch.ones((dim,), dtype=torch.bfloat16, device=DEVICE)  # ones: repeated in-place replays stay put

        def run() -> None:
            mod.rms_normalize_triton(work, M.RMS_EPS, w)

        def check() -> Check:
            y = mod.rms_normalize_triton(x.clone(), M.RMS_EPS, w)
            xd = x.double()
            ref = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + M.RMS_EPS)
            return check_of(rel_err(y, ref))

        return Prepared(run, 1, check, "proxy: deepseek_v4.py's Triton rms_normalize_triton for sgl_kernel.rmsnorm "
                        "(AOT CUDA, not on this machine)")
    if how == "torch_add":
        return _build_add(rows, dim, g)
    return _build_proxy(op.p["launches"], g)  # type: ignore[arg-type]


def _build_add(rows: int, dim: int, g) -> Prepared:
    a, b = _randn((rows, dim), g), _randn((rows, dim), g)

    def run() -> None:
        torch.add(a, b)

    def check() -> Check:
        return check_of(rel_err(torch.add(a, b), a.double() + b.double()))

    return Prepared(run, 1, check, "torch add (eager), as deepseek_v2's MoE adds the shared expert")


def _build_proxy(launches: Tuple[Tuple[int, int], ...], g) -> Prepared:
    bufs = []
    for n_in, n_out in launches:
        wi, wo = max(1, math.ceil(n_in / 4)), max(1, math.ceil(n_out / 4))
        src = torch.randint(-(2 ** 31), 2 ** 31 - 1, (wi,), generator=g, device=DEVICE, dtype=torch.int32)
        bufs.append((src, torch.empty((wo,), dtype=torch.int32, device=DEVICE), wi, wo))
    block = 1024

    def run() -> None:
        for src, dst, wi, wo in bufs:
            _copy_words[(triton.cdiv(max(wi, wo), block),)](src, dst, wi, wo, BLOCK=block)

    def check() -> Check:
        run()
        _sync()
        for src, dst, wi, wo in bufs:
            n = min(wi, wo)
            if not torch.equal(src[:n], dst[:n]) or (wo > wi and bool((dst[wi:] != 0).any())):
                return Check(False, float("nan"), "proxy copy kernel wrote wrong words")
        return Check(True, 0.0, f"{len(bufs)} launch(es)")

    return Prepared(run, 1, check, f"proxy: {len(bufs)} copy kernel(s) moving the same bytes (the JIT kernels of "
                    "jit_kernel/dsv4 need SGLang's CUDA JIT)")


BUILDERS = {
    "fp8_gemm": build_fp8_gemm,
    "bf16_gemm": build_bf16_gemm,
    "attention": build_attention,
    "moe": build_moe,
    "mhc": build_mhc,
    "glue": build_glue,
}


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """Raise `Unavailable` when `impl` == "ours" and that patch does not exist yet."""
    if op.group == "indexer":
        return (build_topk if op.key.startswith("topk:") else build_indexer)(op, impl, l2, seed)
    return BUILDERS[op.group](op, impl, l2, seed)
