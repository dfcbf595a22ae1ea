"""GPU tests of the block-FP8 linear / GEMM (run on the H200): real DSV4 shapes, CUDA graphs, upstream parity.

Ours is checked against the fp64 reference (`fp8_gemm.reference`), its activation quant bit for bit
against the definition, and upstream's `triton_w8a8_block_fp8_linear` / `w8a8_block_fp8_matmul_triton`
(verbatim from the pinned wheel, default config) runs on the same inputs in the same test.
"""

from __future__ import annotations

import pytest
import torch

from v4flash_kernels.fp8_gemm import op
from v4flash_kernels.fp8_gemm.reference import (
    FP8,
    excess_error,
    linear_ref,
    make_activation,
    make_quantized,
    make_weight,
    matmul_ref,
    quantize_activation_ref,
)

pytestmark = pytest.mark.gpu
RTOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -20}  # RNE output rounding
ATOL_MAG = 2.0 ** -11  # fp32 accumulation (fp8 MMAs may accumulate with fewer bits) vs the sum of |terms|
ATOL_MAG_UPSTREAM = 2.0 ** -8  # its Triton quant's x * (1 / (amax / 448)) may sit one e4m3 step off at ties
SHAPES = [(1536, 4096), (8192, 1024), (4096, 2048), (1024, 4096), (4096, 512)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _ok(out, ref, mag, dtype=torch.bfloat16, atol_mag=ATOL_MAG):
    ex = excess_error(out, ref, mag, RTOL[dtype], atol_mag)
    assert ex <= 1.0, f"error {ex:.3g}x the bound"


@pytest.fixture(scope="module")
def upstream():
    from v4flash_kernels.fp8_gemm.bench import upstream_fp8_kernel, upstream_fp8_linear

    return upstream_fp8_linear(), upstream_fp8_kernel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_activation_quant_is_the_definition_bit_for_bit(dtype):
    x = make_activation(300, 4096, _gen(1), device="cuda", dtype=dtype)
    q, s = op.quantize_activation(x)
    qr, sr = quantize_activation_ref(x.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s.cpu(), sr)


@pytest.mark.parametrize("cfg", [c for c in op.CONFIGS if c.fuse_quant], ids=lambda c: c.name)
def test_gpu_fused_quant_codes_bit_for_bit(cfg):
    """Selector weights: each output is one code times its scale, exact in fp32 (see the CPU test)."""
    m, k = min(cfg.block_m + 3, 64), 1024
    x = make_activation(m, k, _gen(2), device="cuda", dtype=torch.float32)
    perm = torch.randperm(k, generator=_gen(3), device="cuda")
    w = torch.zeros((k, k), device="cuda")
    w[torch.arange(k, device="cuda"), perm] = 1.0
    ws = torch.ones((k // 128, k // 128), device="cuda")
    qr, sr = quantize_activation_ref(x.cpu())
    want = (qr.float() * sr.repeat_interleave(128, -1))[:, perm.cpu()]
    for split in (1, 3, 8):
        out = op.linear_2d(x, w.to(FP8), ws, config=cfg, split=split)
        assert torch.equal(out.cpu(), want), split


@pytest.mark.parametrize("m", [1, 16, 17, 64, 300])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gpu_linear_matches_reference_and_upstream(n, k, m, upstream):
    up_linear, _ = upstream
    x = make_activation(m, k, _gen(10 + m), device="cuda")
    w, ws = make_weight(n, k, _gen(20), device="cuda")
    ref, mag = linear_ref(x, w, ws)
    out = op.w8a8_block_fp8_linear(x, w, [128, 128], ws)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _ok(out, ref, mag)
    up = up_linear.triton_w8a8_block_fp8_linear(x, w, [128, 128], ws)
    _ok(up, ref, mag, atol_mag=ATOL_MAG_UPSTREAM)


@pytest.mark.parametrize("cfg", op.CONFIGS, ids=lambda c: c.name)
def test_gpu_every_config_and_split(cfg):
    m, n, k = {16: 5, 32: 20, 64: 40}.get(cfg.block_m, 200), 1536, 4096
    x = make_activation(m, k, _gen(30), device="cuda")
    w, ws = make_weight(n, k, _gen(31), device="cuda")
    ref, mag = linear_ref(x, w, ws)
    for split in ((1, 2, 7, 32) if cfg.max_split > 1 else (1,)):
        _ok(op.linear_2d(x, w, ws, config=cfg, split=split), ref, mag)


@pytest.mark.parametrize("m,n,k", [(1, 4096, 512), (5, 200, 1000), (64, 1536, 4096), (300, 1024, 4000)])
def test_gpu_matmul_matches_reference_and_upstream(m, n, k, upstream):
    _, up_kernel = upstream
    a, a_s = make_quantized(m, k, _gen(40), device="cuda")
    w, ws = make_weight(n, k, _gen(41), device="cuda")
    a_cm = a_s.t().contiguous().t()  # column-major As
    ref, mag = matmul_ref(a, w, a_s, ws)
    for dtype in (torch.bfloat16, torch.float32):
        out = op.w8a8_block_fp8_matmul(a, w, a_cm, ws, [128, 128], output_dtype=dtype)
        up = up_kernel.w8a8_block_fp8_matmul_triton(a, w, a_cm, ws, [128, 128], output_dtype=dtype)
        _ok(out, ref, mag, dtype)
        _ok(up, ref, mag, dtype)


def test_gpu_cuda_graph_replay_follows_new_inputs_and_is_deterministic():
    """Split-K programs reduce through per-stream tickets that each call leaves at zero: a captured
    graph replays with new activations, bit-identical to eager calls, many times over."""
    cases = []
    for m, (n, k) in ((1, (1536, 4096)), (16, (8192, 1024)), (64, (4096, 2048))):
        x = make_activation(m, k, _gen(50 + m), device="cuda")
        w, ws = make_weight(n, k, _gen(51), device="cuda")
        assert op.plan(m, n, k, op.num_sms(x.device)).split > 1
        cases.append((x, w, ws))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x, w, ws in cases:
            op.w8a8_block_fp8_linear(x, w, [128, 128], ws)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [op.w8a8_block_fp8_linear(x, w, [128, 128], ws) for x, w, ws in cases]
    for rep in range(3):
        for i, (x, _, _) in enumerate(cases):
            x.copy_(make_activation(x.shape[0], x.shape[1], _gen(100 * rep + i), device="cuda"))
        first = None
        for _ in range(5):
            g.replay()
            torch.cuda.synchronize()
            now = [o.clone() for o in outs]
            if first is None:
                first = now
            assert all(torch.equal(a, b) for a, b in zip(first, now))
        for (x, w, ws), o in zip(cases, first):
            assert torch.equal(o, op.w8a8_block_fp8_linear(x, w, [128, 128], ws))
            ref, mag = linear_ref(x, w, ws)
            _ok(o, ref, mag)


def test_gpu_concurrent_streams_do_not_share_tickets():
    x1 = make_activation(1, 4096, _gen(60), device="cuda")
    x2 = make_activation(4, 4096, _gen(61), device="cuda")
    w, ws = make_weight(1536, 4096, _gen(62), device="cuda")
    want1 = op.w8a8_block_fp8_linear(x1, w, [128, 128], ws)
    want2 = op.w8a8_block_fp8_linear(x2, w, [128, 128], ws)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for s in (s1, s2):
        s.wait_stream(torch.cuda.current_stream())
    outs1, outs2 = [], []
    for _ in range(50):
        with torch.cuda.stream(s1):
            outs1.append(op.w8a8_block_fp8_linear(x1, w, [128, 128], ws))
        with torch.cuda.stream(s2):
            outs2.append(op.w8a8_block_fp8_linear(x2, w, [128, 128], ws))
    torch.cuda.synchronize()
    assert all(torch.equal(o, want1) for o in outs1)
    assert all(torch.equal(o, want2) for o in outs2)
