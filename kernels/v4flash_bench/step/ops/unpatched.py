"""The step's ops no patch replaces: the bf16 GEMMs (torch / cuBLAS) and the glue (norms, adds, the JIT
kernels' proxies), upstream only, each checked against fp64 or for exact copies."""

from __future__ import annotations

import math
from typing import Any, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from v4flash_bench.step import model as M
from v4flash_bench.step.ops import common as C
from v4flash_bench.step.ops.common import Check, Prepared
from v4flash_kernels import upstream as _up


def build_bf16_gemm(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    p = op.p
    m, n, k, groups = C.int_param(p, "m"), C.int_param(p, "n"), C.int_param(p, "k"), C.int_param(p, "groups")
    out_fp32 = bool(p["out_fp32"])
    g = C.gen(seed)
    r = C.rotations(groups * n * k * 2, l2)
    x = C.randn((m, groups, k) if groups > 1 else (m, k), g)
    ws = [C.randn((groups, n, k) if groups > 1 else (n, k), g, scale=k ** -0.5) for _ in range(r)]

    if groups > 1:  # wo_a: models/deepseek_v4.py, torch.einsum("tgd,grd->tgr") with the bf16 weight
        def one(w: Any) -> Any:
            return torch.einsum("tgd,grd->tgr", x, w)
        src = "torch.einsum (cuBLAS), as deepseek_v4.py runs wo_a on sm_120"
    elif out_fp32:  # compressor wkv_gate: jit_kernel/dsv4/gemm.py linear_bf16_fp32, "cublas" algo
        def one(w: Any) -> Any:
            if C.DEVICE == "cpu":  # no CPU kernel for mm.dtype; CPU runs only check the plumbing
                return torch.mm(x.float(), w.float().t())
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        src = "torch.mm(out_dtype=fp32) (cuBLAS), as linear_bf16_fp32 runs"
    else:
        def one(w: Any) -> Any:
            return F.linear(x, w)
        src = "F.linear (cuBLAS)"

    def run() -> None:
        for w in ws:
            one(w)

    def one_call(i: int) -> None:
        one(ws[i % len(ws)])

    def check() -> Check:
        """Exact bf16 inputs: the fp32 accumulation over k terms (in any order) and, for a bf16 output,
        its rounding and the bf16 reductions of partial sums torch allows cuBLAS by default."""
        out, w = one(ws[0]), ws[0]
        if groups > 1:
            ref = torch.einsum("tgd,grd->tgr", x.double(), w.double())
            mag = torch.einsum("tgd,grd->tgr", x.double().abs(), w.double().abs())
        else:
            ref, mag = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()
        rtol = C.U_FP32 if out_fp32 else C.U_BF16
        return C.rounding_check(out, ref, mag, rtol, k * C.U_FP32 + (0.0 if out_fp32 else C.U_BF16),
                                f"vs fp64 (k={k})")

    return Prepared(run, r, check, src + " (no patch)", one_call)


# A Triton kernel: its pointer and size arguments are typed by Triton's specialisation, not by annotations.
@triton.jit  # type: ignore[untyped-decorator]
def _copy_words(src, dst, n_in, n_out, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src + offs, mask=offs < n_in, other=0)
    tl.store(dst + offs, v, mask=offs < n_out)


def upstream_rmsnorm() -> Any:
    """deepseek_v4.py's Triton `rms_normalize_triton` (in place, one program per row)."""
    if "rms" not in C.loaded:
        C.loaded["rms"] = _up.load_defs(_up.DSV4_MODEL_PATH, ["_rms_normalize_kernel", "rms_normalize_triton"],
                                       prelude="import torch\nimport triton\nimport triton.language as tl\n")
    return C.loaded["rms"]


def build_glue(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """RMSNorm: the wheel's Triton RMSNorm (one program per row; sgl_kernel's AOT `rmsnorm`, which the
    sm_120 path calls, is not on the bench machine), checked against fp64. Add: torch eager, as
    upstream. Proxy: one copy kernel per JIT launch moving the same bytes, checked to copy exactly."""
    p = op.p
    rows, dim, how = C.int_param(p, "rows"), C.int_param(p, "dim"), str(p["impl"])
    g = C.gen(seed)
    if how == "rmsnorm":
        mod = upstream_rmsnorm()
        x = C.randn((rows, dim), g)
        work = x.clone()
        w = torch.ones((dim,), dtype=torch.bfloat16, device=C.DEVICE)  # ones: repeated in-place replays stay put

        def run() -> None:
            mod.rms_normalize_triton(work, M.RMS_EPS, w)

        def check() -> Check:
            y = mod.rms_normalize_triton(x.clone(), M.RMS_EPS, w)
            xd = x.double()
            ref = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + M.RMS_EPS)
            # the bf16 output's rounding, the fp32 mean of `dim` squares and its rsqrt (a few ulp)
            return C.rounding_check(y, ref, None, C.u_bf16_triton() + (dim + 4) * C.U_FP32, 0.0, "vs fp64")

        return Prepared(run, 1, check, "proxy: deepseek_v4.py's Triton rms_normalize_triton for sgl_kernel.rmsnorm "
                        "(AOT CUDA, not on this machine)")
    if how == "torch_add":
        return _build_add(rows, dim, g)
    return _build_proxy(op.p["launches"], g)  # type: ignore[arg-type]


def _build_add(rows: int, dim: int, g: torch.Generator) -> Prepared:
    a, b = C.randn((rows, dim), g), C.randn((rows, dim), g)

    def run() -> None:
        torch.add(a, b)

    def check() -> Check:
        return C.rounding_check(torch.add(a, b), a.double() + b.double(), None, C.U_BF16, 0.0,
                                "vs fp64 (one bf16 rounding)")

    return Prepared(run, 1, check, "torch add (eager), as deepseek_v2's MoE adds the shared expert")


def _build_proxy(launches: Tuple[Tuple[int, int], ...], g: torch.Generator) -> Prepared:
    bufs = []
    for n_in, n_out in launches:
        wi, wo = max(1, math.ceil(n_in / 4)), max(1, math.ceil(n_out / 4))
        src = torch.randint(-(2 ** 31), 2 ** 31 - 1, (wi,), generator=g, device=C.DEVICE, dtype=torch.int32)
        bufs.append((src, torch.empty((wo,), dtype=torch.int32, device=C.DEVICE), wi, wo))
    block = 1024

    def run() -> None:
        for src, dst, wi, wo in bufs:
            _copy_words[(triton.cdiv(max(wi, wo), block),)](src, dst, wi, wo, BLOCK=block)

    def check() -> Check:
        run()
        C.sync()
        for src, dst, wi, wo in bufs:
            n = min(wi, wo)
            if not torch.equal(src[:n], dst[:n]) or (wo > wi and bool((dst[wi:] != 0).any())):
                return Check(False, float("nan"), "proxy copy kernel wrote wrong words")
        return Check(True, 0.0, f"{len(bufs)} launch(es)")

    return Prepared(run, 1, check, f"proxy: {len(bufs)} copy kernel(s) moving the same bytes (the JIT kernels of "
                    "jit_kernel/dsv4 need SGLang's CUDA JIT)")


def build(op: M.Op, impl: str, l2: int, seed: int) -> Prepared:
    """A bf16 GEMM or a glue op (the model's groups `bf16_gemm` and `glue`)."""
    return (build_bf16_gemm if op.group == "bf16_gemm" else build_glue)(op, impl, l2, seed)
