"""fp64 reference of one compressor decode step, the cache formats it stores, realistic inputs, and
the comparison with its rounding bounds.

From the definitions (DeepSeek-V4's compressor as sglang 0.5.13.post1 lays it out):
- `kv_score = x W^T` (the state row of each token; columns: c4 kv overlap | kv | score overlap |
  score, c128 kv | score, each `head_dim` wide);
- the ring: `state[write_loc] = kv_score`, pages of `ratio` slots;
- a window completes at `seq_len % ratio == 0`: per head dim, `softmax_j(score_j + ape_j)`-weighted
  sum of `kv_j` over the window (c4: the previous page's 4 overlap halves, absent in the first
  window, then this page's 4; c128: this page's 128), read after the update;
- `y = p / sqrt(mean(p^2) + eps) * w`, RoPE of the last 64 dims at position `seq_len - ratio`
  (pairs (2i, 2i+1) times `freqs_cis[pos, i]`), then for the indexer the orthonormal Hadamard H/sqrt(128);
- stored at `out_loc`: FlashMLA (448 e4m3 codes of bf16(y) with one UE8M0 scale per 64, the last 64
  dims as bf16; scale = ceil_pow2(max(1e-4, amax) / 448)) or the indexer (128 e4m3 codes, one fp32
  scale max(1e-4, amax) / 448).

The bound each stored value is held to is the format's rounding at that value (e4m3 half-ulp times
the scale, bf16 half-ulp) plus what the fp32 arithmetic before it can contribute: the GEMV's fp32
accumulation (K ulps of the sum of |terms|) carried through the pooling, the norm, RoPE and the
Hadamard to first order (doubled), and a few ulps of each later fp32 step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

U32 = 2.0 ** -24
MLA_DIM, INDEX_DIM, ROPE = 512, 128, 64
RING = {4: 8, 128: 128}  # state ring slots per SWA page (no speculative decoding)
SWA_PAGE = 256


def mla_page_bytes(page_size: int) -> int:
    return -(-584 * page_size // 576) * 576


def index_page_bytes(page_size: int) -> int:
    return 132 * page_size


# ----------------------------------------------------------------------------- inputs


def rope_table(positions: int, device: str = "cpu") -> torch.Tensor:
    """A [positions, 32] complex64 rotary table (theta 10000 over the 64 rope dims)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64).to(device)


def ring_slot(req: int, pos: int, ratio: int) -> int:
    """State slot of position `pos` of request `req`, as the planner computes it: each request's SWA
    pages are its own (two alternating ids per request), the slot is page * ring + swa_loc % ring."""
    ring = RING[ratio]
    swa_page = 2 * req + (pos // SWA_PAGE) % 2
    swa_loc = swa_page * SWA_PAGE + pos % SWA_PAGE
    return swa_page * ring + swa_loc % ring


def plan_row(req: int, seq_len: int, ratio: int) -> Tuple[int, int, int, int]:
    """(seq_len, write_loc, read_page_0, read_page_1) of a decode row (c_plan.cuh's decode planner)."""
    p1 = seq_len - 1
    p0 = max(p1 - ratio, 0)
    w = ring_slot(req, p1, ratio)
    return seq_len, w, ring_slot(req, p0, ratio) // ratio, w // ratio


def default_seq_lens(rows: int, ratio: int, gen: torch.Generator) -> List[int]:
    """Rows at assorted positions: about half complete a window (the first window, one just past a
    256-token SWA page, deep ones), the others do not; a batch > 2 ends with a CUDA-graph padding row
    (seq_len 1)."""
    out = []
    for i in range(rows):
        deep = int(torch.randint(2, 400, (1,), generator=gen).item()) * ratio
        if i % 2 == 0:
            s = [ratio, deep, ratio * (SWA_PAGE // ratio + 1), deep + ratio][(i // 2) % 4]
        else:
            s = deep + int(torch.randint(1, ratio, (1,), generator=gen).item())
        out.append(s)
    if rows > 2:
        out[-1] = 1
    return out


def make_case(rows: int, ratio: int, head_dim: int, k: int, seed: int, device: str = "cpu",
              seq_lens: List[int] | None = None, page_size: int | None = None) -> Dict[str, Any]:
    """One decode step of one compressor with a realistic ring: each request's ring holds history
    (random fp32 kv and scores, as earlier steps wrote them), the cache is random bytes (what a
    store leaves untouched must stay as it was). Keys: the tensors `compress_decode` takes plus
    `seq_lens` (python ints), `ratio`, `head_dim`, `page_size`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    n = 2 * coff * head_dim
    seqs = list(seq_lens) if seq_lens is not None else default_seq_lens(rows, ratio, g)
    assert len(seqs) == rows
    plan = torch.tensor([plan_row(i, s, ratio) for i, s in enumerate(seqs)], dtype=torch.int32)
    slots = (2 * rows + 1) * RING[ratio]
    state = torch.randn((slots, n), generator=g) * 2.0
    x = (torch.randn((rows, k), generator=g) * 1.5).to(torch.bfloat16)
    w = (torch.randn((n, k), generator=g) * k ** -0.5).to(torch.bfloat16)
    ape = torch.randn((ratio * coff, head_dim), generator=g) * 0.5
    norm_w = 1.0 + 0.25 * torch.randn((head_dim,), generator=g)
    # a fixed table (one size for any draw: a captured graph's inputs keep their shapes)
    freqs = rope_table(max(max(seqs), 401 * ratio) + 1)
    indexer = head_dim == INDEX_DIM
    ps = page_size or (64 if indexer or ratio == 4 else 2)
    pb = index_page_bytes(ps) if indexer else mla_page_bytes(ps)
    pages = max(2, -(-2 * rows // ps) + 1)
    cache = torch.randint(0, 256, (pages, pb), generator=g, dtype=torch.int32).to(torch.uint8)
    # distinct cache slots for the rows that complete; SGLang's loc for the others is not stored
    locs = torch.randperm(pages * ps, generator=g)[:rows].to(torch.int32)
    out = {"x": x, "weight": w, "state": state, "plan_d": plan, "ape": ape, "norm_weight": norm_w, "eps": 1e-6,
           "freqs_cis": freqs, "out_loc": locs, "cache": cache}
    out = {key: (v.to(device) if torch.is_tensor(v) else v) for key, v in out.items()}
    out.update(seq_lens=seqs, ratio=ratio, head_dim=head_dim, page_size=ps)
    return out


# ----------------------------------------------------------------------------- the reference


@dataclass(frozen=True)
class StepRef:
    """What one step must leave behind: the ring (fp64 values, and per element the rounding bound of
    the new rows: 0 where the state must be unchanged) and, per completed row, y (fp64) with the
    bound of its fp32 computation."""

    state: torch.Tensor
    state_bound: torch.Tensor
    done: Tuple[int, ...]
    y: torch.Tensor  # [T, head_dim] (rows not done: 0)
    y_bound: torch.Tensor


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def step_ref(case: Dict[str, Any]) -> StepRef:
    x = case["x"].double().cpu()
    w = case["weight"].double().cpu()
    state = case["state"].double().cpu()
    plan = case["plan_d"].long().cpu()
    ape = case["ape"].double().cpu()
    gw = case["norm_weight"].double().cpu()
    freqs = torch.view_as_real(case["freqs_cis"].cpu()).double()
    eps = float(case["eps"])
    ratio, hd = int(case["ratio"]), int(case["head_dim"])
    k = x.shape[1]
    T = x.shape[0]
    kvs = x @ w.t()
    mag = x.abs() @ w.abs().t()
    dk = U32 * kvs.abs() + k * U32 * mag  # the fp32 GEMV's bound per element
    new = state.clone()
    bound = torch.zeros_like(state)
    for t in range(T):
        wl = int(plan[t, 1])
        if wl >= 0:
            new[wl] = kvs[t]
            bound[wl] = dk[t]
    y = torch.zeros((T, hd), dtype=torch.float64)
    yb = torch.zeros((T, hd), dtype=torch.float64)
    done = []
    for t in range(T):
        s = int(plan[t, 0])
        if s <= 0 or s % ratio:
            continue
        done.append(t)
        p0, p1, wl = int(plan[t, 2]), int(plan[t, 3]), int(plan[t, 1])
        if ratio == 4:
            prev = new[p0 * 4:(p0 + 1) * 4]
            cur = new[p1 * 4:(p1 + 1) * 4]
            kv = torch.cat([prev[:, :hd], cur[:, hd:2 * hd]])
            sc = torch.cat([prev[:, 2 * hd:3 * hd], cur[:, 3 * hd:]]) + ape
            if s <= 4:
                kv, sc = kv[4:], sc[4:]
            slots = list(range(p1 * 4, p1 * 4 + 4))
            bkv = torch.stack([bound[sl, hd:2 * hd] for sl in slots])
            bsc = torch.stack([bound[sl, 3 * hd:] for sl in slots])
            if s > 4:
                pslots = list(range(p0 * 4, p0 * 4 + 4))
                bkv = torch.cat([torch.stack([bound[sl, :hd] for sl in pslots]), bkv])
                bsc = torch.cat([torch.stack([bound[sl, 2 * hd:3 * hd] for sl in pslots]), bsc])
        else:
            page = new[p1 * ratio:(p1 + 1) * ratio]
            kv, sc = page[:, :hd], page[:, hd:] + ape
            pb = bound[p1 * ratio:(p1 + 1) * ratio]
            bkv, bsc = pb[:, :hd], pb[:, hd:]
        wts = torch.softmax(sc, dim=0)
        p = (wts * kv).sum(0)
        # first order: a perturbed slot j moves p by w_j (|dkv_j| + |dscore_j| |kv_j - p|); doubled;
        # plus the fp32 pooling itself (a sum of n weighted terms and the exps) over sum_j w_j |kv_j|
        n_win = kv.shape[0]
        dp = 2 * (wts * (bkv + bsc * (kv - p).abs())).sum(0) + (n_win + 16) * 4 * U32 * (wts * kv.abs()).sum(0)
        r = 1.0 / math.sqrt(float((p * p).mean()) + eps)
        yv = p * r * gw
        dr = r ** 3 * float((p.abs() * dp).mean())
        dy = gw.abs() * (dp * r + p.abs() * dr) * 2 + 8 * U32 * yv.abs()
        # RoPE of the last 64 dims
        pos = s - ratio
        c, sn = freqs[pos, :, 0], freqs[pos, :, 1]
        re, im = yv[hd - ROPE::2].clone(), yv[hd - ROPE + 1::2].clone()
        yv[hd - ROPE::2] = re * c - im * sn
        yv[hd - ROPE + 1::2] = re * sn + im * c
        dre, dim_ = dy[hd - ROPE::2].clone(), dy[hd - ROPE + 1::2].clone()
        dy[hd - ROPE::2] = dre + dim_ + 4 * U32 * (re.abs() + im.abs())
        dy[hd - ROPE + 1::2] = dre + dim_ + 4 * U32 * (re.abs() + im.abs())
        if hd == INDEX_DIM:
            hm = hadamard(hd)
            y_in = yv
            yv = hm @ y_in
            # the input bounds through |H|/sqrt(n), and 7 fp32 butterfly stages + the scale
            dy = hm.abs() @ dy + 9 * U32 * (hm.abs() @ y_in.abs())
        y[t] = yv
        yb[t] = dy
    return StepRef(new, bound, tuple(done), y, yb)


# ----------------------------------------------------------------------------- the cache formats


def e4m3_value(codes: torch.Tensor) -> torch.Tensor:
    """fp64 value of e4m3fn bytes (uint8)."""
    return codes.view(torch.float8_e4m3fn).double() if codes.dtype == torch.uint8 else codes.double()


def read_tokens(cache: torch.Tensor, locs: List[int], page_size: int, head_dim: int) -> Dict[str, torch.Tensor]:
    """The stored tokens at `locs`, dequantized: `values` [n, head_dim] fp64, `scales` (FlashMLA: the
    7 UE8M0 exponent bytes; indexer: the fp32 scale), `raw` the token bytes as stored."""
    c = cache.cpu()
    bits = page_size.bit_length() - 1
    vals, scales, raws = [], [], []
    for loc in locs:
        page, slot = loc >> bits, loc & (page_size - 1)
        if head_dim == INDEX_DIM:
            tok = c[page, slot * 128:(slot + 1) * 128]
            sb = c[page, 128 * page_size + slot * 4:128 * page_size + slot * 4 + 4]
            sc = sb.clone().view(torch.float32)
            vals.append(e4m3_value(tok.clone()) * float(sc[0]))
            scales.append(sc.double())
            raws.append(torch.cat([tok, sb]))
        else:
            tok = c[page, slot * 576:(slot + 1) * 576]
            sb = c[page, 576 * page_size + slot * 8:576 * page_size + slot * 8 + 7]
            mult = torch.pow(2.0, sb.double() - 127.0)
            nope = e4m3_value(tok[:448].clone()).view(7, 64) * mult[:, None]
            rope = tok[448:].clone().view(torch.bfloat16).double()
            vals.append(torch.cat([nope.reshape(448), rope]))
            scales.append(sb.clone())
            raws.append(torch.cat([tok, sb]))
    if not locs:
        return {"values": torch.zeros((0, head_dim), dtype=torch.float64), "scales": torch.zeros(0),
                "raw": torch.zeros(0, dtype=torch.uint8)}
    return {"values": torch.stack(vals), "scales": torch.stack(scales), "raw": torch.stack(raws)}


def _ue8m0_up(v: torch.Tensor) -> torch.Tensor:
    """exponent byte of the smallest power of two >= v (v > 0), as fp64."""
    return torch.ceil(torch.log2(v)) + 127.0


def store_bound(y: torch.Tensor, dy: torch.Tensor, head_dim: int) -> Dict[str, torch.Tensor]:
    """Per stored element, how far its dequantized value may be from y: the format's rounding at the
    scale the computation may pick, plus dy. Also the scales that computation may pick (lo, hi)."""
    if head_dim == INDEX_DIM:
        amax = y.abs().amax(-1)
        damax = dy.amax(-1)
        lo = torch.clamp(amax - damax, min=1e-4) / 448.0
        hi = torch.clamp(amax + damax, min=1e-4) / 448.0 * (1 + 4 * U32)
        a = (y.abs() + dy) / lo[:, None]
        q = torch.maximum(a * 2.0 ** -4, torch.full_like(a, 2.0 ** -10)) * hi[:, None]
        return {"bound": q + dy, "scale_lo": lo * (1 - 4 * U32), "scale_hi": hi}
    bf = 2.0 ** -8  # the bf16 rounding (a perturbed value may round to the neighbour: one half-ulp more)
    g = y[:, :448].reshape(-1, 7, 64)
    dg = dy[:, :448].reshape(-1, 7, 64)
    amax = g.abs().amax(-1)
    dam = (dg + g.abs() * bf).amax(-1)
    e_lo = _ue8m0_up(torch.clamp(amax - dam, min=1e-4) * (1 - 4 * U32) / 448.0)
    e_hi = _ue8m0_up(torch.clamp(amax + dam, min=1e-4) * (1 + 4 * U32) / 448.0)
    s_hi = torch.pow(2.0, e_hi - 127.0)
    s_lo = torch.pow(2.0, e_lo - 127.0)
    a = (g.abs() * (1 + bf) + dg) / s_lo[..., None]
    q = torch.maximum(a * 2.0 ** -4, torch.full_like(a, 2.0 ** -10)) * s_hi[..., None]
    nope = (q + dg + g.abs() * bf).reshape(-1, 448)
    rope = dy[:, 448:] + y[:, 448:].abs() * bf
    return {"bound": torch.cat([nope, rope], 1), "e_lo": e_lo, "e_hi": e_hi}


def check_step(case: Dict[str, Any], ref: StepRef, state_after: torch.Tensor, cache_after: torch.Tensor,
               cache_before: torch.Tensor, rows: List[int] | None = None) -> Tuple[bool, Dict[str, float], str]:
    """(ok, metrics, why): the ring against the reference within its bound (rows never written
    bit-identical), each completed row's stored token within `store_bound` with its scales among the
    ones the computation may pick, and every other cache byte untouched."""
    hd = int(case["head_dim"])
    ps = int(case["page_size"])
    st = state_after.double().cpu()
    written = ref.state_bound.abs().sum(1) > 0
    problems = []
    if not torch.equal(st[~written], ref.state[~written]):
        problems.append("state rows this step does not write changed")
    ex_state = ((st[written] - ref.state[written]).abs() / (ref.state_bound[written] + 1e-30)).max().item() \
        if bool(written.any()) else 0.0
    if not ex_state <= 1.0:
        problems.append(f"state rows off by {ex_state:.2f} of their rounding bound")
    done = [t for t in ref.done if rows is None or t in rows]
    locs = [int(case["out_loc"][t]) for t in done]
    ex_store, rel = 0.0, 0.0
    if done:
        got = read_tokens(cache_after, locs, ps, hd)
        y, dy = ref.y[list(done)], ref.y_bound[list(done)]
        b = store_bound(y, dy, hd)
        ex_store = ((got["values"] - y).abs() / b["bound"]).max().item()
        rel = float(torch.linalg.vector_norm(got["values"] - y) / torch.linalg.vector_norm(y))
        if not ex_store <= 1.0:
            problems.append(f"stored tokens off by {ex_store:.2f} of their rounding bound")
        if hd == INDEX_DIM:
            sc = got["scales"][:, 0]
            if not bool(((sc >= b["scale_lo"]) & (sc <= b["scale_hi"])).all()):
                problems.append("an indexer scale is not max(1e-4, amax) / 448")
        else:
            e = got["scales"].double()
            if not bool(((e >= b["e_lo"]) & (e <= b["e_hi"])).all()):
                problems.append("a UE8M0 scale is not the power of two above amax / 448")
    # bytes outside the stored tokens must be the ones that were there
    mask = torch.ones_like(cache_before, dtype=torch.bool, device="cpu")
    bits = ps.bit_length() - 1
    for t in ref.done:
        loc = int(case["out_loc"][t])
        page, slot = loc >> bits, loc & (ps - 1)
        if hd == INDEX_DIM:
            mask[page, slot * 128:(slot + 1) * 128] = False
            mask[page, 128 * ps + slot * 4:128 * ps + slot * 4 + 4] = False
        else:
            mask[page, slot * 576:(slot + 1) * 576] = False
            mask[page, 576 * ps + slot * 8:576 * ps + slot * 8 + 7] = False
    if not torch.equal(cache_after.cpu()[mask], cache_before.cpu()[mask]):
        problems.append("cache bytes outside the completed rows' tokens changed")
    metrics = {"state_excess": round(ex_state, 4), "store_excess": round(ex_store, 4), "store_rel_err": rel,
               "rows_completed": len(ref.done)}
    return not problems, metrics, "; ".join(problems)
