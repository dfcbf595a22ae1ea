"""How far a result is from its reference (one definition for every check, test and bench)."""

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
    return num / den if den > 0 else num
