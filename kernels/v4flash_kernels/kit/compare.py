"""How far a result is from its reference (one definition for every check, test and bench): the relative
Frobenius error, and the excess over an elementwise rounding bound."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in float64 (NaN if out has NaN)."""
    o = out.to(torch.float64)
    r = ref.to(torch.float64)
    if torch.isnan(o).any():
        return float("nan")
    den = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    return float(num / den if den > 0 else num)


def excess_error(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rtol: float, atol_mag: float) -> float:
    """max over elements of |out - ref| / (rtol |ref| + atol_mag |.|-product): <= 1 passes.

    `rtol` covers the output dtype's rounding, `atol_mag` the fp32 accumulation (relative to the sum
    of absolute terms, so cancellation does not make a correct result look wrong)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    bound = rtol * ref.abs() + atol_mag * mag + 1e-30
    return ((o - ref).abs() / bound).max().item() if o.numel() else 0.0
