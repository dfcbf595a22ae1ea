"""Self-check cases of the fused compressor (`compressor`): see v4flash_kernels.selfcheck.

Production shapes are one layer's three compressor calls at this worker's decode batches (the weights
are replicated, so TP does not change them): the attention c4 (wkv_gate 2048 x 4096, 512 head dims,
FlashMLA cache pages of 64 tokens), the c128 (1024 x 4096, pages of 2) and the c4 indexer's (512 x
4096, 128 head dims, indexer pages of 64). Each call runs on a realistic ring: several requests at
different positions, about half of them completing a window (the first window, one just past an SWA
page, deep ones) and half not, and a CUDA-graph padding row; the largest fused batch is also
captured in a CUDA graph and replayed on fresh states. Batches above the fused rows (`op.MAX_ROWS`)
and the speculative verify batches (a prefill plan) are upstream's path, not checked here.

Ours is called as the model calls it (`backend.forward_core_compressor(x, forward_batch, layer_id,
compressor)` on stand-ins of SGLang's objects) and its result is the state ring and the cache after
the call, against the fp64 reference within the bounds of `reference.check_step`. Upstream (the
wheel's HIP Triton statement of the same step with the torch GEMM and the non-fused Triton store,
`compressor.upstream`) is held to the same bounds on the GPU; its Triton FP8 casts need one.
"""

from __future__ import annotations

from typing import Any, List

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, registry_function

PATCH = "compressor_core"
HIDDEN = 4096
KINDS = (("c4", 4, 512), ("c128", 128, 512), ("indexer c4", 4, 128))


def cases(target: Target) -> List[Case]:
    out = [_case(f"small {name} T=3 K=256", SMALL, 3, ratio, hd, 256, target) for name, ratio, hd in KINDS]
    if target.small_only:
        return out
    from v4flash_kernels.compressor.op import MAX_ROWS

    rows = [b for b in target.decode_rows if b <= MAX_ROWS]
    for name, ratio, hd in KINDS:
        for b in rows:
            out.append(_case(f"{name} {2 * (2 if ratio == 4 else 1) * hd}x{HIDDEN} T={b}", PRODUCTION, b, ratio, hd,
                             HIDDEN, target, graph=b == max(rows)))
    return out


def _case(name: str, size: str, rows: int, ratio: int, hd: int, k: int, target: Target, graph: bool = False) -> Case:
    up = _upstream if target.is_cuda else None
    return Case(name, size, lambda seed: _inputs(rows, ratio, hd, k, seed, target.device), _ours, _reference,
                _compare, upstream=up,
                upstream_skip="" if up else "upstream's Triton FP8 store needs a GPU (the interpreter truncates its casts)",
                graph=graph)


def _inputs(rows: int, ratio: int, hd: int, k: int, seed: int, device: str) -> Inputs:
    from v4flash_kernels.compressor.reference import make_case

    return make_case(rows, ratio, hd, k, seed, device)


def _ours(kw: Inputs) -> Any:
    from v4flash_kernels.compressor.sglang_objects import objects

    registry_function(PATCH)(**objects(kw))
    return kw["state"], kw["cache"]


def _upstream(kw: Inputs) -> Any:
    from v4flash_kernels.compressor import upstream

    upstream.step(kw)
    return kw["state"], kw["cache"]


def _reference(kw: Inputs) -> Any:
    from v4flash_kernels.compressor.reference import step_ref

    return step_ref(kw), kw["cache"].cpu().clone()


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    from v4flash_kernels.compressor.reference import check_step

    state, cache = out
    step, cache_before = ref
    ok, metrics, why = check_step(kw, step, state, cache, cache_before)
    return Comparison(ok, metrics, why)
