"""Host side of the block-scaled FP8 GEMM: config table, the shape-keyed planner, the two drop-ins.

Two public entries, each exactly the contract of the sglang 0.5.13.post1 function it replaces:

* `w8a8_block_fp8_linear(input, weight, block_size, weight_scale, input_scale=None, bias=None)`:
  `layers/quantization/fp8_utils.py::triton_w8a8_block_fp8_linear`, the function the sm_120
  dispatch (`dispatch_w8a8_block_fp8_linear`, Triton backend forced on sm_120) hands every
  128x128-block FP8 linear. Upstream quantizes the activation per token and 128-column group (one
  kernel) and then runs `w8a8_block_fp8_matmul_triton` (a second); here both are one launch for
  decode-sized calls (`GemmConfig.fuse_quant`) and two for prefill (the quant re-done per output
  tile would cost more than the launch). Then `output += bias` and the same dtype/shape as upstream.
* `w8a8_block_fp8_matmul(A, B, As, Bs, block_size, output_dtype=torch.float16)`:
  `layers/quantization/fp8_kernel.py::w8a8_block_fp8_matmul_triton`, the GEMM on an already
  quantized activation (As may be column-major, as upstream allows; K need not be a multiple of 128).

What is computed exactly: [128, 128] blocks, e4m3 operands, fp32 scales, bf16/fp16/fp32 output
(and for the linear a bf16/fp16/fp32 contiguous input whose K is a multiple of 128). Any other
variant upstream accepts (UE8M0 int32 scales, other block sizes or fp8 dtypes, a pre-quantized
`input_scale`, empty inputs, ...) goes to upstream's own function, unchanged; where upstream is not
loaded (no SGLang in the process) that raises NotImplementedError instead of answering differently.

Why a planner and not autotuning: grids, splits and buffers are functions of shapes only, so a
CUDA graph captured once replays correctly, and every config the planner can launch is known
ahead of time so `check_sm120` can prove it fits sm_120 (<= 101376 B shared memory, no spills).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from v4flash_kernels.fp8_gemm import kernel as _k
from v4flash_kernels.hook.patches import FP8_GEMM

FP8 = torch.float8_e4m3fn
GROUP = int(_k.GROUP)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_UTILS, UPSTREAM_LINEAR = FP8_GEMM.target_module, FP8_GEMM.target_attr  # what the hook replaces with ours
FP8_KERNEL = "sglang.srt.layers.quantization.fp8_kernel"
UPSTREAM_MATMUL = "w8a8_block_fp8_matmul_triton"
SPLIT_MAX_M = 256  # prefill (more rows) runs upstream's tiling unsplit: never slower than its GEMM
QUANT_BLOCK_R = 32  # rows per program of the standalone activation quant
QUANT_NUM_WARPS = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmConfig:
    """One compiled variant of `gemm_kernel` and how far the planner may split K for it."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    swap: bool = False  # tile = W_tile . A_tile^T: the weight fills the MMA's M side (decode rows are few)
    fuse_quant: bool = False  # the linear quantizes the activation inside the GEMM (one launch)
    max_split: int = 1  # K split over up to this many programs per tile (last-arriving one reduces)
    ctas_per_sm: int = 2  # programs per SM the split aims at (all resident: one wave)
    group_m: int = 8

    @property
    def name(self) -> str:
        tags = ("_swap" if self.swap else "") + ("_fq" if self.fuse_quant else "") + (
            f"_sk{self.max_split}c{self.ctas_per_sm}" if self.max_split > 1 else "") + (
            f"_g{self.group_m}" if self.group_m != 8 else "")
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}{tags}"


@dataclass(frozen=True)
class Plan:
    """One call's launch: the config and how many programs share each tile's K (1 = no split)."""

    config: GemmConfig
    split: int

    @property
    def name(self) -> str:
        return f"{self.config.name}/split{self.split}"


# Every config the planner may launch (check_sm120 compiles each for sm_120 and sm_90, with the
# activation quant fused where `fuse_quant` and without, since the GEMM entry takes pre-quantized A).
# Decode (M <= 16): swap-AB, 16 activation rows padded, 128 weight rows per program, K split so the
# grid is ~2 programs per SM, each streaming 16-32 KB of weight with its loads all in flight.
DECODE = GemmConfig(16, 128, 4, 2, swap=True, fuse_quant=True, max_split=64)
# ... with 64 weight rows, where 128-row tiles split as far as K allows still leave SMs idle (small K).
DECODE_NARROW = GemmConfig(16, 64, 4, 2, swap=True, fuse_quant=True, max_split=64)
SMALL = GemmConfig(32, 64, 4, 2, fuse_quant=True, max_split=64)  # 17..32 rows
MEDIUM = GemmConfig(64, 64, 4, 2, fuse_quant=True, max_split=64)  # 33..64 rows
# 65 rows and up: upstream's default config (64x128x128 tiles, 4 warps, 3 stages, tile groups of 32
# rows) after a separate quant; split only up to SPLIT_MAX_M rows, where the tiles alone leave SMs idle.
LARGE = GemmConfig(64, 128, 4, 3, max_split=8, group_m=32)
CONFIGS: Tuple[GemmConfig, ...] = (DECODE, DECODE_NARROW, SMALL, MEDIUM, LARGE)
BUCKETS: Tuple[Tuple[int, GemmConfig], ...] = ((16, DECODE), (32, SMALL), (64, MEDIUM))

# Candidates `bench --sweep` times next to the table; one may only ship after check_sm120 passes it.
SWEEP: Tuple[GemmConfig, ...] = (
    DECODE,
    DECODE_NARROW,
    GemmConfig(16, 128, 4, 3, swap=True, fuse_quant=True, max_split=64, ctas_per_sm=4),
    GemmConfig(16, 64, 4, 2, fuse_quant=True, max_split=64),
    GemmConfig(16, 128, 8, 2, swap=True, fuse_quant=True, max_split=64, ctas_per_sm=1),
    SMALL,
    MEDIUM,
    GemmConfig(64, 128, 4, 2, fuse_quant=True, max_split=64),
    GemmConfig(64, 64, 4, 2, max_split=64),
    LARGE,
    GemmConfig(64, 128, 4, 3, max_split=8),
    GemmConfig(128, 128, 8, 2, max_split=8),
    GemmConfig(128, 128, 8, 3, max_split=8),
)


@dataclass(frozen=True)
class Binary:
    """One `gemm_kernel` specialization the entries can launch: its config, operand types, split."""

    config: GemmConfig
    a_dtype: str  # "bf16" / "fp32": unquantized activation (QUANT_A), "fp8": pre-quantized
    c_dtype: str
    split: bool

    @property
    def name(self) -> str:
        return f"{self.config.name}/{self.a_dtype}-{self.c_dtype}/{'split' if self.split else 'whole'}"


def launchable() -> Tuple[Binary, ...]:
    """The `gemm_kernel` binaries check_sm120 compiles: per config, what DeepSeek-V4 launches (bf16 in
    and out; fused quant where the config fuses, else e4m3 A after the quant kernel; with and without
    a split) and the widest operands any caller can pass (fp32 in / fp32 out: the most shared memory)."""
    out: List[Binary] = []
    for c in CONFIGS:
        splits = (False, True) if c.max_split > 1 else (False,)
        a_kinds = (("bf16", "bf16"), ("fp8", "bf16")) if c.fuse_quant else (("fp8", "bf16"),)
        out += [Binary(c, a, o, sp) for a, o in a_kinds for sp in splits]
        wide = (("fp32", "fp32"), ("fp8", "fp32")) if c.fuse_quant else (("fp8", "fp32"),)
        out += [Binary(c, a, o, splits[-1]) for a, o in wide]
    return tuple(out)


def config_for(m: int, n: int = 0, k: int = 0, num_sms: int = 0) -> GemmConfig:
    """The config of an [m, k] x [n, k]^T call: by rows; decode narrows its tiles when N x K is small."""
    for top, cfg in BUCKETS:
        if m <= top:
            if cfg is DECODE and cdiv(n, cfg.block_n) * min(cfg.max_split, cdiv(k, GROUP)) < num_sms:
                return DECODE_NARROW
            return cfg
    return LARGE


def split_for(cfg: GemmConfig, m: int, n: int, k: int, num_sms: int) -> int:
    """Programs per tile along K: fill ~`ctas_per_sm` x SMs when the tiles alone do not; every split
    gets the same whole number of 128-wide groups except the last (never an empty one)."""
    if m > SPLIT_MAX_M:
        return 1
    groups = cdiv(k, GROUP)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    want = min(cfg.max_split, groups, (cfg.ctas_per_sm * num_sms) // max(1, tiles))
    if want < 2:
        return 1
    return cdiv(groups, cdiv(groups, want))


def plan(m: int, n: int, k: int, num_sms: int, config: GemmConfig | None = None) -> Plan:
    """The launch for an [m, k] x [n, k]^T call on a GPU with `num_sms` SMs (pure function of shapes)."""
    cfg = config or config_for(m, n, k, num_sms)
    return Plan(cfg, split_for(cfg, m, n, k, num_sms))


_SMS: Dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """SM count, cached per device; host-only (no sync), so safe during CUDA-graph capture."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


# Split-K tickets, one int32 per output tile, per device and stream. Zeroed once when allocated;
# every call leaves them at zero again (the reducing program resets its tile's), so CUDA graphs
# replay with no reset kernel. Never freed: a captured graph keeps the pointer it was captured with.
_TICKETS: Dict[tuple, torch.Tensor] = {}
_OLD_TICKETS: List[torch.Tensor] = []


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed split-K tickets for the current stream (two streams never share one)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OLD_TICKETS.append(buf)
        buf = torch.zeros(max(1024, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


# ----------------------------------------------------------------------------- launches


def quantize_activation(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token 128-group e4m3 quant of a contiguous [M, K] (K % 128 == 0) -> (codes, [M, K/128] fp32 scales)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    if m:
        _k.act_quant_kernel[(cdiv(m, QUANT_BLOCK_R), k // GROUP)](
            x, x.stride(0), q, q.stride(0), s, s.stride(0), m, BLOCK_R=QUANT_BLOCK_R, num_warps=QUANT_NUM_WARPS)
    return q, s


def launch(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
           out: torch.Tensor, p: Plan, a_scale_strides: Tuple[int, int] | None = None) -> torch.Tensor:
    """`out[M, N] = GEMM(a, weight)`; `a_scale` None: `a` is unquantized and quantized in the kernel.

    `a` is [M, K] with K contiguous, `out` [M, N] with N contiguous; `a_scale_strides` overrides the
    strides of `a_scale` (upstream indexes an N-d As by its last two strides).
    """
    m, k = a.shape
    n = weight.shape[0]
    cfg = p.config
    groups = cdiv(k, GROUP)
    per = cdiv(groups, p.split)
    split = cdiv(groups, per)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split > 1:
        ws: torch.Tensor = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        cnt = tickets(a.device, tiles)
    else:
        ws, cnt = out, out  # not read (SPLIT=False)
    quant_a = a_scale is None
    if quant_a:
        scale, (sam, sak) = weight_scale, (0, 0)  # not read (QUANT_A=True)
    else:
        assert a_scale is not None
        scale = a_scale
        sam, sak = a_scale_strides or (a_scale.stride(0), a_scale.stride(1))
    _k.gemm_kernel[(tiles, split)](
        a, a.stride(0),
        scale, sam, sak,
        weight, weight.stride(0),
        weight_scale, weight_scale.stride(0), weight_scale.stride(1),
        out, out.stride(0),
        ws, cnt,
        m, n, k, per,
        QUANT_A=quant_a,
        SWAP=cfg.swap,
        SPLIT=split > 1,
        EVEN_K=k % GROUP == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def linear_2d(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
              config: GemmConfig | None = None, split: int | None = None) -> torch.Tensor:
    """The linear's core on a supported call (see `unsupported_linear`): `[M, N]` in x's dtype.

    `config` / `split` override the planner (tests and the benchmark's sweep)."""
    m, k = x.shape
    n = weight.shape[0]
    p = plan(m, n, k, num_sms(x.device), config)
    if split is not None:
        p = Plan(p.config, split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if p.config.fuse_quant:
        return launch(x, None, weight, weight_scale, out, p)
    q, s = quantize_activation(x)
    return launch(q, s, weight, weight_scale, out, p)


# ----------------------------------------------------------------------------- what is computed here


def _is_block(block_size: Any) -> bool:
    try:
        return len(block_size) == 2 and int(block_size[0]) == GROUP and int(block_size[1]) == GROUP
    except TypeError:
        return False


def _weight_issue(weight: torch.Tensor, weight_scale: torch.Tensor) -> str | None:
    if weight.dtype != FP8 or weight.dim() != 2 or not weight.is_contiguous():
        return f"weight {weight.dtype} {tuple(weight.shape)} (contiguous 2-d e4m3fn handled)"
    n, k = weight.shape
    if n == 0 or k == 0:
        return "empty weight"
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (cdiv(n, GROUP), cdiv(k, GROUP)):
        return f"weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} (fp32 per 128x128 block handled)"
    if weight_scale.device != weight.device:
        return "weight_scale on another device"
    return None


def unsupported_linear(input: torch.Tensor, weight: torch.Tensor, block_size: Sequence[int],
                       weight_scale: torch.Tensor, input_scale: torch.Tensor | None) -> str | None:
    """None when `w8a8_block_fp8_linear` computes this call itself, else why upstream's function does."""
    if input_scale is not None:
        return "pre-quantized input (input_scale)"
    if not _is_block(block_size):
        return f"block_size {block_size!r}"
    why = _weight_issue(weight, weight_scale)
    if why:
        return why
    if input.dtype not in OUT_DTYPES or input.dim() < 1 or input.device != weight.device:
        return f"input {input.dtype} on {input.device}"
    k = input.shape[-1]
    if k != weight.shape[1] or k % GROUP or not input.is_contiguous() or input.numel() == 0:
        return f"input shape {tuple(input.shape)} (contiguous, K = weight's, a multiple of 128, non-empty)"
    return None


def unsupported_matmul(A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor,
                       block_size: Sequence[int], output_dtype: torch.dtype) -> str | None:
    """None when `w8a8_block_fp8_matmul` computes this call itself, else why upstream's function does."""
    if not _is_block(block_size):
        return f"block_size {block_size!r}"
    why = _weight_issue(B, Bs)
    if why:
        return why
    if output_dtype not in OUT_DTYPES:
        return f"output_dtype {output_dtype}"
    if A.dtype != FP8 or A.dim() < 2 or not A.is_contiguous() or A.numel() == 0 or A.device != B.device:
        return f"A {A.dtype} {tuple(A.shape)} (contiguous, >= 2-d, e4m3fn, non-empty)"
    k = A.shape[-1]
    if k != B.shape[1]:
        return "A and B disagree on K"
    if As.dtype != torch.float32 or tuple(As.shape) != (*A.shape[:-1], cdiv(k, GROUP)) or As.device != A.device:
        return f"As {As.dtype} {tuple(As.shape)} (fp32, A's rows x ceil(K/128))"
    return None


def upstream_function(module: str, attr: str) -> Callable[..., Any]:
    """SGLang's own function (the one the hook replaced, kept next to ours), for calls we do not compute."""
    from v4flash_kernels.hook.hook import upstream_keep_attr

    mod = sys.modules.get(module)
    fn = None
    if mod is not None:
        kept = upstream_keep_attr(FP8_GEMM) if (module, attr) == (FP8_UTILS, UPSTREAM_LINEAR) else None
        fn = (getattr(mod, kept, None) if kept else None) or getattr(mod, attr, None)
    if fn is None or getattr(fn, "__module__", None) == __name__:
        raise NotImplementedError(f"{module}.{attr} is not loaded in this process")
    return fn


def _fallback(module: str, attr: str, why: str) -> Callable[..., Any]:
    try:
        return upstream_function(module, attr)
    except NotImplementedError as exc:
        raise NotImplementedError(f"v4flash fp8_gemm does not compute this call ({why}) and {exc}") from None


# ----------------------------------------------------------------------------- the drop-ins


def w8a8_block_fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    block_size: List[int],
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-FP8 linear `input @ dequant(weight)^T (+ bias)`; same contract as sglang 0.5.13.post1
    `fp8_utils.triton_w8a8_block_fp8_linear` (output in the input's dtype and leading shape)."""
    why = unsupported_linear(input, weight, block_size, weight_scale, input_scale)
    if why is not None:
        return _fallback(FP8_UTILS, UPSTREAM_LINEAR, why)(input, weight, block_size, weight_scale, input_scale, bias)
    input_2d = input.view(-1, input.shape[-1])
    output_shape = [*input.shape[:-1], weight.shape[0]]
    output = linear_2d(input_2d, weight, weight_scale)
    if bias is not None:
        output += bias
    return output.to(dtype=input_2d.dtype).view(*output_shape)


def w8a8_block_fp8_matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    As: torch.Tensor,
    Bs: torch.Tensor,
    block_size: List[int],
    output_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """`C = A . B^T` with per-token-group `As` and per-block `Bs` scales, a new tensor in `output_dtype`;
    same contract as sglang 0.5.13.post1 `fp8_kernel.w8a8_block_fp8_matmul_triton`."""
    why = unsupported_matmul(A, B, As, Bs, block_size, output_dtype)
    if why is not None:
        return _fallback(FP8_KERNEL, UPSTREAM_MATMUL, why)(A, B, As, Bs, block_size, output_dtype)
    k = A.shape[-1]
    n = B.shape[0]
    a2 = A.view(-1, k)
    m = a2.shape[0]
    C = A.new_empty(A.shape[:-1] + (n,), dtype=output_dtype)
    p = plan(m, n, k, num_sms(A.device))
    launch(a2, As, B, Bs, C.view(m, n), p, a_scale_strides=(As.stride(-2), As.stride(-1)))
    return C
