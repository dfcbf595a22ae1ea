"""The rows a speculative-decoding verify step sends through our kernels, for the verify-shape tests.

With EAGLE (top-k 1, `k` draft steps, `k + 1` draft tokens) the decode worker's verify step is a
TARGET_VERIFY forward of `B x (k + 1)` rows. In sglang 0.5.13.post1 (DeepseekV4AttnBackend,
`make_forward_metadata_from_raw_verify` inside the CUDA graph, `init_forward_metadata_target_verify_old`
eagerly) request r with `L` committed tokens (`forward_batch.seq_lens`) becomes rows j = 0..k with
`seq_lens_casual = L + 1 + j` (each row sees the tokens before it and itself), the request's
`req_pool_indices` repeated: the rows of one request share its page table, its SWA window (shifted
by one token per row) and its compressed caches. Per row, with s = seq_len:

- SWA: the last min(s, 128) positions, newest first, then -1 (width 128; length min(s, 128));
- c4 (compress 4): c4 length s // 4; the indexer scores positions < s // 4 on a table of
  `context / 256` pages (64 c4 positions each); the top-512 keeps them all when s // 4 <= 512,
  else 512 of them; attention reads them as `page_table[p >> 6] << 6 | (p & 63)`, length
  min(max(s // 4, 1), 512) (a row with s < 4 has length 1 and only -1);
- c128: positions o < s // 128 as `page_table[o // 2] * 2 + o % 2`, -1 beyond, width
  `context / 128` padded to 64, length max(s // 128, 1).

Everything row-wise (the MoE, the FP8 linears, mHC) just sees `B x (k + 1)` rows.

Which batch sizes: the decode worker captures CUDA graphs for the batch sizes SGLang generates with
speculative decoding on (`ServerArgs._generate_cuda_graph_batch_sizes`, read from the wheel at run
time) up to the worker's `--cuda-graph-max-bs` (64 in the default profile's decode worker; a CPU
test checks the launcher still says so), each captured with `bs x (k + 1)` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Sequence, Tuple

import torch

from v4flash_kernels.attention.reference import NOPE_DIM, ROPE_DIM, TOKEN_BYTES, TOKEN_DATA_BYTES, page_stride

TP = 4
DECODE_GRAPH_MAX_BS = 64  # the default profile's decode worker: --cuda-graph-max-bs 64
MAX_RUNNING_REQUESTS = 256  # deepseek_v4_hook's default; capture sizes above it are dropped
CONTEXT = 131072  # the default profile's --context-length
DRAFT_STEPS = (1, 2, 3)
HEADS_PER_RANK = 64 // TP  # attention heads of one TP4 rank (the 64-head q's real slice)
RAW_PAGE = 256  # SGLang's page size for DeepSeek-V4 (tokens)
C4_PAGE = RAW_PAGE // 4  # c4 positions per page (indexer pool and c4 attention cache)
C128_PAGE = RAW_PAGE // 128
SWA = 128
C4_TOPK = 512
INDEX_HEADS = 64
PAD64 = 64  # SGLang pads every index width to a multiple of 64


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    smem: int  # shared memory per SM (bytes)


H200 = Gpu("H200", 132, 233472)
RTX6000 = Gpu("RTX PRO 6000", 188, 102400)


# ----------------------------------------------------------------------------- which rows


def spec_capture_bs(max_bs: int = DECODE_GRAPH_MAX_BS) -> Tuple[int, ...]:
    """The batch sizes SGLang captures with speculative decoding on, from the pinned wheel's own code.

    `ServerArgs._generate_cuda_graph_batch_sizes` (EAGLE, padding on) is read from the wheel and run;
    then what `get_batch_sizes_to_capture` keeps at plain TP4 (no attention-TP gather: every size
    divides; at most `max_running_requests`).
    """
    from v4flash_kernels import upstream

    text, origin = upstream.source_of("sglang/srt/server_args.py")
    src = upstream.extract_methods(text, "ServerArgs", ["_generate_cuda_graph_batch_sizes"])
    ns: Dict[str, object] = {}
    exec(compile(src, origin, "exec"), ns)  # upstream's method, read from the wheel at run time
    args = SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm="EAGLE", cuda_graph_max_bs=max_bs)
    sizes = ns["_generate_cuda_graph_batch_sizes"](args)  # type: ignore[operator]
    return tuple(sorted({b for b in sizes if 0 < b <= MAX_RUNNING_REQUESTS}))


def verify_shapes(bs: Sequence[int], steps: Sequence[int] = DRAFT_STEPS) -> Tuple[Tuple[int, int, int], ...]:
    """(bs, k, rows) of every captured verify graph, by rows then bs."""
    return tuple(sorted(((b, k, b * (k + 1)) for b in bs for k in steps), key=lambda t: (t[2], t[0])))


def cover(shapes: Sequence[Tuple[int, int, int]], label) -> Dict[str, List[Tuple[int, int, int]]]:
    """Each distinct `label(rows)` -> the fewest-rows and the most-rows (bs, k, rows) that take it."""
    groups: Dict[str, List[Tuple[int, int, int]]] = {}
    for s in shapes:
        groups.setdefault(label(s[2]), []).append(s)
    return {lab: sorted({g[0], g[-1]}, key=lambda t: t[2]) for lab, g in groups.items()}


def row_ranges(rows: Sequence[int], label) -> List[Tuple[int, int, str]]:
    """(first row count, last row count, label) of each run of equal labels over sorted `rows`."""
    out: List[Tuple[int, int, str]] = []
    for r in sorted(set(rows)):
        lab = label(r)
        if out and out[-1][2] == lab:
            out[-1] = (out[-1][0], r, lab)
        else:
            out.append((r, r, lab))
    return out


# ----------------------------------------------------------------------------- plan branches by rows


def c128_width(context: int) -> int:
    return -(-(context // 128) // PAD64) * PAD64


def attention_label(rows: int, kind: str, gpu: Gpu, context: int = CONTEXT) -> str:
    """The sparse-MLA decode's plan at a TP4 rank (16 heads): config, tokens per split, epilogue."""
    from v4flash_kernels.attention import op as decode

    w_b = {"swa": 0, "c4": C4_TOPK, "c128": c128_width(context)}[kind]
    p = decode.make_plan(rows, HEADS_PER_RANK, SWA, w_b, gpu.sms, smem_per_sm=gpu.smem)
    coop = p.fused and decode.coop_fits(p.num_splits * rows * -(-HEADS_PER_RANK // p.config.block_h), gpu.sms)
    ep = {0: "combine", 1: "one-launch", 2: "one-split"}[decode.epilogue_for(p.config, p.num_splits, coop)]
    return f"{p.config.name}/chunk{p.chunk}/{ep}"


def indexer_label(rows: int, gpu: Gpu, context: int = CONTEXT) -> str:
    """The indexer logits' grid: programs per SM aimed at (8, or 16 from BIG_BATCH rows), and whether
    a row's tiles cap its programs (the programs per row themselves follow rows continuously)."""
    from v4flash_kernels.indexer import op as ix

    cfg = ix.DEFAULT
    pages = context // 4 // ix.PAGE
    n = ix.programs_per_row(rows, pages, gpu.sms, cfg)
    per_sm = cfg.ctas_per_sm_big if cfg.ctas_per_sm_big and rows >= ix.BIG_BATCH else cfg.ctas_per_sm
    return f"{cfg.name}/{per_sm}-per-SM" + ("/capped-at-tiles" if n == math.ceil(pages / cfg.pages) else "")


def topk_label(rows: int, gpu: Gpu) -> str:
    """The top-512's binary (SPEC: the first 2K scores loaded with seq_len) and its program count."""
    from v4flash_kernels.topk import op as tk

    n = tk.programs(rows, gpu.sms, tk.DEFAULT)
    return f"spec={tk.speculate(rows, C4_TOPK)}/" + ("persistent" if n < rows else "program-per-row")


# DeepSeek-V4-Flash's block-FP8 linears at TP4, (N, K), as the fp8 plan table names them.
FP8_SHAPES = {"wqkv_a": (1536, 4096), "wq_b": (8192, 1024), "wo_b": (4096, 2048),
              "shared_gate_up": (1024, 4096), "shared_down": (4096, 512)}


def fp8_label(rows: int, shape: str, gpu: Gpu) -> str:
    from v4flash_kernels.fp8_gemm import op as f8

    n, k = FP8_SHAPES[shape]
    return f8.plan(rows, n, k, gpu.sms).name


MOE = {"experts": 256, "topk": 6, "hidden": 4096, "inter": 2048 // TP}


def moe_label(rows: int, version: str) -> str:
    """v1 = the drop-in (layers not repacked), v2 = repacked layers (what the switch runs by default)."""
    from v4flash_kernels.moe import op as v1
    from v4flash_kernels.moe import repacked_op as v2

    mod = v1 if version == "v1" else v2
    return mod.make_plan(rows, MOE["topk"], MOE["experts"], MOE["hidden"], MOE["inter"]).name


def mhc_label(rows: int, gpu: Gpu, hidden: int = 4096) -> str:
    from v4flash_kernels.mhc import op as mh

    return mh.plan_for(rows, hidden, gpu.sms).name


# ----------------------------------------------------------------------------- one verify batch


@dataclass(frozen=True)
class VerifyBatch:
    """`committed[r]`: tokens request r holds before the step; k draft steps -> k + 1 rows each."""

    committed: Tuple[int, ...]
    k: int

    @property
    def requests(self) -> int:
        return len(self.committed)

    @property
    def rows(self) -> int:
        return self.requests * (self.k + 1)

    def seq_lens(self) -> torch.Tensor:
        """`[rows]` int64: L + 1 + j, request-major (SGLang's seq_lens_casual)."""
        return torch.tensor([L + 1 + j for L in self.committed for j in range(self.k + 1)], dtype=torch.int64)

    def request_of_row(self) -> torch.Tensor:
        return torch.arange(self.requests).repeat_interleave(self.k + 1)


def draw_batch(bs: int, k: int, context: int, gen: torch.Generator, edges: bool = True) -> VerifyBatch:
    """Committed lengths for `bs` requests: with `edges` the first ones put their k + 1 rows across an
    edge (a 128-token boundary: c128 length and SWA; 2052 tokens: c4 length 512 -> 513, the top-512's
    sequential rule -> a real selection; the first tokens: c4/c128 lengths 0), the rest uniform."""
    top = context - k - 1
    h = (k + 1) // 2  # rows L + 1 .. L + k + 1 then straddle the edge E when L = E - 1 - h
    at = [min(top, 3 * 128 - 1 - h), min(top, 2052 - 1 - h), 1, min(top, 128 - 1 - h)]
    lens = at[:bs] if edges else []
    while len(lens) < bs:
        lens.append(int(torch.randint(1, top + 1, (1,), generator=gen)))
    perm = torch.randperm(bs, generator=gen).tolist()
    return VerifyBatch(tuple(lens[i] for i in perm), k)


@dataclass(frozen=True)
class Layout:
    """A verify batch's pages: `table[r]` the raw (256-token) pages of request r, distinct across
    requests, 0 past the request's pages (req_to_token's untouched slots); page 0 is never a real page."""

    batch: VerifyBatch
    context: int
    table: torch.Tensor  # [requests, context / 256] int32
    num_pages: int

    def row_table(self) -> torch.Tensor:
        """`[rows, context / 256]` int32: each row's copy of its request's table (SGLang repeats it)."""
        return self.table[self.batch.request_of_row().to(self.table.device)].contiguous()


def pages_needed(batch: VerifyBatch) -> int:
    """Raw pages a layout of `batch` holds: each request's, plus page 0."""
    return sum(math.ceil((L + batch.k + 1) / RAW_PAGE) for L in batch.committed) + 1


def make_layout(batch: VerifyBatch, context: int, gen: torch.Generator, device="cpu",
                num_pages: int | None = None) -> Layout:
    """`num_pages` (>= `pages_needed`, default that) sizes the pools, e.g. to replay a captured graph on
    a second batch; the requests' pages are then drawn from all of them. `gen` is a CPU generator."""
    cols = context // RAW_PAGE
    used = [math.ceil((L + batch.k + 1) / RAW_PAGE) for L in batch.committed]
    num_pages = num_pages or pages_needed(batch)
    if num_pages < pages_needed(batch) or max(used) > cols:
        raise ValueError(f"{num_pages} pages / {cols} table columns cannot hold {batch}")
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).to(torch.int32)
    table = torch.zeros((batch.requests, cols), dtype=torch.int32)
    start = 0
    for r, n in enumerate(used):
        table[r, :n] = perm[start:start + n]
        start += n
    return Layout(batch, context, table.to(device), num_pages)


# ----------------------------------------------------------------------------- attention


def mla_pool(num_pages: int, page_size: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """SGLang's fp8_ds_mla pool `[P, page bytes]` as its `[P, page_size, 1, 584]` view (what the attention
    backend hands the kernel; `pool_bytes` gives the 2-d buffer back), drawn on `device` (`gen` lives
    there): garbage in every byte first, then sane fp8 NoPE, ue8m0 scales near 2^0 and bf16 RoPE in
    each slot (the layout `attention.reference` documents)."""
    P, ps = num_pages, page_size
    pool = torch.randint(0, 256, (P, page_stride(ps)), dtype=torch.uint8, generator=gen, device=device)
    nope = (torch.randn((P, ps, NOPE_DIM), generator=gen, device=device) * 2.0).to(torch.float8_e4m3fn)
    rope = torch.randn((P, ps, ROPE_DIM), generator=gen, device=device).to(torch.bfloat16)
    data = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=-1)
    pool[:, : ps * TOKEN_DATA_BYTES] = data.reshape(P, ps * TOKEN_DATA_BYTES)
    sc = pool[:, ps * TOKEN_DATA_BYTES: ps * TOKEN_BYTES].view(P, ps, 8)
    sc[:, :, :7] = torch.randint(123, 131, (P, ps, 7), dtype=torch.uint8, generator=gen, device=device)
    return pool[:, : ps * TOKEN_BYTES].view(P, ps, 1, TOKEN_BYTES)


def pool_bytes(view: torch.Tensor) -> torch.Tensor:
    """The `[P, page bytes]` uint8 buffer under an `mla_pool` view (the memory pool's own tensor)."""
    return view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1)).view(torch.uint8)


def _c4_positions(n4: torch.Tensor, gen: torch.Generator, width: int = C4_TOPK) -> torch.Tensor:
    """`[rows, width]` int64 c4 positions per row: 0..n-1 then -1 when n <= width (the top-512's
    sequential rule), else `width` distinct positions < n in a random order (its order is unspecified)."""
    rows = n4.shape[0]
    out = torch.full((rows, width), -1, dtype=torch.int64)
    for i, n in enumerate(n4.tolist()):
        if n <= width:
            out[i, :n] = torch.arange(n)
        else:
            out[i] = torch.randperm(n, generator=gen)[:width]
    return out


def _translate(table_rows: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    """Positions -> `table[pos // page] * page + pos % page` (int32), -1 kept."""
    col = pos.clamp(min=0) // page
    phys = torch.gather(table_rows.to(torch.int64), 1, col.to(table_rows.device))
    out = phys * page + (pos.to(table_rows.device) % page)
    return torch.where(pos.to(table_rows.device) >= 0, out, -1).to(torch.int32)


def swa_slots(batch: VerifyBatch, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where the SWA pool holds each request's recent tokens: (`slots [requests, span]`, `first
    [requests]`), slot of position `first[r] + i` of request r = `slots[r, i]`, span = 128 + k + 1
    (every position a row of the step can see), all slots distinct (the pool has 128-token pages)."""
    span = SWA + batch.k + 1
    slots = torch.randperm(batch.requests * span, generator=gen).view(batch.requests, span)
    first = torch.tensor([max(0, L + batch.k + 1 - span) for L in batch.committed])
    return slots, first


def swa_indices(batch: VerifyBatch, slots: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """`[rows, 128]` int32: row of seq_len s holds positions s-1, s-2, ... (newest first) as SWA slots,
    -1 once below position 0 (what `get_swa_page_indices` builds)."""
    s = batch.seq_lens()
    req = batch.request_of_row()
    pos = (s - 1).unsqueeze(1) - torch.arange(SWA).unsqueeze(0)
    local = (pos - first[req].unsqueeze(1)).clamp(min=0)
    return torch.where(pos >= 0, slots[req.unsqueeze(1), local], -1).to(torch.int32)


def attention_inputs(lay: Layout, kind: str, heads: int, gen: torch.Generator, device="cpu",
                     cpu_gen: torch.Generator | None = None) -> dict:
    """Keyword arguments of `sparse_mla_decode` for one layer of `kind` (swa | c4 | c128) at this verify
    batch. `gen` draws the caches and q on `device`; `cpu_gen` (default: seeded from `gen`) the slots
    and the c4 selections."""
    g = cpu_gen or torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device=device)))
    b = lay.batch
    s = b.seq_lens()
    R = b.rows
    slots, first = swa_slots(b, g)
    kw = {
        "q": torch.randn((R, 1, heads, 512), generator=gen, device=device).to(torch.bfloat16),
        "k_cache": mla_pool(-(-slots.numel() // SWA), SWA, gen, device),
        "indices": swa_indices(b, slots, first).view(R, 1, SWA).to(device),
        "topk_length": s.clamp(max=SWA).to(torch.int32).to(device),
        "attn_sink": (torch.randn((heads,), generator=gen, device=device) * 2.0),
        "head_dim_v": 512,
        "softmax_scale": 512 ** -0.5,
    }
    if kind == "swa":
        return kw
    rows_table = lay.row_table()
    if kind == "c4":
        n4 = s // 4
        idx = _translate(rows_table, _c4_positions(n4, g), C4_PAGE)
        kw.update(extra_k_cache=mla_pool(lay.num_pages, C4_PAGE, gen, device), extra_indices=idx.view(R, 1, -1),
                  extra_topk_length=n4.clamp(min=1, max=C4_TOPK).to(torch.int32).to(device))
    elif kind == "c128":
        n128 = s // 128
        width = c128_width(lay.context)
        o = torch.arange(width).unsqueeze(0).expand(R, width)
        pos = torch.where(o < n128.unsqueeze(1), o, -1)
        idx = _translate(rows_table, pos, C128_PAGE)
        kw.update(extra_k_cache=mla_pool(lay.num_pages, C128_PAGE, gen, device), extra_indices=idx.view(R, 1, -1),
                  extra_topk_length=n128.clamp(min=1).to(torch.int32).to(device))
    else:
        raise ValueError(kind)
    return kw


def tp4_query(kw: dict, rank: int) -> Tuple[dict, slice]:
    """SGLang's TP4 call: a 64-head q whose `rank` slice is `kw`'s q, the other 48 heads NaN/Inf/3e38
    (its uninitialised pad), and a 64-head sink with garbage outside the slice."""
    R, _, h, D = kw["q"].shape
    keep = slice(h * rank, h * (rank + 1))
    q = torch.empty((R, 1, 4 * h, D), dtype=kw["q"].dtype, device=kw["q"].device)
    vals = (float("nan"), float("inf"), float("-inf"), 3.0e38)
    for head in range(4 * h):
        q[:, :, head] = vals[head % 4]
    q[:, :, keep] = kw["q"]
    sink = torch.full((4 * h,), float("nan"), device=kw["q"].device)
    sink[keep] = kw["attn_sink"]
    return dict(kw, q=q, attn_sink=sink), keep


# ----------------------------------------------------------------------------- indexer and top-512


def indexer_inputs(lay: Layout, gen: torch.Generator, device="cpu", heads: int = INDEX_HEADS) -> dict:
    """Positional kwargs of `fp8_paged_mqa_logits` as `forward_c4_indexer` passes them at verify:
    seq_lens `[rows, 1]` = s // 4, each row's copy of its request's page table, max_seq_len
    = table columns x 64, one shared c4 indexer pool (a page per raw page)."""
    from v4flash_kernels.indexer.reference import make_pool

    b = lay.batch
    R = b.rows
    pool = make_pool(lay.num_pages, gen, device)
    return {
        "q_fp8": (torch.randn((R, 1, heads, 128), generator=gen, device=device) * 2.0).to(torch.float8_e4m3fn),
        "kvcache_fp8": pool.view(lay.num_pages, C4_PAGE, 1, 132),
        "weight": torch.randn((R, heads), generator=gen, device=device) * 0.05,
        "seq_lens": (b.seq_lens() // 4).to(torch.int32).unsqueeze(-1).to(device),
        "page_table": lay.row_table(),
        "deep_gemm_metadata": None,
        "max_seq_len": lay.table.shape[1] * C4_PAGE,
        "clean_logits": False,
    }


def verify_scores(lay: Layout, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """`[rows, context / 4]` fp32 logits-like scores: one request's rows score the same keys with
    different queries (a shared part plus a per-row part), -inf from each row's c4 length on."""
    b = lay.batch
    width = lay.table.shape[1] * C4_PAGE
    base = torch.randn((b.requests, width), generator=gen, device=device)
    rows = base[b.request_of_row().to(device)] + 0.3 * torch.randn((b.rows, width), generator=gen, device=device)
    n4 = (b.seq_lens() // 4).to(device)
    return rows.masked_fill(torch.arange(width, device=device).unsqueeze(0) >= n4.unsqueeze(1), float("-inf"))


def topk_inputs(lay: Layout, scores: torch.Tensor, raw: bool = True) -> dict:
    """Positional kwargs of `topk_transform_512` as `forward_c4_indexer` passes them at verify (1-d
    c4 lengths, the rows' tables, page size 64), outputs poisoned; `raw`: with `out_raw_indices`
    (the eager verify path's prefill metadata has it, the in-graph one does not)."""
    R = lay.batch.rows
    dev = scores.device
    return {
        "scores": scores,
        "seq_lens": (lay.batch.seq_lens() // 4).to(torch.int32).to(dev),
        "page_tables": lay.row_table(),
        "out_page_indices": torch.full((R, C4_TOPK), -7, dtype=torch.int32, device=dev),
        "page_size": C4_PAGE,
        "out_raw_indices": torch.full((R, C4_TOPK), -7, dtype=torch.int32, device=dev) if raw else None,
    }
