"""CPU (interpreter) checks of the sweep's experiment kernels (`fp8_gemm.candidates`), so a GPU sweep
never spends its minutes on a candidate that computes the wrong thing: each family and fix-up mode
against the fp64 reference on small shapes, and the variant lists the sweep builds for the real shapes."""

from __future__ import annotations

import os

import pytest
import torch

import v4flash_bench.fp8_candidates as cand
from v4flash_kernels.fp8_gemm.reference import linear_ref, make_activation, make_weight
from v4flash_kernels.kit.compare import excess_error

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under the Triton interpreter"
)
RTOL, ATOL_MAG = 2.0 ** -7, 2.0 ** -16  # bf16 output rounding; fp32 accumulation vs the sum of |terms|


def _check(out, x, w, ws):
    ref, mag = linear_ref(x, w, ws)
    ex = excess_error(out, ref, mag, RTOL, ATOL_MAG)
    assert ex <= 1.0, f"error {ex:.3g}x the bound"


def _inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = make_activation(m, k, g)
    w, ws = make_weight(n, k, g)
    return x, w, ws


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("cfg", [
    cand.Gemv(16, 0, 4),
    cand.Gemv(32, 256, 4, "ticket"),
    cand.Gemv(32, 128, 4, "reduce"),
    cand.Gemv(16, 0, 4, fuse_quant=False),
])
def test_gemv_matches_reference(m, cfg):
    x, w, ws = _inputs(m, 256, 512, 10 + m)
    _check(cand.run_gemv(x, w, ws, cfg), x, w, ws)


@pytest.mark.parametrize("m", [3, 20])
@pytest.mark.parametrize("cfg", [
    cand.Dot(16, 64, 4, 2, True, True, "ticket"),
    cand.Dot(16, 64, 4, 2, True, True, "reduce"),
    cand.Dot(16, 64, 4, 2, True, True, "serial"),
    cand.Dot(16, 64, 4, 2, True, False, "ticket", kg=2),
    cand.Dot(32, 64, 4, 2, False, False, "whole"),
    cand.Dot(32, 64, 4, 2, False, True, "ticket", kg=2),
])
def test_dot_matches_reference(m, cfg):
    x, w, ws = _inputs(m, 192, 512, 20 + m)
    _check(cand.run_dot(x, w, ws, cfg, sms=4), x, w, ws)


def test_tickets_are_left_at_zero():
    from v4flash_kernels.fp8_gemm import op

    x, w, ws = _inputs(2, 128, 512, 3)
    cand.run_gemv(x, w, ws, cand.Gemv(32, 128, 4, "ticket"))
    cand.run_dot(x, w, ws, cand.Dot(16, 64, 4, 2, True, True, "ticket"), sms=4)
    assert int(op.tickets(x.device, 8)[:8].abs().sum()) == 0


def test_sweep_lists_cover_every_shape():
    from v4flash_bench.fp8_gemm import SHAPES

    for sh in SHAPES:
        for m in (1, 4, 16, 64):
            names = [n for n, _ in cand.sweep_variants(m, sh.n, sh.k, 132)]
            assert len(names) == len(set(names))
            if m <= 4:
                gemv = list(cand.gemv_candidates(m, sh.n, sh.k, 132))
                assert gemv and all(sh.k % (c.kchunk or sh.k) == 0 and 128 % c.block_n == 0 for c in gemv)
        assert len(cand.calibration_variants(sh.n, sh.k, 132)) >= 2
