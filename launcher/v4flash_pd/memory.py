"""GPU memory of one DeepSeek-V4-Flash worker, per GPU: weights at its TP size, the KV pool SGLang
sizes from mem_fraction_static, and what stays outside that pool. Arithmetic from the model's
shapes and the pinned sglang 0.5.13.post1's own formulas, so `plan` can say in milliseconds what a
worker would otherwise find out after a 20-minute weight load ("Not enough memory").

Weights, as the pinned code holds them on sm_120 (paths inside the wheel, `sglang/srt/...`):
- routed experts (`layers/quantization/mxfp4_marlin_moe.py`): w13 int8 [E, 2I/tp, H/2], w2 int8
  [E, H, I/tp/2] (two e2m1 nibbles a byte) and their scales as **fp32** [E, 2I/tp, H/32], [E, H, I/tp/32]
  (the sm_120 path keeps or converts the checkpoint's E8M0 bytes to float32): 4 scale bytes per 32
  weights. Split by TP (MoE-TP = TP).
- FP8 linears (128x128 blocks, fp32 `weight_scale_inv`): wqkv_a (replicated), wq_b / wo_b / the shared
  expert's gate_up and down (split by TP), the indexer's wq_b (replicated); wo_a is bf16 on sm_120
  (FP8 wo_a off; `models/deepseek_v4.py`), split by TP; the compressors' wkv_gate and the indexer's
  weights_proj are bf16 and replicated; mHC `hc_*_fn` fp32, replicated; the router gate bf16,
  replicated; embedding and lm_head bf16, split by vocabulary.
- the MTP (NextN) layer (`models/deepseek_v4_nextn.py`, only with speculative decoding): e_proj and
  h_proj (FP8 4096x4096, replicated), one window-only decoder layer with its MoE; it shares the
  target's embedding and lm_head.

Memory, as the pinned code splits it (`model_executor/model_runner_kv_cache_mixin.py`): KV pool =
free-before-load x mem_fraction_static - weights; everything else (CUDA graphs, activations, the MTP
layer, which loads after the pool is sized) lives in free-before-load x (1 - mem_fraction_static).
Tokens = KV pool / bytes per token (`model_executor/pool_configurator.py` DSV4PoolConfigurator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

GIB = 1 << 30
MIB = 1 << 20
FP8_BLOCK = 128
MXFP4_GROUP = 32
# The pinned sm_120 load path stores the experts' E8M0 scales as float32 (see above); the moe switch's
# load-time repack (v4flash_kernels.moe.sglang_patch) replaces them by e8m0 bytes: 1.
MOE_SCALE_BYTES = 4
REPACKED_SCALE_BYTES = 1
# RTX PRO 6000 Blackwell as nvidia-smi reports it (memory.total), for plans without a probed GPU.
RTX6000_MIB = 97887
# Free memory before the weights load is the card less the CUDA context and the communicators'
# buffers: an assumption (not measured here); the worker's log prints the real `avail mem`.
RUNTIME_GIB = 1.0
# What SGLang's own default mem_fraction_static leaves outside the static pool on a card > 60 GB
# (server_args.py `_handle_gpu_memory_settings`: at least 10 GiB, + 4 GiB for an EAGLE draft).
SGLANG_RESERVE_GIB = 10.0
SGLANG_SPEC_RESERVE_GIB = 4.0
# The least a suggested mem_fraction_static leaves outside the static pool (CUDA graphs at small
# batches, activations): an assumption, not measured; the worker log's "avail mem" is the measurement.
MIN_OUTSIDE_GIB = 2.0
# deepseek_v4_hook.py sets swa_full_tokens_ratio to 0.1 for DeepSeek-V4 unless given.
SWA_FULL_TOKENS_RATIO = 0.1
# The request the README's decode figures are for (the step bench's --actual-context): a decode
# worker that captures graphs up to B requests claims B streams of this many tokens, so its KV pool
# must hold them (else the batch the graphs cover cannot form).
CLAIMED_STREAM_TOKENS = 8192


@dataclass(frozen=True)
class ModelShape:
    """The config.json fields the arithmetic reads; defaults are DeepSeek-V4-Flash's (and SGLang's
    DeepSeekV4Config defaults)."""

    hidden_size: int = 4096
    num_hidden_layers: int = 43
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    index_n_heads: int = 64
    index_head_dim: int = 128
    n_routed_experts: int = 256
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    vocab_size: int = 129280
    hc_mult: int = 4
    window_size: int = 128
    n_hash_layers: int = 3
    num_experts_per_tok: int = 6

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """From a checkpoint's config.json (fields it lacks keep DeepSeek-V4-Flash's values)."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in cfg:
                value = cfg[f.name]
                kw[f.name] = tuple(value[: cfg.get("num_hidden_layers", len(value))]) \
                    if f.name == "compress_ratios" else value
        return cls(**kw)

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim


def fp8_bytes(n: int, k: int) -> int:
    """An FP8 [n, k] weight with fp32 128x128 block scales."""
    return n * k + math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK) * 4


@dataclass(frozen=True)
class LayerBytes:
    replicated: int  # on every GPU of the worker
    split: int  # the whole tensor, divided by TP
    experts: int  # on one GPU at the given TP (already divided)


def routed_experts_bytes(m: ModelShape, tp: int, scale_bytes: int = MOE_SCALE_BYTES) -> int:
    """One layer's routed experts on one GPU: int8 nibble pairs + one scale per 32 weights."""
    inter = m.moe_intermediate_size // tp
    weights = 2 * inter * m.hidden_size + m.hidden_size * inter  # w13 [2I, H] + w2 [H, I] per expert
    return m.n_routed_experts * (weights // 2 + weights // MXFP4_GROUP * scale_bytes)


def layer_bytes(m: ModelShape, ratio: int, tp: int, *, layer_id: int = 0, nextn: bool = False,
                scale_bytes: int = MOE_SCALE_BYTES) -> LayerBytes:
    h, hd = m.hidden_size, m.head_dim
    rep = fp8_bytes(m.q_lora_rank + hd, h)  # wqkv_a (or wq_a + wkv: the same bytes)
    rep += (m.q_lora_rank + hd) * 2 + m.num_attention_heads * 4  # q_norm, kv_norm, attn_sink
    if ratio:  # the attention compressor: wkv_gate bf16, ape and norm fp32
        coff = 2 if ratio == 4 else 1
        rep += 2 * coff * hd * h * 2 + ratio * coff * hd * 4 + hd * 4
    if ratio == 4:  # the c4 indexer: wq_b FP8, weights_proj bf16, its own compressor
        idx = m.index_head_dim
        rep += fp8_bytes(m.index_n_heads * idx, m.q_lora_rank) + m.index_n_heads * h * 2
        rep += 2 * 2 * idx * h * 2 + 4 * 2 * idx * 4 + idx * 4
    mix = (2 + m.hc_mult) * m.hc_mult
    rep += 2 * (mix * m.hc_mult * h * 4 + mix * 4 + 3 * 4) + 2 * h * 2  # mHC attn/ffn, two RMSNorms
    rep += m.n_routed_experts * h * 2 + m.n_routed_experts * 4  # router gate + correction bias
    if layer_id < m.n_hash_layers and not nextn:
        rep += m.vocab_size * m.num_experts_per_tok * 4  # hash routing table
    shared = m.moe_intermediate_size * m.n_shared_experts
    split = (fp8_bytes(m.num_attention_heads * hd, m.q_lora_rank)  # wq_b
             + m.o_groups * m.o_lora_rank * (m.num_attention_heads * hd // m.o_groups) * 2  # wo_a bf16
             + fp8_bytes(h, m.o_groups * m.o_lora_rank)  # wo_b
             + fp8_bytes(2 * shared, h) + fp8_bytes(h, shared))  # shared expert
    return LayerBytes(rep, split, routed_experts_bytes(m, tp, scale_bytes))


@dataclass(frozen=True)
class WeightBytes:
    """Bytes on one GPU of a TP worker."""

    replicated: int
    split: int  # already divided by TP
    experts: int

    @property
    def total(self) -> int:
        return self.replicated + self.split + self.experts


def target_weights(m: ModelShape, tp: int, scale_bytes: int = MOE_SCALE_BYTES) -> WeightBytes:
    rep = split = experts = 0
    for i, ratio in enumerate(m.compress_ratios):
        lb = layer_bytes(m, ratio, tp, layer_id=i, scale_bytes=scale_bytes)
        rep, split, experts = rep + lb.replicated, split + lb.split, experts + lb.experts
    rep += m.hidden_size * 2 + m.hc_mult * m.hc_mult * m.hidden_size * 4  # final norm, hc_head
    split += 2 * m.vocab_size * m.hidden_size * 2  # embedding + lm_head, split by vocabulary
    return WeightBytes(rep, split // tp, experts)


def mtp_weights(m: ModelShape, tp: int, scale_bytes: int = MOE_SCALE_BYTES) -> WeightBytes:
    """The NextN layer the draft worker loads (embedding and lm_head shared with the target)."""
    lb = layer_bytes(m, 0, tp, nextn=True, scale_bytes=scale_bytes)
    h = m.hidden_size
    rep = lb.replicated + 2 * fp8_bytes(h, h) + 3 * h * 2 + m.hc_mult * m.hc_mult * h * 4
    return WeightBytes(rep, lb.split // tp, lb.experts)


def ring_size(ratio: int, speculative: bool) -> int:
    """deepseek_v4_memory_pool.py get_compress_state_ring_size (online c128 off)."""
    if speculative:
        return 16 if ratio == 4 else 256
    return 8 if ratio == 4 else 128


def bytes_per_token(m: ModelShape, speculative: bool, swa_ratio: float = SWA_FULL_TOKENS_RATIO) -> float:
    """KV-pool bytes per token of context on one GPU (the KV head is not split by TP):
    DSV4PoolConfigurator._get_bytes_per_full_token, inflated by (layers + 1) / layers with MTP."""
    kv = m.qk_nope_head_dim + m.qk_rope_head_dim * 2 + 8
    idx = m.index_head_dim + m.index_head_dim // 128 * 4
    attn = m.head_dim
    c4_state, c128_state, idx_state = 2 * 2 * attn * 4, 2 * attn * 4, 2 * 2 * m.index_head_dim * 4
    c4_ring = ring_size(4, speculative) / m.window_size
    c128_ring = ring_size(128, speculative) / m.window_size
    n = len(m.compress_ratios)
    n4 = sum(1 for r in m.compress_ratios if r == 4)
    n128 = sum(1 for r in m.compress_ratios if r == 128)
    b = (swa_ratio * kv * n + kv * n4 / 4 + kv * n128 / 128 + idx * n4 / 4
         + swa_ratio * c4_ring * c4_state * n4 + swa_ratio * c128_ring * c128_state * n128
         + swa_ratio * c4_ring * idx_state * n4)
    return b * (n + 1) / n if speculative else b


@dataclass(frozen=True)
class MemoryFit:
    """One worker's per-GPU memory, as `plan` shows it and `up`/`doctor` judge it."""

    worker: str
    role: str
    index: int
    tp: int
    speculative: bool
    card_mib: int
    card_source: str  # "topology" or "assumed"
    mem_fraction_static: float
    fraction_source: str  # "config" or "sglang default (assumed)"
    weights_gib: float
    mtp_gib: float  # 0 without speculative decoding
    kv_gib: float
    kv_tokens: int
    bytes_per_token: float
    headroom_gib: float  # outside the static pool, before the MTP layer
    reserve_gib: float  # what SGLang's default leaves outside it
    context_length: int | None
    scale_bytes: int
    status: str  # ok | warn | error
    finding: str
    fix: str = ""
    # decode: the largest CUDA-graph batch (requests) and the rows its verify graphs hold (x draft tokens)
    graph_max_bs: int | None = None
    graph_rows: int | None = None


def refit(f: MemoryFit, shape: ModelShape) -> MemoryFit:
    """The same worker's arithmetic for another model shape (doctor: the checkpoint's own config.json)."""
    return fit(f.worker, f.role, f.index, f.tp, f.card_mib if f.card_source == "topology" else None,
               f.mem_fraction_static if f.fraction_source == "config" else None, f.context_length, f.speculative,
               shape, f.scale_bytes, graph_max_bs=f.graph_max_bs,
               draft_tokens=(f.graph_rows // f.graph_max_bs) if f.graph_rows and f.graph_max_bs else 1)


def _gib(n: float) -> float:
    return n / GIB


def fraction_for(need_gib: float, free_gib: float) -> float | None:
    """The smallest mem_fraction_static (in hundredths) whose static pool holds `need_gib`, or None when
    none below 1 does and still leaves MIN_OUTSIDE_GIB outside the pool: a fix never names a fraction
    SGLang refuses or one that leaves nothing for CUDA graphs and activations."""
    if free_gib <= MIN_OUTSIDE_GIB:
        return None
    want = max(0.01, math.ceil(need_gib / free_gib * 100 - 1e-9) / 100)
    return want if want <= 1 - MIN_OUTSIDE_GIB / free_gib else None


def fit(name: str, role: str, index: int, tp: int, card_mib: int | None, mem_fraction: float | None,
        context_length: int | None, speculative: bool, shape: ModelShape = ModelShape(),
        scale_bytes: int = MOE_SCALE_BYTES, *, graph_max_bs: int | None = None, draft_tokens: int = 1) -> MemoryFit:
    """The arithmetic for one worker and its verdict (error: SGLang would stop at start; warn: it
    starts but serves less than the config asks). `graph_max_bs` (decode): the batch its CUDA graphs
    cover, which its KV pool must hold as CLAIMED_STREAM_TOKENS-token streams."""
    card_src = "topology" if card_mib else "assumed"
    card = card_mib or RTX6000_MIB
    reserve = SGLANG_RESERVE_GIB + (SGLANG_SPEC_RESERVE_GIB if speculative else 0.0)
    free = card * MIB / GIB - RUNTIME_GIB
    frac_src = "config" if mem_fraction is not None else "sglang default (assumed)"
    frac = mem_fraction if mem_fraction is not None else max(0.0, 1 - reserve / (card * MIB / GIB))
    weights = _gib(target_weights(shape, tp, scale_bytes).total)
    mtp = _gib(mtp_weights(shape, tp, scale_bytes).total) if speculative else 0.0
    bpt = bytes_per_token(shape, speculative)
    kv = frac * free - weights
    tokens = max(0, int(kv * GIB / bpt))
    headroom = (1 - frac) * free
    key = f"{role}.{index}.mem_fraction_static"
    status, finding, fix = "ok", f"{name}: fits", ""
    need_ctx = context_length or 0
    larger_tp = "run this worker at a larger TP (the default TP4 layout)"
    if kv <= 0:
        want = fraction_for(weights + (need_ctx * bpt / GIB if need_ctx else 1.0), free)
        # an error only where even a card with no runtime overhead could not hold them
        status = "error" if frac * card * MIB / GIB <= weights else "warn"
        finding = (f"{name}: weights {weights:.1f} GiB per GPU at TP{tp} do not fit in the static pool "
                   f"({frac:.2f} x {free:.1f} GiB = {frac * free:.1f} GiB): SGLang stops with \"Not enough memory\" "
                   "after loading them")
        some = fraction_for(weights + 1.0, free)  # the weights and a 1 GiB pool, for a shorter context
        if want is not None:
            fix = (f"--set {key}={want:.2f} if the card can spare it (it leaves {(1 - want) * free:.1f} GiB for CUDA "
                   f"graphs and activations), or {larger_tp}")
        elif some is not None:
            fix = (f"--set {key}={some:.2f} and a shorter engine.context_length (that pool holds "
                   f"{int((some * free - weights) * GIB / bpt):,} tokens), or {larger_tp}")
        else:
            fix = (f"{larger_tp[0].upper()}{larger_tp[1:]}, or run it on a larger card: no {key} below 1 holds "
                   f"{weights:.1f} GiB of weights per GPU and leaves {MIN_OUTSIDE_GIB:.0f} GiB for CUDA graphs and "
                   f"activations on this {card * MIB / GIB:.1f} GiB card")
    elif need_ctx and tokens < need_ctx:
        want = fraction_for(weights + need_ctx * bpt / GIB, free)
        status = "warn"
        finding = (f"{name}: its KV pool holds {tokens:,} tokens, less than one request at the context length "
                   f"{need_ctx:,}: long requests will be refused or queued")
        ways = [f"--set {key}={want:.2f} (leaves {(1 - want) * free:.1f} GiB outside the pool)"] if want else []
        ways += [f"--set engine.context_length={tokens} (what the pool holds now)"] if tokens else []
        fix = ", ".join(ways + ["or use a larger TP"]) + ("" if want else (
            f": no {key} below 1 holds one {need_ctx:,}-token request and leaves {MIN_OUTSIDE_GIB:.0f} GiB for CUDA "
            "graphs and activations on this card"))
    elif (1 - frac) * card * MIB / GIB < reserve - 1e-6:  # SGLang's own rule: the fraction leaves `reserve` of the card
        status = "warn"
        draft = f" (and the {mtp:.1f} GiB MTP layer, which loads after the pool is sized)" if mtp else ""
        finding = (f"{name}: {headroom:.1f} GiB per GPU stays outside the static pool for CUDA graphs and "
                   f"activations{draft}"
                   f"; SGLang's own default leaves {reserve:.0f} GiB on a card this size, so graph capture may run "
                   "out of memory")
        fix = (f"lower {key} if the KV pool can shrink (it holds {tokens:,} tokens), lower cuda_graph_max_bs, or use "
               "a larger TP; the worker log's \"avail mem\" after CUDA-graph capture is the measurement")
    elif graph_max_bs and tokens < graph_max_bs * CLAIMED_STREAM_TOKENS:
        status = "warn"
        finding = (f"{name}: its CUDA graphs cover {graph_max_bs} requests but its KV pool holds {tokens:,} tokens, "
                   f"{tokens // CLAIMED_STREAM_TOKENS} streams of {CLAIMED_STREAM_TOKENS:,} tokens: the largest "
                   "batches never form")
        fix = (f"--set {role}.{index}.cuda_graph_max_bs={max(1, tokens // CLAIMED_STREAM_TOKENS)}, or raise {key} / "
               "use a larger TP")
    return MemoryFit(worker=name, role=role, index=index, tp=tp, speculative=speculative, card_mib=card,
                     card_source=card_src, mem_fraction_static=round(frac, 4),
                     fraction_source=frac_src, weights_gib=round(weights, 2), mtp_gib=round(mtp, 2),
                     kv_gib=round(kv, 2), kv_tokens=tokens, bytes_per_token=round(bpt, 2),
                     headroom_gib=round(headroom, 2), reserve_gib=reserve, context_length=context_length,
                     scale_bytes=scale_bytes, status=status, finding=finding, fix=fix, graph_max_bs=graph_max_bs,
                     graph_rows=graph_max_bs * draft_tokens if graph_max_bs else None)
