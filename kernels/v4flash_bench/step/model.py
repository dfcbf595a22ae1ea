"""Composition arithmetic of one DeepSeek-V4-Flash step on one TP4 GPU: ops, shapes, floors, totals.

Pure functions and frozen dataclasses only (no torch): the GPU side (`ops`) times the ops this
module lists, and `compose` turns µs per call x calls per step into ms per step and tok/s. Keeping
the plan pure lets CPU CI check the layer counts, the bytes/FLOPs floors and the totals, and lets
`--dry-run` print exactly what a GPU run would time.

Shapes are sglang 0.5.13.post1's (models/deepseek_v4.py, dsv4/indexer.py, dsv4/compressor.py,
mxfp4_marlin_moe.py) at attention-TP = MoE-TP = 4 with DeepSeek-V4-Flash's config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Tuple


@dataclass(frozen=True)
class Machine:
    """What bounds an op on one GPU: memory bandwidth and dense tensor FLOP/s (bf16, fp8)."""

    name: str
    bw: float  # bytes/s
    bf16_flops: float = float("nan")  # NaN: unknown, only the bytes floor is used
    fp8_flops: float = float("nan")

    def floor_us(self, nbytes: int, flops: int, fp8: bool) -> float:
        """max(bytes / bandwidth, FLOPs / tensor rate) in µs: no implementation can beat it."""
        t = nbytes / self.bw
        rate = self.fp8_flops if fp8 else self.bf16_flops
        if flops and rate == rate:
            t = max(t, flops / rate)
        return t * 1e6


# RTX PRO 6000 Blackwell: 1.792 TB/s GDDR7; 503.8 TFLOP/s dense FP16/BF16 tensor (fp32 accumulate),
# twice that for FP8 (datasheet: 4,000 sparse FP4 AI TOPS, halved per step of sparsity/precision).
RTX6000 = Machine("RTX PRO 6000 Blackwell", 1.792e12, 503.8e12, 1007.6e12)
BW_RTX6000 = RTX6000.bw
# GPUs whose peaks we know, by torch's device name prefix; bandwidth is replaced by a measured copy.
KNOWN_PEAKS = {"NVIDIA H200": (989e12, 1979e12), "NVIDIA H100": (989e12, 1979e12),
               "NVIDIA RTX PRO 6000": (503.8e12, 1007.6e12)}


def machine_for(name: str, measured_bw: float) -> Machine:
    for prefix, (bf16, fp8) in KNOWN_PEAKS.items():
        if name.startswith(prefix):
            return Machine(name, measured_bw, bf16, fp8)
    return Machine(name, measured_bw)

# ---------------------------------------------------------------- model facts (DeepSeek-V4-Flash)

HIDDEN = 4096
N_LAYERS = 43
COMPRESS_RATIOS: Tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)
N_HEADS = 64
HEAD_DIM = 512
Q_LORA = 1024
O_LORA = 1024
O_GROUPS = 8
WINDOW = 128
INDEX_HEADS = 64
INDEX_DIM = 128
INDEX_TOPK = 512
INDEX_PAGE = 64  # c4 indexer tokens per page (raw page 256 / 4)
RAW_PAGE = 256
N_EXPERTS = 256
TOPK_EXPERTS = 6
MOE_INTER = 2048
SHARED_INTER = 2048
VOCAB = 129280
TP = 4
FP8_BLOCK = 128
MXFP4_GROUP = 32
KV_TOKEN_BYTES = 584  # fp8_ds_mla: 448 fp8 + 64 bf16 rope + 7 ue8m0 scales + 1 pad
INDEX_TOKEN_BYTES = INDEX_DIM + 4  # fp8 key + fp32 scale
PREFILL_EXTEND_ROWS_MAX = 11673  # dsv4/metadata.py _LARGE_INDEXER_QUERY_THRESHOLD

KIND_OF_RATIO = {0: "window", 4: "c4", 128: "c128"}


def layer_kinds() -> Tuple[str, ...]:
    """Attention kind of each of the 43 decoder layers (the MTP layer is not part of a step)."""
    assert len(COMPRESS_RATIOS) == N_LAYERS
    return tuple(KIND_OF_RATIO[r] for r in COMPRESS_RATIOS)


def layer_counts() -> Dict[str, int]:
    """{'window': 2, 'c4': 21, 'c128': 20, 'all': 43}."""
    kinds = layer_kinds()
    out = {k: kinds.count(k) for k in ("window", "c4", "c128")}
    out["all"] = len(kinds)
    return out


# ---------------------------------------------------------------- ops


@dataclass(frozen=True)
class Op:
    """One op of a step: what runs, at which shape, how often per step, and what it must move.

    `key` names the shape timed on the GPU (ops with the same key share one measurement); `count`
    is calls per step; `bytes`/`flops` are the floor of one call (what any implementation has to
    read + write / compute on this GPU); `params` carries the shape for the GPU builder.
    """

    name: str
    group: str  # attention | indexer | moe | fp8_gemm | bf16_gemm | mhc | glue
    key: str
    count: int
    bytes: int
    flops: int
    params: Tuple[Tuple[str, object], ...] = ()
    patch: str | None = None  # the registry patch (hook.patches.PatchSpec name) that replaces it in the patched path
    # An estimate (µs per call, source) used only when the op cannot be timed here (e.g. TileLang
    # missing on the GPU machine); such a line is counted with the estimates, never as timed.
    fallback: Tuple[float, str] | None = None

    @property
    def p(self) -> Dict[str, object]:
        return dict(self.params)

    def floor_us(self, machine: Machine) -> float:
        return machine.floor_us(self.bytes, self.flops, fp8=self.group in ("fp8_gemm", "indexer"))

    @property
    def kernels(self) -> int:
        """Kernel launches one call makes where the bench knows it (glue ops), else 1."""
        launches = self.p.get("launches", ())
        return len(launches) if isinstance(launches, tuple) and launches else 1


def _params(**kw: object) -> Tuple[Tuple[str, object], ...]:
    return tuple(sorted(kw.items()))


def fp8_gemm_bytes(m: int, n: int, k: int) -> int:
    """FP8 weight + fp32 128x128 block scales + bf16 activation in + bf16 out."""
    scales = math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK) * 4
    return n * k + scales + m * k * 2 + m * n * 2


def bf16_gemm_bytes(m: int, n: int, k: int, out_bytes: int = 2) -> int:
    return n * k * 2 + m * k * 2 + m * n * out_bytes


def fp8_gemm(name: str, m: int, n: int, k: int, count: int) -> Op:
    return Op(name, "fp8_gemm", f"fp8:{m}x{n}x{k}", count, fp8_gemm_bytes(m, n, k), 2 * m * n * k,
              _params(m=m, n=n, k=k), patch="fp8_gemm")


# The fused q path (`qnorm_rope` patch: wq_b's GEMM + per-head RMSNorm + RoPE in one kernel) takes up to
# this many rows (qnorm_rope.op.MAX_ROWS); more rows run upstream's method (wq_b, then the JIT norm + RoPE).
QNORM_ROPE_MAX_ROWS = 16
QNORM_ROPE_NAME = "wq_b + q norm + RoPE (fused)"


def q_path_ops(m: int, local_heads: int, count: int, fused: bool = True) -> List[Op]:
    """wq_b's rows of a step (the q norm + RoPE glue row is `glue_ops`'): with `fused` and at up to
    QNORM_ROPE_MAX_ROWS rows the patched path runs them as one fused op instead (reads wq_b's weight,
    scales and input, each row's position and cos/sin; writes q), the upstream path as the two ops."""
    n = local_heads * HEAD_DIM
    wq_b = fp8_gemm("wq_b (FP8)", m, n, Q_LORA, count)
    if m > QNORM_ROPE_MAX_ROWS or not fused:
        return [wq_b]
    one = Op(QNORM_ROPE_NAME, "fp8_gemm", f"qnr:{m}x{n}x{Q_LORA}", count,
               fp8_gemm_bytes(m, n, Q_LORA) + m * (8 + 64 * 4), 2 * m * n * Q_LORA,
               _params(m=m, heads=local_heads, k=Q_LORA), patch="qnorm_rope")
    return [_only(wq_b, "upstream"), _variant(one, "patched")]


def bf16_gemm(name: str, m: int, n: int, k: int, count: int, out_fp32: bool = False, groups: int = 1) -> Op:
    """`groups` > 1: the wo_a einsum, `groups` independent [m,k]x[k,n] products (weights per group)."""
    out_b = 4 if out_fp32 else 2
    nbytes = groups * bf16_gemm_bytes(m, n, k, out_b)
    return Op(name, "bf16_gemm", f"bf16:{groups}x{m}x{n}x{k}:{'f32' if out_fp32 else 'bf16'}", count, nbytes,
              2 * groups * m * n * k, _params(m=m, n=n, k=k, groups=groups, out_fp32=out_fp32))


def expected_distinct_experts(tokens: int, experts: int = N_EXPERTS, topk: int = TOPK_EXPERTS) -> float:
    """Experts touched by `tokens` tokens with uniform routing (each token picks `topk` distinct)."""
    return experts * (1.0 - (1.0 - topk / experts) ** tokens)


def moe_expert_bytes(tp: int = TP) -> int:
    """One expert's MXFP4 weights on one GPU: w13 [2I, K/2] + w2 [K, I/2] nibbles, fp32 scales.

    Scales are counted as fp32 because that is how the pinned load path stores them
    (mxfp4_marlin_moe.py keeps or converts them to float32) and what a drop-in receives.
    """
    inter = MOE_INTER // tp
    nib = 2 * inter * HIDDEN // 2 + HIDDEN * inter // 2
    scales = (2 * inter * HIDDEN // MXFP4_GROUP + HIDDEN * inter // MXFP4_GROUP) * 4
    return nib + scales


def moe_op(m: int, count: int, tp: int = TP) -> Op:
    inter = MOE_INTER // tp
    experts = expected_distinct_experts(m)
    nbytes = int(round(experts * moe_expert_bytes(tp))) + m * HIDDEN * 2 * 2 + m * TOPK_EXPERTS * 8
    flops = 2 * m * TOPK_EXPERTS * (2 * inter * HIDDEN + HIDDEN * inter)
    return Op("routed MoE (MXFP4)", "moe", f"moe:{m}" + _tp_tag(tp), count, nbytes, flops, _params(m=m, tp=tp),
              patch="moe")


def _tp_tag(tp: int) -> str:
    """Key suffix of TP-dependent shapes (none at the default TP4, so older runs' keys still match)."""
    return "" if tp == TP else f":tp{tp}"


HC_MULT = 4  # hyper-connection copies of the residual
HC_MIX = (2 + HC_MULT) * HC_MULT  # pre (4) + post (4) + comb (16) mixing logits per token
HC_SINKHORN_ITERS = 20
HC_EPS = 1e-6
RMS_EPS = 1e-6
# Issue 20's earlier H200 figures of the same sm_120 path (graph replay), used only as the labelled
# fallback when TileLang cannot run on the bench machine: rows -> µs per pre / post boundary.
MHC_FALLBACK_PRE_US = ((1, 17.9), (16, 28.3), (64, 33.7), (1024, 170.0))
MHC_FALLBACK_POST_US = ((1, 2.3), (16, 2.5), (64, 2.6), (1024, 21.0))


def interp(points: Tuple[Tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear through `points` (sorted by x), extended linearly past both ends."""
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


MHC_PRE_NAME = "mHC pre (hc_pre)"
MHC_POST_NAME = "mHC post (hc_post)"
MHC_FUSED_NAME = "mHC fused post+pre + RMSNorm (mhc_fused_post_pre)"


def mhc_ops(rows: int, n_layers: int = N_LAYERS) -> List[Op]:
    """The hyper-connection boundaries of a forward through `n_layers` decoder layers, per path.

    Upstream (sm_120, the fused path gated off): a pre and a post around attention and around the MoE
    of each layer (`hc_pre`: compiled torch norm + fp32 mix GEMV, TileLang Sinkhorn split, torch
    combine; `hc_post`: TileLang `mhc_post`); the sub-layer RMSNorms are glue rows. Patched (the mhc
    patch turns on the model's fused structure): the first layer's pre (`hc_pre`; its RMSNorm stays a
    glue row), 2n - 1 fused boundaries (`mhc_fused_post_pre`: one sub-layer's post, the next one's pre
    and that sub-layer's RMSNorm) and the last layer's post (`hc_post`) once per forward.

    Floors: pre reads the 4-copy bf16 residual and the layer's fp32 `hc_fn` [24, 4 x 4096] (1.5 MB,
    distinct per boundary) and writes the mixed input and the post/comb mixes; post reads the
    sublayer output and the residual and writes the new residual; fused reads both posts' inputs,
    `hc_fn` and the norm weight and writes the new residual, the normalised input and the mixes.
    """
    mixes = rows * (HC_MULT + HC_MULT * HC_MULT) * 4
    fn_bytes = HC_MIX * HC_MULT * HIDDEN * 4
    streams = rows * HC_MULT * HIDDEN * 2
    pre_bytes = streams + fn_bytes + rows * HIDDEN * 2 + mixes
    post_bytes = rows * HIDDEN * 2 + 2 * streams + mixes
    fused_bytes = fn_bytes + rows * HIDDEN * 2 + 2 * streams + rows * HIDDEN * 2 + 2 * mixes + HIDDEN * 2
    pre_flops = 2 * rows * HC_MIX * HC_MULT * HIDDEN
    post_flops = 2 * rows * HC_MULT * (HC_MULT + 1) * HIDDEN
    fb_pre = (interp(MHC_FALLBACK_PRE_US, rows), "estimate: issue 20's H200 figure of this path, interpolated")
    fb_post = (interp(MHC_FALLBACK_POST_US, rows), "estimate: issue 20's H200 figure of this path, interpolated")
    out = []
    for path, calls in (("upstream", 2 * n_layers), ("patched", 1)):
        out.append(_only(Op(MHC_PRE_NAME, "mhc", f"mhc-pre:{rows}", calls, pre_bytes, pre_flops,
                            _params(kind="pre", rows=rows), patch="mhc_pre", fallback=fb_pre), path))
        out.append(_only(Op(MHC_POST_NAME, "mhc", f"mhc-post:{rows}", calls, post_bytes, post_flops,
                            _params(kind="post", rows=rows), patch="mhc_post", fallback=fb_post), path))
    out.append(_variant(Op(MHC_FUSED_NAME, "mhc", f"mhc-fused:{rows}", 2 * n_layers - 1, fused_bytes,
                           pre_flops + post_flops, _params(kind="fused", rows=rows), patch="mhc_fused"), "patched"))
    return out


def attention_tokens(kind: str, actual_ctx: int) -> int:
    """Tokens one decode row attends: 128-token window, + top-512 of ctx/4 (c4), + all ctx/128 (c128)."""
    win = min(WINDOW, actual_ctx)
    if kind == "window":
        return win
    if kind == "c4":
        return win + min(INDEX_TOPK, actual_ctx // 4)
    if kind == "c128":
        return win + actual_ctx // 128
    raise ValueError(kind)


def attention_op(kind: str, rows: int, heads_needed: int, total_tokens: int, count: int, key: str,
                 params: Tuple[Tuple[str, object], ...], distinct_tokens: int | None = None) -> Op:
    """Floor: each distinct attended fp8_ds_mla token once, the int32 indices, q in / out.

    `heads_needed` is 16 at TP4 whatever the kernel computes (upstream pads q to all 64 heads).
    Decode rows read disjoint caches (distinct = total); a prefill chunk's rows share one request's
    cache, so only its distinct tokens must come from memory.
    """
    distinct = total_tokens if distinct_tokens is None else distinct_tokens
    nbytes = distinct * KV_TOKEN_BYTES + 4 * total_tokens + 2 * rows * heads_needed * HEAD_DIM * 2
    flops = 2 * 2 * heads_needed * total_tokens * HEAD_DIM
    return Op(f"sparse-MLA attention ({kind})", "attention", key, count, nbytes, flops, params, patch="sparse_decode")


def indexer_op(rows: int, configured_c4: int, actual_c4_per_row: float, count: int, key: str,
               params: Tuple[Tuple[str, object], ...], distinct_keys: int | None = None) -> Op:
    """Floor: the valid fp8 keys + scales, q, weights, and the full [rows, configured/4] fp32 logits.

    The logits tensor is part of the drop-in contract (top-k reads it), so it counts in full.
    Prefill rows share one request's keys (`distinct_keys`); decode rows read their own.
    """
    keys = int(rows * actual_c4_per_row) if distinct_keys is None else distinct_keys
    nbytes = keys * INDEX_TOKEN_BYTES + rows * INDEX_HEADS * (INDEX_DIM + 4) + rows * configured_c4 * 4
    flops = int(2 * rows * INDEX_HEADS * INDEX_DIM * actual_c4_per_row)
    return Op("indexer logits (c4)", "indexer", key, count, nbytes, flops, params, patch="indexer")


def topk_op(rows: int, width: int, count: int, valid: int) -> Op:
    """Top-512 of each row's first `valid` logits (the row's c4 length; the rest of the configured
    `width` is -inf). The pinned JIT kernel (`topk_v1.cuh`, one CTA per row) reads only those."""
    valid = min(valid, width)
    nbytes = rows * valid * 4 + rows * INDEX_TOPK * 4
    return Op("indexer top-512", "indexer", f"topk:{rows}x{width}:v{valid}", count, nbytes, 0,
              _params(rows=rows, width=width, valid=valid), patch="topk")


# ---------------------------------------------------------------- glue (norms, RoPE, cache writes, compressors)


# ---------------------------------------------------------------- the compressors, fused (the `compressor` switch)

# At a decode step of at most this many rows the compressor patch runs each compressor as one kernel
# (v4flash_kernels.compressor.op.MAX_ROWS); above it, and in prefill / verify chunks, it hands the call
# to upstream, so both paths run upstream's rows there.
COMPRESSOR_FUSED_ROWS = 16
# (kind, ratio, head dim, upstream's wkv_gate GEMM row, upstream's compress + norm/RoPE + store row, the
# fused row, the registry patch that replaces both)
COMPRESSORS = (
    ("c4", 4, HEAD_DIM, "compressor c4 wkv_gate (bf16->fp32)",
     "compressor c4: compress + norm/RoPE + store (3 JIT)",
     "compressor c4: wkv_gate + compress + norm/RoPE + store (one kernel)", "compressor_core"),
    ("c128", 128, HEAD_DIM, "compressor c128 wkv_gate (bf16->fp32)",
     "compressor c128: compress + norm/RoPE + store (3 JIT)",
     "compressor c128: wkv_gate + compress + norm/RoPE + store (one kernel)", "compressor_core"),
    ("c4", 4, INDEX_DIM, "indexer compressor wkv_gate (bf16->fp32)",
     "indexer compressor + index-key store (3 JIT)",
     "indexer compressor: wkv_gate + compress + norm/RoPE/Hadamard + store (one kernel)", "compressor_indexer"),
)


def compressor_op(kind: str, ratio: int, head_dim: int, name: str, patch: str, rows: int, count: int) -> Op:
    """One compressor's decode step as one kernel (patched path only). Floor: the bf16 wkv_gate weight
    [2 coff d, 4096] and x, every row's fp32 kv + score written into the state ring, and for the
    1 / ratio of rows whose window completes (in expectation) the window read back (c4: 8 slots of a kv
    and a score half; c128: 128 slots of kv + score) and the compressed token stored."""
    coff = 2 if ratio == 4 else 1
    n = 2 * coff * head_dim
    token = INDEX_TOKEN_BYTES if head_dim == INDEX_DIM else KV_TOKEN_BYTES
    window = (8 if ratio == 4 else ratio) * 2 * head_dim * 4
    nbytes = n * HIDDEN * 2 + rows * HIDDEN * 2 + rows * n * 4 + int(rows / ratio * (window + token))
    return _variant(Op(name, "compressor", f"comp-fused:{ratio}x{head_dim}:{rows}", count, nbytes,
                       2 * rows * n * HIDDEN, _params(kind=kind, ratio=ratio, head_dim=head_dim, rows=rows),
                       patch=patch), "patched")


def fused_compressors(ops: List[Op], rows: int, counts: Mapping[str, int]) -> List[Op]:
    """A decode step's ops with the compressors fused on the patched path: upstream's wkv_gate GEMM row
    and compress + store row of each compressor stay (upstream path only), the fused row replaces both."""
    upstream_rows = {c[3] for c in COMPRESSORS} | {c[4] for c in COMPRESSORS}
    out = [_only(o, "upstream") if o.name in upstream_rows else o for o in ops]
    for kind, ratio, hd, _, _, name, patch in COMPRESSORS:
        out.append(compressor_op(kind, ratio, hd, name, patch, rows, counts[kind]))
    return out


def glue_op(name: str, kind: str, rows: int, count: int, launches: Tuple[Tuple[int, int], ...],
            impl: str, dim: int = 0) -> Op:
    """One glue op: `launches` kernels per call, each (bytes read, bytes written). `impl` is how the
    bench runs it: "rmsnorm" (the wheel's Triton RMSNorm), "torch_add" (eager add, as upstream), or
    "proxy" (one copy kernel per launch moving the same bytes, for a JIT kernel the bench cannot build)."""
    nbytes = sum(i + o for i, o in launches)
    key = f"glue:{kind}:{rows}:" + ",".join(f"{i}/{o}" for i, o in launches)
    return Op(name, "glue", key, count, nbytes, 0, _params(kind=kind, rows=rows, launches=launches, impl=impl,
                                                          dim=dim))


RMS4096_NAME = "RMSNorm 4096 (input / post-attn / final)"


def glue_ops(rows: int, counts: Mapping[str, int], prefill: bool, tp: int = TP, fused_q: bool = False) -> List[Op]:
    """The small kernels of a step besides the GEMMs, attention, indexer, MoE and mHC, as the sm_120
    path of models/deepseek_v4.py + dsv4/compressor.py runs them (`rows` tokens, all layers).

    RMSNorm is sgl_kernel's AOT `rmsnorm` (timed as the wheel's own one-program-per-row Triton
    RMSNorm); the JIT kernels of jit_kernel/dsv4 (norm+RoPE, cache stores, compressors, the indexer
    q quant, the shared-expert activation, the routing top-k) need SGLang's CUDA JIT and are timed as
    one bytes-equivalent copy kernel per launch. A compressor call is three JIT launches (compress
    into the state ring, norm + RoPE of the compressed token, store into the paged cache); at decode
    every row updates the state, in prefill only every ratio-th token is compressed.
    """
    n_all, n_c4, n_c128 = counts["all"], counts["c4"], counts["c128"]
    h = N_HEADS // tp
    rope = 64

    def compressor(d: int, ratio: int, store_bytes: int) -> Tuple[Tuple[int, int], ...]:
        width = 2 * (2 if ratio == 4 else 1) * d * 4  # fp32 kv + score of the wkv_gate output
        done = math.ceil(rows / ratio) if prefill else rows
        first = (rows * width, done * d * 4 if prefill else rows * width)
        return (first, (done * d * 4, done * d * 4), (done * d * 4, done * store_bytes))

    shared_i = SHARED_INTER // tp
    rms = ((rows * HIDDEN * 2 + HIDDEN * 2, rows * HIDDEN * 2),)
    qrope = glue_op("q norm + RoPE (JIT)", f"qrope{h}", rows, n_all, ((rows * h * HEAD_DIM * 2, rows * h * HEAD_DIM * 2),),
                    "proxy")
    return [
        # upstream: each layer's input and post-attention norms + the final norm; patched: the sub-layer
        # norms are inside the fused mHC boundaries (`mhc_ops`) but the first layer's input norm
        _only(glue_op(RMS4096_NAME, "rms4096", rows, 2 * n_all + 1, rms, "rmsnorm", HIDDEN), "upstream"),
        _only(glue_op(RMS4096_NAME, "rms4096", rows, 2, rms, "rmsnorm", HIDDEN), "patched"),
        glue_op("RMSNorm q_norm 1024", "rms1024", rows, n_all, ((rows * Q_LORA * 2 + Q_LORA * 2, rows * Q_LORA * 2),),
                "rmsnorm", Q_LORA),
        # fused into wq_b's kernel on the patched path at decode / verify rows (`q_path_ops`)
        _only(qrope, "upstream") if fused_q and rows <= QNORM_ROPE_MAX_ROWS else qrope,
        glue_op("kv norm + RoPE + fp8 SWA cache write (JIT)", "kvstore", rows, n_all,
                ((rows * HEAD_DIM * 2, rows * KV_TOKEN_BYTES),), "proxy"),
        glue_op("inverse RoPE on o (JIT)", f"orope{h}", rows, n_all, ((rows * h * rope * 2, rows * h * rope * 2),),
                "proxy"),
        glue_op("compressor c4: compress + norm/RoPE + store (3 JIT)", "comp4", rows, n_c4,
                compressor(HEAD_DIM, 4, KV_TOKEN_BYTES), "proxy"),
        glue_op("compressor c128: compress + norm/RoPE + store (3 JIT)", "comp128", rows, n_c128,
                compressor(HEAD_DIM, 128, KV_TOKEN_BYTES), "proxy"),
        glue_op("indexer compressor + index-key store (3 JIT)", "compidx", rows, n_c4,
                compressor(INDEX_DIM, 4, INDEX_TOKEN_BYTES), "proxy"),
        glue_op("indexer q RoPE + Hadamard + fp8 quant (JIT)", "idxq", rows, n_c4,
                ((rows * INDEX_HEADS * (INDEX_DIM * 2 + 4), rows * INDEX_HEADS * (INDEX_DIM + 4)),), "proxy"),
        glue_op("MoE routing top-6 (JIT)", "route", rows, n_all,
                ((rows * N_EXPERTS * 2, rows * TOPK_EXPERTS * 8),), "proxy"),
        glue_op("shared-expert SiLU-mul clamp (JIT)", f"silu{tp}", rows, n_all,
                ((rows * 2 * shared_i * 2, rows * shared_i * 2),), "proxy"),
        glue_op("shared + routed add (torch)", "add", rows, n_all,
                ((2 * rows * HIDDEN * 2, rows * HIDDEN * 2),), "torch_add", HIDDEN),
    ]


# ---------------------------------------------------------------- one step


@dataclass(frozen=True)
class StepSpec:
    """One decode step (`phase="decode"`, `batch` tokens) or one prefill chunk (`tokens` of one request)."""

    phase: str
    batch: int  # decode: requests per GPU; prefill: tokens in the chunk
    configured_ctx: int  # --context-length: sizes page tables (indexer width, c128 index width)
    actual_ctx: int  # decode: tokens already in each request; prefill: = batch
    heads_upstream: int = N_HEADS  # upstream attends all 64 heads (q padded, deepseek_v4.py l.909-914)
    heads_patched: int = N_HEADS
    tp: int = TP  # attention-TP = MoE-TP of the worker this GPU belongs to
    k: int = 0  # verify: draft tokens per request (MTP steps); the target forward runs B x (k+1) rows
    # Switches that are off in `up`'s default plan (Switch.default_on=False) which this composition's
    # patched path turns on anyway; without them the patched path is what ships by default.
    opt_in: Tuple[str, ...] = ()

    def runs(self, patch: str) -> bool:
        """Whether the patched path of this composition runs registry patch `patch`."""
        from v4flash_kernels.hook.patches import by_name, switch_by_name

        switch = switch_by_name(by_name(patch).switch)
        return switch.default_on or switch.name in self.opt_in

    @property
    def rows(self) -> int:
        """Rows of the target forward: B (decode), B x (k+1) (verify), the chunk's tokens (prefill)."""
        return self.batch * (self.k + 1) if self.phase == "verify" else self.batch

    @property
    def label(self) -> str:
        tp = "" if self.tp == TP else f" TP{self.tp}"
        extra = opt_in_suffix(self.opt_in)
        if self.phase == "prefill":
            return f"prefill{tp} T={self.batch}{extra}"
        ctx = f"C={fmt_ctx(self.configured_ctx)} L={fmt_ctx(self.actual_ctx)}"
        if self.phase == "verify":
            return f"verify{tp} k={self.k} B={self.batch} {ctx}{extra}"
        return f"decode{tp} B={self.batch} {ctx}{extra}"


def opt_in_suffix(names: Iterable[str]) -> str:
    """What a composition's label carries for the switches it opts into (' +qnorm_rope')."""
    return "".join(f" +{name}" for name in names)


def fmt_ctx(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def linear_ops(m: int, counts: Mapping[str, int], tp: int = TP, fused_q: bool = False) -> List[Op]:
    """The GEMMs of one step at M = m rows (all layers), lm_head excluded; column/row-parallel ones
    split over `tp` GPUs (the compressors, the indexer's projections and wqkv_a are replicated).
    `fused_q`: the patched path runs the fused q path (`q_path_ops`)."""
    n_all, n_c4, n_c128 = counts["all"], counts["c4"], counts["c128"]
    local_heads = N_HEADS // tp
    local_groups = O_GROUPS // tp
    return [
        fp8_gemm("wqkv_a (FP8)", m, Q_LORA + HEAD_DIM, HIDDEN, n_all),
        *q_path_ops(m, local_heads, n_all, fused=fused_q),
        bf16_gemm("wo_a einsum (bf16)", m, O_LORA, N_HEADS * HEAD_DIM // O_GROUPS, n_all, groups=local_groups),
        fp8_gemm("wo_b (FP8)", m, HIDDEN, O_GROUPS * O_LORA // tp, n_all),
        fp8_gemm("indexer wq_b (FP8)", m, INDEX_HEADS * INDEX_DIM, Q_LORA, n_c4),
        bf16_gemm("indexer weights_proj (bf16)", m, INDEX_HEADS, HIDDEN, n_c4),
        bf16_gemm("compressor c4 wkv_gate (bf16->fp32)", m, 2 * 2 * HEAD_DIM, HIDDEN, n_c4, out_fp32=True),
        bf16_gemm("compressor c128 wkv_gate (bf16->fp32)", m, 2 * HEAD_DIM, HIDDEN, n_c128, out_fp32=True),
        bf16_gemm("indexer compressor wkv_gate (bf16->fp32)", m, 2 * 2 * INDEX_DIM, HIDDEN, n_c4, out_fp32=True),
        bf16_gemm("router gate (bf16)", m, N_EXPERTS, HIDDEN, n_all),
        fp8_gemm("shared expert gate_up (FP8)", m, 2 * SHARED_INTER // tp, HIDDEN, n_all),
        fp8_gemm("shared expert down (FP8)", m, HIDDEN, SHARED_INTER // tp, n_all),
    ]


def lm_head_op(m: int, tp: int = TP) -> Op:
    return bf16_gemm("lm_head (bf16, vocab/TP)", m, VOCAB // tp, HIDDEN, 1)


def decode_ops(spec: StepSpec) -> List[Op]:
    """Every timed op of one decode step of one GPU of a TP group, B = spec.batch requests; for a
    verify step, the target forward over B x (k+1) rows (`spec.rows`), the k+1 rows of one request
    attending the same cache at consecutive lengths."""
    counts = layer_counts()
    B, C, L, tp = spec.batch, spec.configured_ctx, spec.actual_ctx, spec.tp
    reps = spec.rows // B
    R = spec.rows
    tag = "" if reps == 1 else f"x{reps}"
    ops: List[Op] = []
    for kind in ("window", "c4", "c128"):
        tok = attention_tokens(kind, L)
        width_extra = {"window": 0, "c4": INDEX_TOPK, "c128": C // 128}[kind]
        valid_extra = tok - min(WINDOW, L)
        for variant, heads in (("upstream", spec.heads_upstream), ("patched", spec.heads_patched)):
            key = f"attn:{kind}:B{B}{tag}:H{heads}:w{width_extra}:v{valid_extra}"
            params = _params(kind=kind, rows=B, heads=heads, width_extra=width_extra, valid_extra=valid_extra,
                             prefill=False, reps=reps)
            # the rows of one request share its cache: the floor reads each attended token once
            op = attention_op(kind, R, N_HEADS // tp, R * tok, counts[kind], key, params, distinct_tokens=B * tok)
            ops.append(_variant(op, variant))
    c4_conf = C // 4
    ops.append(indexer_op(R, c4_conf, L / 4, counts["c4"], f"idx:B{B}{tag}:C{C}:L{L}",
                          _params(rows=B, configured_ctx=C, actual_ctx=L, prefill=False, reps=reps),
                          distinct_keys=B * (L // 4)))
    ops.append(topk_op(R, c4_conf, counts["c4"], L // 4))
    ops.append(moe_op(R, counts["all"], tp))
    fused_q = spec.runs("qnorm_rope")
    ops.extend(linear_ops(R, counts, tp, fused_q=fused_q))
    ops.extend(mhc_ops(R))
    ops.extend(glue_ops(R, counts, prefill=False, tp=tp, fused_q=fused_q))
    ops.append(lm_head_op(R, tp))
    if spec.phase == "decode" and R <= COMPRESSOR_FUSED_ROWS:
        ops = fused_compressors(ops, R, counts)
    return ops


NEXTN_LAYER_COUNTS = {"window": 1, "c4": 0, "c128": 0, "all": 1}  # the MTP layer: compress ratio 0


def draft_ops(spec: StepSpec) -> List[Op]:
    """The k NextN draft forwards of a verify cycle, each at B rows (models/deepseek_v4_nextn.py):
    enorm/hnorm + e_proj (B rows) and h_proj (4B rows: the 4 hyper-connection copies), one
    window-attention decoder layer (attention, MoE, its GEMMs, its mHC boundaries, its glue), the head
    norm and the lm_head. Calls per cycle = k x calls per forward; names carry "draft: ".

    (SGLang's EAGLE runs one of these k forwards, the draft extend after a verify, at B x (k+1)
    rows; at the batch sizes where speculation pays it costs about the same as B rows.)
    """
    B, L, tp, k = spec.batch, spec.actual_ctx, spec.tp, spec.k
    counts = NEXTN_LAYER_COUNTS
    tok = attention_tokens("window", L)
    one: List[Op] = []
    for variant, heads in (("upstream", spec.heads_upstream), ("patched", spec.heads_patched)):
        key = f"attn:window:B{B}:H{heads}:w0:v0"
        params = _params(kind="window", rows=B, heads=heads, width_extra=0, valid_extra=0, prefill=False, reps=1)
        one.append(_variant(attention_op("window", B, N_HEADS // tp, B * tok, 1, key, params), variant))
    one.append(moe_op(B, 1, tp))
    fused_q = spec.runs("qnorm_rope")
    one.extend(o for o in linear_ops(B, counts, tp, fused_q=fused_q) if o.count)
    one.append(fp8_gemm("NextN e_proj (FP8)", B, HIDDEN, HIDDEN, 1))
    one.append(fp8_gemm("NextN h_proj (FP8)", B * HC_MULT, HIDDEN, HIDDEN, 1))
    one.extend(mhc_ops(B, n_layers=1))
    glue = [o for o in glue_ops(B, counts, prefill=False, tp=tp, fused_q=fused_q) if o.count]
    one.extend(glue)
    one.append(glue_op(RMS4096_NAME, "rms4096", B * HC_MULT, 1,
                       ((B * HC_MULT * HIDDEN * 2 + HIDDEN * 2, B * HC_MULT * HIDDEN * 2),), "rmsnorm", HIDDEN))
    one.append(lm_head_op(B, tp))
    out = []
    for o in one:
        name = "draft: " + o.name + (" (hnorm, 4B rows)" if o.key.startswith("glue:rms4096") and
                                     o.p["rows"] != B else "")
        calls = o.count + (1 if o.key.startswith("glue:rms4096") and o.p["rows"] == B else 0)  # + enorm
        out.append(Op(name, o.group, o.key, calls * k, o.bytes, o.flops, o.params, o.patch, o.fallback))
    return out


def prefill_ops(spec: StepSpec) -> List[Op]:
    """One chunk of T tokens of one request (positions 0..T-1) on one TP4 prefill GPU.

    On sm_120 the extend path runs the decode kernel with one row per token while T <= 11,673
    (deepseek_v4_backend.py ~l.1257-1287); each row t attends min(t+1,128) window tokens,
    top-512 of its (t+1)//4 compressed tokens (c4) or all (t+1)//128 (c128). Page tables in
    extend mode cover the request's own pages, so the indexer scans T/4 positions per row.
    """
    counts = layer_counts()
    T, tp = spec.batch, spec.tp
    if T > PREFILL_EXTEND_ROWS_MAX:
        raise ValueError(f"chunk of {T} tokens exceeds the sm_120 extend path ({PREFILL_EXTEND_ROWS_MAX} rows)")
    ops: List[Op] = []
    for kind in ("window", "c4", "c128"):
        tok = sum(prefill_row_tokens(kind, t) for t in range(T))
        distinct = T + {"window": 0, "c4": T // 4, "c128": T // 128}[kind]
        for variant, heads in (("upstream", spec.heads_upstream), ("patched", spec.heads_patched)):
            key = f"attn-prefill:{kind}:T{T}:H{heads}"
            params = _params(kind=kind, rows=T, heads=heads, prefill=True)
            ops.append(_variant(attention_op(kind, T, N_HEADS // tp, tok, counts[kind], key, params, distinct), variant))
    c4_width = math.ceil(T / RAW_PAGE) * INDEX_PAGE
    mean_c4 = sum((t + 1) // 4 for t in range(T)) / T
    ops.append(indexer_op(T, c4_width, mean_c4, counts["c4"], f"idx-prefill:T{T}",
                          _params(rows=T, configured_ctx=math.ceil(T / RAW_PAGE) * RAW_PAGE, actual_ctx=T,
                                  prefill=True), distinct_keys=T // 4))
    ops.append(topk_op(T, c4_width, counts["c4"], T // 4))
    ops.append(moe_op(T, counts["all"], tp))
    fused_q = spec.runs("qnorm_rope")
    ops.extend(linear_ops(T, counts, tp, fused_q=fused_q))
    ops.extend(mhc_ops(T))
    ops.extend(glue_ops(T, counts, prefill=True, tp=tp, fused_q=fused_q))
    ops.append(lm_head_op(1, tp))
    return ops


def prefill_row_tokens(kind: str, t: int) -> int:
    """Tokens row t (0-based position) of a prefill chunk attends."""
    win = min(t + 1, WINDOW)
    if kind == "window":
        return win
    if kind == "c4":
        return win + min(INDEX_TOPK, (t + 1) // 4)
    return win + (t + 1) // 128


def _variant(op: Op, variant: str) -> Op:
    """A row one path runs with its own implementation and shape (attention: upstream's kernel at its
    heads, ours at its heads; the fused mHC boundary: ours only): one key and one measurement per path."""
    return Op(op.name, op.group, f"{op.key}:{variant}", op.count, op.bytes, op.flops,
              op.params + (("variant", variant),), op.patch, op.fallback)


def _only(op: Op, path: str) -> Op:
    """A row only `path` runs at this count (the other path has its own row of the same name and key,
    e.g. 2n mHC pre upstream, one patched): measured once per implementation, as any op."""
    return Op(op.name, op.group, op.key, op.count, op.bytes, op.flops, op.params + (("path", path),), op.patch,
              op.fallback)


def step_ops(spec: StepSpec) -> List[Op]:
    if spec.phase == "prefill":
        return prefill_ops(spec)
    if spec.phase == "verify":
        return decode_ops(spec) + draft_ops(spec)
    return decode_ops(spec)


def ops_for_path(ops: Iterable[Op], path: str) -> List[Op]:
    """The ops one path runs: rows tagged for the other path (`variant` or `path`) are dropped."""
    other = "patched" if path == "upstream" else "upstream"
    return [o for o in ops if o.p.get("variant") != other and o.p.get("path") != other]


# ---------------------------------------------------------------- estimates (not timed here)


@dataclass(frozen=True)
class Estimate:
    name: str
    count: int
    us_per_call: float
    source: str


# 2 all-reduces per layer (after attention's wo_b and after the MoE) + 1 for the vocab-parallel logits.
ALLREDUCE_PER_STEP = 2 * N_LAYERS + 1
# Public measurements on 4x RTX PRO 6000 over PCIe (local-inference-lab/rtx6kpro,
# optimization/pcie-oneshot-allreduce.md): µs per all-reduce at 8 / 16 / 32 / 64 KB, NCCL and a one-shot
# all-reduce over CUDA IPC (what SGLang's custom all-reduce does for 2 GPUs). Past 64 KB the bytes are
# added at an assumed bus bandwidth (not measured: NCCL ring 20 GB/s, P2P reads 25 GB/s).
AR_NCCL_PCIE_US = ((8192, 13.9), (16384, 14.7), (32768, 15.6), (65536, 71.2))
AR_ONESHOT_PCIE_US = ((8192, 6.4), (16384, 7.7), (32768, 9.2), (65536, 11.8))
AR_NCCL_BUS_BW = 20e9
AR_P2P_BW = 25e9
# SGLang uses its custom all-reduce only for 2 PCIe GPUs (or full NVLink) and messages <= 8 MiB
# (distributed/device_communicators/custom_all_reduce.py `should_custom_ar`, `_MAX_CAR_SIZE`).
CUSTOM_AR_MAX_BYTES = 8192 * 1024


def allreduce_us(msg_bytes: int, tp: int) -> Tuple[float, str]:
    """(µs, which all-reduce) of one bf16 all-reduce of `msg_bytes` over `tp` PCIe GPUs."""
    if tp <= 1:
        return 0.0, "none (one GPU)"
    custom = tp == 2 and msg_bytes <= CUSTOM_AR_MAX_BYTES
    table, bw = (AR_ONESHOT_PCIE_US, AR_P2P_BW) if custom else (AR_NCCL_PCIE_US, AR_NCCL_BUS_BW)
    if msg_bytes <= table[0][0]:
        us = table[0][1]
    elif msg_bytes <= table[-1][0]:
        us = interp(table, msg_bytes)
    else:
        us = table[-1][1] + 2 * (tp - 1) / tp * (msg_bytes - table[-1][0]) / bw * 1e6
    return us, ("SGLang custom all-reduce (one-shot, CUDA IPC)" if custom else "NCCL")


def estimates(phase: str, rows: int, tp: int = TP, draft_rows: int = 0, draft_steps: int = 0) -> List[Estimate]:
    """Per-step costs this single-GPU run cannot time (shown apart from the timed ops): the all-reduce
    of `rows` x 4096 bf16, 87 per step, over `tp` PCIe GPUs (see `allreduce_us`); a verify cycle adds
    3 per draft forward (its layer's 2 + the logits) at `draft_rows`."""
    us, kind = allreduce_us(rows * HIDDEN * 2, tp)
    extra = []
    if draft_steps:
        dus, _ = allreduce_us(draft_rows * HIDDEN * 2, tp)
        extra.append(Estimate(f"draft: all-reduce over PCIe (TP{tp})", 3 * draft_steps, dus,
                              "estimate: as the target's all-reduce, at the draft's rows"))
    return extra + [
        Estimate(f"{'NCCL all-reduce' if kind == 'NCCL' else 'SGLang custom all-reduce'} over PCIe (TP{tp})",
                 ALLREDUCE_PER_STEP, us,
                 f"estimate: {kind}, 4x RTX PRO 6000 PCIe measurements (local-inference-lab/rtx6kpro) for <= 64 KB, "
                 f"+ bytes at an assumed {(AR_P2P_BW if 'custom' in kind else AR_NCCL_BUS_BW) / 1e9:.0f} GB/s beyond"),
    ]


# ---------------------------------------------------------------- composition


@dataclass(frozen=True)
class OpLine:
    name: str
    group: str
    key: str
    count: int
    us_call: float  # NaN when not measured
    ms_step: float
    floor_rtx_ms: float
    floor_gpu_ms: float
    bytes_call: int
    flops_call: int
    source: str  # "upstream", "ours: <module>", "no patch yet", ...
    estimated: bool = False  # µs from the op's labelled fallback estimate, not timed here
    rtx_lo_ms: float = float("nan")  # the RTX PRO 6000 range of this op per step (see `rtx_range_us`)
    rtx_hi_ms: float = float("nan")

    @property
    def failed(self) -> bool:
        """Its implementation failed its check (`results.FAILED`): no time, the step is incomplete."""
        return self.source.startswith("FAILED")


@dataclass(frozen=True)
class Composition:
    spec: StepSpec
    path: str
    lines: Tuple[OpLine, ...]
    estimates: Tuple[Estimate, ...]
    tokens_per_step: int

    @property
    def failed(self) -> Tuple[str, ...]:
        """The ops that failed their check: while any did, every total of this step is incomplete (NaN)."""
        return tuple(ln.name for ln in self.lines if ln.failed)

    @property
    def timed_ms(self) -> float:
        return sum(ln.ms_step for ln in self.lines if not ln.estimated)

    @property
    def estimate_ms(self) -> float:
        return (sum(e.count * e.us_per_call for e in self.estimates) / 1e3
                + sum(ln.ms_step for ln in self.lines if ln.estimated))

    @property
    def total_ms(self) -> float:
        return self.timed_ms + self.estimate_ms

    @property
    def floor_rtx_ms(self) -> float:
        return sum(ln.floor_rtx_ms for ln in self.lines if not ln.estimated)

    @property
    def floor_gpu_ms(self) -> float:
        return sum(ln.floor_gpu_ms for ln in self.lines if not ln.estimated)

    @property
    def rtx_range_ms(self) -> Tuple[float, float]:
        """(low, high) ms of this step on one RTX PRO 6000: every line's range + the estimates."""
        est = sum(e.count * e.us_per_call for e in self.estimates) / 1e3
        return (sum(ln.rtx_lo_ms for ln in self.lines) + est, sum(ln.rtx_hi_ms for ln in self.lines) + est)

    def rtx_tok_s_range(self) -> Tuple[float, float]:
        """(low, high) tok/s on one RTX PRO 6000 (low from the slow end of the step range)."""
        lo, hi = self.rtx_range_ms
        return self.tokens_per_step / (hi / 1e3), self.tokens_per_step / (lo / 1e3)

    def tok_s(self, include_estimates: bool = True) -> float:
        ms = self.total_ms if include_estimates else self.timed_ms
        return self.tokens_per_step / (ms / 1e3) if ms > 0 else float("nan")


def rtx_range_us(op: Op, us: float, gpu: Machine, rtx: Machine = RTX6000) -> Tuple[float, float]:
    """What one call may cost on an RTX PRO 6000, from its time on the GPU that ran it.

    Low end: the measured time, but never under the op's bytes/FLOPs floor on the RTX card (a
    launch-bound op keeps its time). High end: the measured time scaled by the bandwidth ratio when
    the op is bytes-bound on the RTX card, by the tensor-rate ratio when it is FLOPs-bound (the whole
    measured time slows as the bounding resource does; a launch-bound op lands nearer the low end).
    """
    lo = max(us, op.floor_us(rtx))
    fp8 = op.group in ("fp8_gemm", "indexer")
    rate_gpu = gpu.fp8_flops if fp8 else gpu.bf16_flops
    rate_rtx = rtx.fp8_flops if fp8 else rtx.bf16_flops
    flops_bound = bool(op.flops) and rate_rtx == rate_rtx and op.flops / rate_rtx > op.bytes / rtx.bw
    ratio = rate_gpu / rate_rtx if flops_bound and rate_gpu == rate_gpu else gpu.bw / rtx.bw
    return lo, max(lo, us * ratio)


def compose(spec: StepSpec, path: str, ops: Iterable[Op], us: Mapping[Tuple[str, str], float],
            sources: Mapping[Tuple[str, str], str], gpu: Machine) -> Composition:
    """µs per call (keyed by (op key, path)) x calls per step, next to the floors.

    `us[(key, path)]` must be present for every op of the path (callers fill the patched path
    with the upstream time for ops that have no patch, and say so in `sources`).
    """
    lines = []
    for op in ops_for_path(ops, path):
        t = us[(op.key, path)]
        src = sources.get((op.key, path), path)
        est = src.startswith("estimate")
        lo, hi = (t, t) if est else rtx_range_us(op, t, gpu)
        lines.append(OpLine(op.name, op.group, op.key, op.count, t, t * op.count / 1e3,
                            op.floor_us(RTX6000) * op.count / 1e3, op.floor_us(gpu) * op.count / 1e3,
                            op.bytes, op.flops, src, estimated=est, rtx_lo_ms=lo * op.count / 1e3,
                            rtx_hi_ms=hi * op.count / 1e3))
    tokens = spec.batch  # decode: one token per request; prefill: the chunk's tokens; verify: see spec_table
    extra = estimates(spec.phase, spec.rows, spec.tp, spec.batch, spec.k if spec.phase == "verify" else 0)
    return Composition(spec, path, tuple(lines), tuple(extra), tokens)


def decode_specs(batches: Iterable[int], contexts: Iterable[int], actual_ctx: int, heads_patched: int,
                 tp: int = TP, opt_in: Tuple[str, ...] = ()) -> List[StepSpec]:
    return [StepSpec("decode", b, c, min(actual_ctx, c), heads_patched=heads_patched, tp=tp, opt_in=opt_in)
            for c in contexts for b in batches]


def prefill_specs(chunks: Iterable[int], heads_patched: int, tp: int = TP,
                  opt_in: Tuple[str, ...] = ()) -> List[StepSpec]:
    return [StepSpec("prefill", t, t, t, heads_patched=heads_patched, tp=tp, opt_in=opt_in) for t in chunks]


@dataclass(frozen=True)
class AcceptRange:
    """Mean tokens emitted per verify cycle (the bonus token included) at k draft steps: a cited range,
    never one favourable constant. `mid` is the middle of low and high."""

    k: int
    low: float
    high: float
    source: str

    @property
    def mid(self) -> float:
        return (self.low + self.high) / 2

    def points(self) -> Tuple[Tuple[str, float], ...]:
        return (("low", self.low), ("mid", self.mid), ("high", self.high))


# Public figures for DeepSeek-V4-Flash's MTP layer (the sources are listed in docs/speculative.md):
# SGLang's CI floors (accept length >= 1.6 at 1 step, >= 2.8 at 3 steps), 2-step draft acceptance 88 %
# (accept length 2.76, an NVFP4 requant), 2.77 at 3 steps (Ascend) and 3.1 at 3 steps (a GPU reference).
# The 2-step low end is interpolated between the two CI floors (derived, not measured).
ACCEPT = {
    1: AcceptRange(1, 1.6, 1.88, "low: SGLang CI floor at 1 step; high: 1 + 0.88 (88 % per-draft acceptance)"),
    2: AcceptRange(2, 2.2, 2.76, "low: derived between SGLang's CI floors (1.6 at 1 step, 2.8 at 3); "
                                 "high: 88 % per-draft acceptance at 2 steps (2.76)"),
    3: AcceptRange(3, 2.77, 3.1, "low: 2.77 at 3 steps (Ascend report); high: 3.1 at 3 steps (GPU reference)"),
}


def accept_range(k: int) -> AcceptRange:
    """The cited range at k draft steps; beyond the cited k the last one's, capped at k + 1."""
    if k in ACCEPT:
        return ACCEPT[k]
    last = ACCEPT[max(ACCEPT)]
    return AcceptRange(k, min(last.low, k + 1.0), min(last.high, k + 1.0), last.source + " (k outside the sources)")


# KV pool per GPU at the built-in profiles (launcher memory.py: mem_fraction_static 0.70 at TP4, 0.85 at
# TP2, the moe switch's e8m0 expert scales, MTP on, 95.6 GiB card), in 8K-token streams: a TP-B row
# exists only where B streams fit (tests/kernels/test_step_model.py holds these to the launcher's arithmetic).
KV_POOL_TOKENS = {4: 1_181_732, 2: 267_210}
STREAM_TOKENS = 8192


def streams_fit(tp: int, streams: int) -> bool:
    pool = KV_POOL_TOKENS.get(tp)
    return pool is not None and streams * STREAM_TOKENS <= pool


def verify_specs(batches: Iterable[int], ks: Iterable[int], context: int, actual_ctx: int, heads_patched: int,
                 tp: int = TP, opt_in: Tuple[str, ...] = ()) -> List[StepSpec]:
    return [StepSpec("verify", b, context, min(actual_ctx, context), heads_patched=heads_patched, tp=tp, k=k,
                     opt_in=opt_in) for k in ks for b in batches]


def spec_tok_s(cycle_ms: float, batch: int, accept: float, k: int) -> Tuple[float, float]:
    """(per stream, aggregate) tok/s of speculative decoding: each cycle (k drafts + one verify)
    emits `accept` tokens per request on average; NaN when `accept` exceeds the k+1 a cycle can emit."""
    if accept > k + 1 or cycle_ms <= 0:
        return float("nan"), float("nan")
    per = accept / (cycle_ms / 1e3)
    return per, per * batch


def unique_ops(specs: Iterable[StepSpec]) -> Dict[str, Op]:
    """One op per timing key across all compositions (each shape is timed once and reused)."""
    out: Dict[str, Op] = {}
    for s in specs:
        for op in step_ops(s):
            out.setdefault(op.key, op)
    return out
