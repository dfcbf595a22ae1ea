"""Host side of the fused q path (wq_b's block-FP8 GEMM + per-head RMSNorm + RoPE): plan, functional op, drop-in.

The drop-in `compute_q_b(self, q, positions, q_out=None)` replaces sglang 0.5.13.post1's
`models/deepseek_v4.py::MQALayer._compute_q_b` (same signature, same return value: `q_out`, or a new
`[T, n_local_heads, head_dim]` tensor when `q_out` is None). Upstream runs two kernels there:
`self.wq_b(q)` (on sm_120 the block-FP8 linear, i.e. our `fp8_gemm` drop-in when that switch is on)
and the JIT `fused_q_norm_rope(q, q_out, eps, freqs_cis, positions)`. Ours is one launch
(`kernel.qnorm_rope_kernel`) for the decode and verify rows, and upstream's method, unchanged, for
everything else.

When the fused path is taken (`unsupported_layer` and `unsupported` both None), and why it is exact:
- `wq_b` computes our block-FP8 linear: its quant method dispatches block linears to
  `fp8_gemm.op.w8a8_block_fp8_linear` (SGLang's `Fp8LinearMethod` captures the dispatched function
  when it is built, so this holds only where the `fp8_gemm` patch was active), 128x128 blocks, no
  Marlin / MXFP8 / AMX branch, no bias, no output gather. With the `fp8_gemm` switch off, wq_b runs
  upstream's GEMM, and this patch leaves the whole method to upstream: the fusion never changes which
  GEMM arithmetic runs. The fused GEMM is the same function as ours (the same activation codes and
  scales bit for bit, the same e4m3 products, each K step's sum scaled as `(dot * a_scale) * w_scale`,
  fp32 accumulation, one bf16 rounding); only the fp32 summation order differs from our GEMV / split
  tiles (as theirs differs from upstream's GEMM), within `reference.error_bound`.
- `1 <= T <= MAX_ROWS` rows (decode B x (k+1) up to 16); `q` a contiguous bf16 [T, K] with K =
  `FUSED_K` (1024, q_lora_rank), the weight (`n_local_heads * 512` rows) and its scales contiguous;
  `head_dim` 512 with a 64-dim RoPE; `freqs_cis` contiguous complex64 [positions, 32]; `positions`
  contiguous int32/int64 [T]; `q_out` None or bf16 [T, n_local_heads, 512] with upstream's strides
  (dims contiguous, heads 512 apart; the row stride free: the padded 64-head q's slice at TP > 1) not
  overlapping `q`; all on the weight's device.
Anything else (prefill chunks, the MTP draft's other shapes, another dtype) goes to upstream's
`_compute_q_b` as the hook kept it. A layer whose wq_b is not ours is said once per reason in the log.

Plans are functions of shapes only (CUDA-graph safe); every config `launchable()` lists is what
`check_sm120` compiles.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple, cast

import torch

from v4flash_kernels.fp8_gemm import op as fp8
from v4flash_kernels.hook.patches import QNORM_ROPE
from v4flash_kernels.qnorm_rope import kernel as _k

HEAD_DIM = 512
ROPE_DIM = 64
BM = 16  # the kernel's rows block (the MMA's smallest N)
MAX_ROWS = BM  # more rows: upstream's method (prefill: the separate GEMM tiles re-use the weight)
# wq_b's K (DeepSeek-V4's q_lora_rank). The kernel's K is a compile-time constant (the whole activation
# is quantized into registers up front, and every weight offset is an immediate); other K run upstream's
# method: their binaries are not cross-compiled.
FUSED_K = 1024
GROUP = fp8.GROUP

log = logging.getLogger("v4flash_kernels.hook.hook.qnorm_rope")


@dataclass(frozen=True)
class QConfig:
    """One compiled variant of `qnorm_rope_kernel`: warps, K per pipelined step, pipeline depth."""

    num_warps: int
    block_k: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"h{HEAD_DIM}_bm{BM}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}"


# NOT MEASURED: chosen without a GPU. One program per head streams its 512 x 1024 e4m3 (512 KB) alone,
# so what sets its time is the bytes it keeps in flight: num_stages - 1 weight tiles of 512 x block_k
# (three 32 KB tiles here; with the activation's 2 KB stage that is 100352 B of shared memory, what
# sm_120's 101376 B per block allows). The H200 sweep over `CANDIDATES` decides; check_sm120 compiles
# each for sm_120 and sm_90 (no spills, within the shared memory).
CONFIG = QConfig(num_warps=8, block_k=64, num_stages=4)
CANDIDATES: Tuple[QConfig, ...] = (CONFIG, QConfig(8, 64, 3), QConfig(8, 64, 2), QConfig(8, 32, 7), QConfig(8, 32, 5),
                                   QConfig(16, 64, 3))


def launchable() -> Tuple[QConfig, ...]:
    """The configs a call can launch (the plan has one) plus the sweep's candidates: all compiled by check_sm120."""
    return tuple(dict.fromkeys((CONFIG, *CANDIDATES)))


# ----------------------------------------------------------------------------- what is computed here


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors intersect (conservative: first to last element)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> Tuple[int, int]:
        lo = t.data_ptr()
        hi = lo + t.element_size() * (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())))
        return lo, hi

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def unsupported(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, n_heads: int,
                freqs_cis: torch.Tensor, positions: torch.Tensor, q_out: torch.Tensor | None) -> str | None:
    """None when `qnorm_rope` computes this call exactly, else why upstream's method does (module doc)."""
    why = fp8.unsupported_linear(x, weight, [GROUP, GROUP], weight_scale, None)
    if why is not None:
        return f"wq_b: {why}"
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        return f"input {x.dtype} {tuple(x.shape)} (2-d bf16 handled)"
    m, k = x.shape
    if k != FUSED_K or not weight_scale.is_contiguous():
        return f"wq_b K={k} with {'contiguous' if weight_scale.is_contiguous() else 'strided'} scales " \
               f"(K={FUSED_K}, contiguous fused)"
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (1..{MAX_ROWS} fused)"
    if weight.shape[0] != n_heads * HEAD_DIM:
        return f"wq_b has {weight.shape[0]} rows, not {n_heads} heads x {HEAD_DIM}"
    if (freqs_cis.dtype != torch.complex64 or freqs_cis.dim() != 2 or freqs_cis.shape[1] * 2 != ROPE_DIM
            or not freqs_cis.is_contiguous() or freqs_cis.device != x.device):
        return f"freqs_cis {freqs_cis.dtype} {tuple(freqs_cis.shape)} (contiguous complex64 [P, {ROPE_DIM // 2}])"
    if (positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1 or positions.shape[0] != m
            or positions.stride(0) != 1 or positions.device != x.device):
        return f"positions {positions.dtype} {tuple(positions.shape)} (contiguous int32/int64 [{m}])"
    if q_out is not None:
        if (q_out.dtype != x.dtype or tuple(q_out.shape) != (m, n_heads, HEAD_DIM) or q_out.stride(2) != 1
                or q_out.stride(1) != HEAD_DIM or q_out.device != x.device):
            return (f"q_out {q_out.dtype} {tuple(q_out.shape)} strides {q_out.stride()} "
                    f"(bf16 [{m}, {n_heads}, {HEAD_DIM}], heads {HEAD_DIM} apart, dims contiguous)")
        if _overlap(q_out, x):
            return "q_out overlaps the input"
    return None


def launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, n_heads: int, eps: float,
           freqs_real: torch.Tensor, positions: torch.Tensor, out: torch.Tensor, config: QConfig) -> torch.Tensor:
    """One `qnorm_rope_kernel` launch on a supported call (`freqs_real` = view_as_real(freqs_cis) as [P, 64])."""
    m, k = x.shape
    _k.qnorm_rope_kernel[(n_heads,)](
        x, weight, weight_scale, freqs_real, freqs_real.stride(0), positions, out, out.stride(0), m, float(eps),
        K=k, HEAD_DIM=HEAD_DIM, ROPE=ROPE_DIM, BM=BM, BLOCK_K=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


def qnorm_rope(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, n_heads: int, eps: float,
               freqs_cis: torch.Tensor, positions: torch.Tensor, q_out: torch.Tensor | None = None, *,
               config: QConfig | None = None) -> torch.Tensor:
    """The fused op: `q_out[t, h] = rope(rmsnorm(bf16(quant(x[t]) . dequant(W_h)^T)))` (module doc); returns
    q_out (a new contiguous [T, n_heads, 512] bf16 tensor when None). ValueError on a call it does not compute."""
    why = unsupported(x, weight, weight_scale, n_heads, freqs_cis, positions, q_out)
    if why is not None:
        raise ValueError(f"qnorm_rope does not compute this call: {why}")
    if q_out is None:
        q_out = torch.empty((x.shape[0], n_heads, HEAD_DIM), dtype=x.dtype, device=x.device)
    freqs_real = torch.view_as_real(freqs_cis).flatten(-2)  # a view: contiguous [P, 64] fp32
    return launch(x, weight, weight_scale, n_heads, eps, freqs_real, positions, q_out, config or CONFIG)


# ----------------------------------------------------------------------------- the drop-in


def linear_operands(wq_b: Any) -> Tuple[torch.Tensor, torch.Tensor] | str:
    """(weight, weight_scale) when `wq_b(x)` is exactly `fp8_gemm.op.w8a8_block_fp8_linear(x, weight,
    [128, 128], weight_scale)` (SGLang's ColumnParallelLinear over Fp8LinearMethod's block path), else why not.

    In the pinned sglang the only quant method that carries `w8a8_block_fp8_linear` is `Fp8LinearMethod`,
    whose `apply` takes the block branch exactly when `block_quant` is set and Marlin, MXFP8 and the
    AMX backend are not; `MQALayer` builds wq_b without a bias and without an output gather."""
    qm = getattr(wq_b, "quant_method", None)
    if getattr(qm, "w8a8_block_fp8_linear", None) is not fp8.w8a8_block_fp8_linear:
        return "wq_b's block-FP8 linear is not v4flash's (the fp8_gemm switch is off, or wq_b is not block-FP8)"
    if getattr(qm, "block_quant", False) is not True or getattr(qm, "use_marlin", True) or getattr(qm, "use_mxfp8", True):
        return "wq_b's quant method takes another branch than the block-FP8 linear (Marlin / MXFP8 / not block)"
    block = getattr(getattr(qm, "quant_config", None), "weight_block_size", None)
    if block is None or [int(b) for b in block] != [GROUP, GROUP]:
        return f"wq_b's weight_block_size {block!r} (128 x 128 fused)"
    if getattr(wq_b, "use_intel_amx_backend", False) or getattr(wq_b, "bias", None) is not None:
        return "wq_b runs the AMX backend or has a bias"
    if getattr(wq_b, "gather_output", False):
        return "wq_b gathers its output across ranks"
    weight, scale = getattr(wq_b, "weight", None), getattr(wq_b, "weight_scale_inv", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return "wq_b has no weight / weight_scale_inv tensors"
    return weight, scale


def layer_operands(layer: Any) -> Tuple[torch.Tensor, torch.Tensor] | str:
    """wq_b's (weight, weight_scale) when this MQALayer's q path is the fused op's (our linear, 512-dim heads,
    64-dim RoPE), else why not."""
    ops = linear_operands(getattr(layer, "wq_b", None))
    if isinstance(ops, str):
        return ops
    if getattr(layer, "head_dim", None) != HEAD_DIM or getattr(layer, "qk_rope_head_dim", None) != ROPE_DIM:
        return f"head_dim {getattr(layer, 'head_dim', None)} / rope {getattr(layer, 'qk_rope_head_dim', None)}"
    return ops


def unsupported_layer(layer: Any) -> str | None:
    """None when this MQALayer's q path is the fused op's, else why not (`layer_operands`)."""
    ops = layer_operands(layer)
    return ops if isinstance(ops, str) else None


def upstream_compute_q_b() -> Callable[..., Any]:
    """SGLang's own `MQALayer._compute_q_b`, as the hook kept it next to ours."""
    from v4flash_kernels.hook.hook import upstream_keep_attr

    fn = getattr(sys.modules.get(QNORM_ROPE.target_module), upstream_keep_attr(QNORM_ROPE), None)
    if fn is None:
        raise NotImplementedError(f"{QNORM_ROPE.upstream_function} is not loaded in this process (hook not applied)")
    return cast(Callable[..., Any], fn)


_lock = threading.Lock()
_said: Dict[str, int] = {}  # layer-level reasons the fused path was refused -> calls (said once each)
_fused_calls = 0


def _refused(why: str) -> None:
    with _lock:
        first = why not in _said
        _said[why] = _said.get(why, 0) + 1
    if first:
        log.warning("q norm + RoPE fusion not used for an MQALayer, SGLang's wq_b + fused_q_norm_rope run: %s", why)


def status_detail() -> Dict[str, Any]:
    """For the hook's status: calls fused and layer-level refusals seen by Python (CUDA-graph replays are
    not calls: a captured call counts once)."""
    with _lock:
        said, fused = dict(_said), _fused_calls
    summary = f"{fused} fused call(s) seen" + (f"; refused for a layer: {next(iter(said))}" if said else "")
    return {"fused_calls": fused, "refused": said, "summary": summary}


def compute_q_b(self: Any, q: torch.Tensor, positions: torch.Tensor,
                q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `MQALayer._compute_q_b(self, q, positions, q_out=None)` (module doc)."""
    global _fused_calls
    ops = layer_operands(self)
    if isinstance(ops, str):
        _refused(ops)
    else:
        weight, scale = ops
        if unsupported(q, weight, scale, self.n_local_heads, self.freqs_cis, positions, q_out) is None:
            with _lock:
                _fused_calls += 1
            return qnorm_rope(q, weight, scale, self.n_local_heads, self.eps, self.freqs_cis, positions, q_out)
    return cast(torch.Tensor, upstream_compute_q_b()(self, q, positions, q_out))
