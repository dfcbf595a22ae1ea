"""How an mHC result is judged against the fp64 reference (the self-check's, the bench's and the tests'
tolerances and comparisons)."""

from __future__ import annotations

from typing import Any, Dict

import torch

from v4flash_kernels.mhc import reference as R

# bf16 outputs: max |err| / max |ref| (one rounding to nearest is <= 2^-9 relative to the element);
# post/comb: absolute (an fp32 GEMV over 16K terms, then 20 Sinkhorn rounds). The kernels round to
# nearest under the interpreter too (kernel._bf16), so CPU and GPU share these.
# y_norm: the sub-layer input when the RMSNorm is fused. The model rounds y to bf16 and then normalizes
# it (rounding again); where the fp32 y sits within fp32 error of a bf16 tie, ours and the fp64 reference
# round it to neighbouring bf16 values (one ulp, 2^-8 relative), and the output rounding adds 2^-9: the
# bound is 2^-8 + 2^-9 plus the fp32 mixes' share (2^-12). The H200 reached 5.1e-3 at 8192 rows
# (2026-12-02), above the single-rounding 5e-3, below this.
TOL = {"bf16": 5e-3, "mix": 1e-4, "y_norm": 2.0 ** -8 + 2.0 ** -9 + 2.0 ** -12}


def check_pre(y: Any, post: Any, comb: Any, ref: Dict[str, Any], layer_input: torch.Tensor, tol: Dict[str,
              float], normed: bool = False) -> Dict[str, Any]:
    """`normed`: `layer_input` is the RMSNorm of the bf16 y (two roundings: tol["y_norm"])."""
    y_tol = tol["y_norm"] if normed else tol["bf16"]
    e = {"y": R.max_rel(y, layer_input), "post": R.max_abs(post, ref["post"]), "comb": R.max_abs(comb, ref["comb"])}
    shapes = (tuple(post.shape) == tuple(ref["post"].shape) and tuple(comb.shape) == tuple(ref["comb"].shape)
              and tuple(y.shape) == tuple(layer_input.shape))
    finite = bool(torch.isfinite(y.float()).all() and torch.isfinite(post).all() and torch.isfinite(comb).all())
    ok = shapes and finite and e["y"] <= y_tol and e["post"] <= tol["mix"] and e["comb"] <= tol["mix"]
    return {"ok": ok, "err": e}


def check_streams(out: Any, ref: Any, tol: Dict[str, float]) -> Dict[str, Any]:
    e = R.max_rel(out, ref)
    ok = tuple(out.shape) == tuple(ref.shape) and out.dtype == torch.bfloat16 and e <= tol["bf16"]
    return {"ok": ok, "err": {"streams": e}}


# A correct fp32 post rounds ~1e-4 of its elements the other way from the fp64 value (they sit within
# fp32 error of a bf16 tie); a wrong rounding mode (truncation) moves about half of them.
TIES_FRAC = 1e-3


def check_post_pre(cur: Any, y: Any, post: Any, comb: Any, inputs: Dict[str, Any], p: R.MhcParams, tol: Dict[str,
                   float]) -> Dict[str, Any]:
    """A fused boundary's results against what the unfused pair computes on the same inputs.

    The streams `cur` against the fp64 post (bf16 tolerance, and few elements rounded the other way
    from it: `ties`); post, comb and the layer input against the fp64 pre of exactly `cur`, the bf16
    streams the unfused pair's pre would read (reference.py says why not of the fp64 post rounded).
    A pre that mixed anything else (the unrounded fp32 streams, the old residual) is off by >= 1e-3.
    `inputs` holds the rows checked (x, residual, post, comb, hc_fn, hc_scale, hc_base, norm_weight).
    """
    full = R.post_ref(inputs["x"], inputs["residual"], inputs["post"], inputs["comb"])
    s = check_streams(cur, full, tol)
    own = R.pre_of_streams(cur, inputs, p)
    c = check_pre(y, post, comb, own, own["layer_input"], tol, normed=inputs.get("norm_weight") is not None)
    ties = int((cur != full.to(torch.bfloat16)).sum()) if cur.shape == full.shape else cur.numel()
    ties_ok = ties <= 4 + TIES_FRAC * cur.numel()
    return {"ok": c["ok"] and s["ok"] and ties_ok, "err": {**c["err"], **s["err"], "ties": ties}}


PAIR_TOL = 1e-6  # post / comb of the fused op vs the unfused pair when both wrote the same streams


def check_against_pair(out: Any, pair: Any, tol: Dict[str, float], inputs: Dict[str, Any] | None = None,
                       p: R.MhcParams | None = None) -> Dict[str, Any]:
    """The fused op's (streams, y, post, comb) against the unfused pair's on the same inputs (post,
    then pre of the streams it wrote). Same streams: the pre must agree to fp32 noise. Else (two fp32
    posts may round a tie differently) the two pres read different streams, so each may sit its own
    tolerance from the fp64 pre of its streams, and those two fp64 pres differ by what the differing
    elements move (computed from `inputs`/`p` when given: the bound is derived, not a constant)."""
    cur, y, post, comb = out
    pcur, py, ppost, pcomb = pair
    diff = int((cur != pcur).sum())
    e = {"pair_stream_elems": diff, "pair_post": R.max_abs(post, ppost), "pair_comb": R.max_abs(comb, pcomb),
         "pair_y": R.max_rel(y, py.double())}
    one_y = tol["y_norm"] if inputs is not None and inputs.get("norm_weight") is not None else tol["bf16"]
    mix_tol, y_tol = (PAIR_TOL, one_y) if diff == 0 else (tol["mix"], one_y)
    if diff and inputs is not None and p is not None:
        a, b = R.pre_of_streams(cur, inputs, p), R.pre_of_streams(pcur, inputs, p)
        moved = max(R.max_abs(a["post"], b["post"]), R.max_abs(a["comb"], b["comb"]))
        mix_tol = 2 * tol["mix"] + moved
        y_tol = 2 * one_y + R.max_rel(a["layer_input"], b["layer_input"])
        e["pair_moved_by_streams"] = moved
    ok = (diff <= 4 + TIES_FRAC * cur.numel() and e["pair_post"] <= mix_tol and e["pair_comb"] <= mix_tol
          and e["pair_y"] <= y_tol)
    return {"ok": ok, "err": e}
