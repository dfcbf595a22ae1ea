"""Self-check cases of the MXFP4 MoE patch (`moe`): see v4flash_kernels.selfcheck.

Production shapes are DeepSeek-V4-Flash's routed experts on one GPU of a TP worker (256 experts,
top-6, hidden 4096, intermediate 2048 / TP), with fp32 power-of-two scales as SGLang's sm_120
loader leaves them, at each decode batch size and at one prefill chunk's tokens: between them the
planner launches its inline, sorted-decode and prefill GEMM binaries. The largest decode batch is
also captured in a CUDA graph and replayed on new routing. Big calls are compared with fp64 on a
subset of tokens (every token is still checked for NaN).

The same switch repacks the sm_120 layers at load time and runs them through
`repacked_op.moe_forward_repacked` (what `sglang_patch.apply` calls for a repacked layer), so every shape
is checked a second time that way, on a repacked copy of the same weights (`repack.repack_experts`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from v4flash_kernels.selfcheck.case import PRODUCTION, SMALL, Case, Comparison, Inputs, Target, check_rows, registry_function

PATCH = "moe"
EXPERTS, TOPK, HIDDEN, INTER_TP1 = 256, 6, 4096, 2048
CLAMP, SCALING = 10.0, 1.5
REL_TOL = 1e-2
UPSTREAM_MAX_TOKENS = 16  # upstream runs one GEMV per (token, expert) slot: 0.25 ms at M=1, seconds at prefill sizes


def cases(target: Target) -> List[Case]:
    from v4flash_kernels.moe.reference import MoeCase

    out = []
    for tag, ours in (("", _ours), (" repacked (v2)", _ours_repacked)):
        out += [
            _small(f"small M=5 holes+clamp{tag}", target, ours,
                   MoeCase(tokens=5, hole_frac=0.25, clamp_limit=0.4, routed_scaling_factor=2.5)),
            _small(f"small M=19 hot expert (sorted){tag}", target, ours,
                   MoeCase(tokens=19, topk=3, routing="hot", clamp_limit=0.4)),
        ]
    if target.small_only:
        return out
    inter = INTER_TP1 // max(1, target.tp_size)
    weights: Dict[Any, Any] = {}
    largest = max(target.decode_rows)
    for tag, ours in (("", _ours), (" repacked (v2)", _ours_repacked)):
        for m in target.decode_rows:
            out.append(_production(f"decode M={m}{tag}", m, inter, target, weights, ours, graph=m == largest))
        if target.prefill_rows:
            out.append(_production(f"prefill M={target.prefill_rows}{tag}", target.prefill_rows, inter, target,
                                   weights, ours, graph=False))
    return out


def _ours(kw: Inputs) -> Any:
    return registry_function(PATCH)(*(kw[a] for a in _ARGS))


def _ours_repacked(kw: Inputs) -> Any:
    from v4flash_kernels.moe.repacked_op import moe_forward_repacked

    return moe_forward_repacked(kw["hidden_states"], kw["experts"], kw["topk_ids"], kw["topk_weights"],
                                kw["routed_scaling_factor"], kw["clamp_limit"])


def _with_repacked(kw: Inputs, cache: Dict[Any, Any], key: Any) -> Inputs:
    """The call's inputs plus a repacked copy of its experts (drawn once per weight set)."""
    from v4flash_kernels.moe.repack import repack_experts

    if key not in cache:
        cache[key] = repack_experts(kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"])
    return dict(kw, experts=cache[key])


_ARGS = ("hidden_states", "w13_packed", "w2_packed", "w13_scale", "w2_scale", "topk_ids", "topk_weights",
         "hidden_size", "intermediate_size", "inplace", "routed_scaling_factor", "clamp_limit")
_UPSTREAM: Dict[str, Any] = {}


def _upstream(kw: Inputs) -> Any:
    if "mod" not in _UPSTREAM:
        from v4flash_kernels.upstream import MOE_PATH, load_module

        _UPSTREAM["mod"] = load_module(MOE_PATH)
    return _UPSTREAM["mod"].mxfp4_moe_forward_triton(*(kw[a] for a in _ARGS))


def _small(name: str, target: Target, ours: Any, case: Any) -> Case:
    from v4flash_kernels.moe.reference import make_inputs

    def inputs(seed: int) -> Inputs:
        kw = _meta(dict(make_inputs(case, device=target.device, seed=seed), inplace=False), target)
        return _with_repacked(kw, {}, None) if ours is _ours_repacked else kw

    return Case(name, SMALL, inputs, ours, _reference, _compare,
                upstream=_upstream if target.is_cuda else None,
                upstream_skip="" if target.is_cuda else "upstream's autotuned Triton kernel needs a GPU to pick its config")


def _production(name: str, tokens: int, inter: int, target: Target, weights: Dict[Any, Any], ours: Any,
                graph: bool) -> Case:
    def inputs(seed: int) -> Inputs:
        kw = _meta(production_inputs(tokens, inter, seed, target.device, weights), target)
        return _with_repacked(kw, weights, ("repacked", inter)) if ours is _ours_repacked else kw

    up = tokens <= UPSTREAM_MAX_TOKENS
    return Case(name, PRODUCTION, inputs, ours, _reference, _compare, upstream=_upstream if up else None,
                upstream_skip="" if up else f"upstream is one GEMV per (token, expert): only run up to "
                                            f"M={UPSTREAM_MAX_TOKENS}", graph=graph)


def _meta(kw: Inputs, target: Target) -> Inputs:
    import torch

    kw["_rows"] = torch.tensor(check_rows(kw["hidden_states"].shape[0], 32), device=target.device)
    return kw


def production_inputs(tokens: int, inter: int, seed: int, device: str, weights: Dict[Any, Any]) -> Inputs:
    """One call's arguments on `device`. The ~0.8 GB of expert weights are drawn once per process and
    shared by the cases (what changes between seeds is the routing and the activations)."""
    import torch

    if inter not in weights:
        g = torch.Generator(device=device).manual_seed(12345)

        def u8(low: int, high: int, size: Tuple[int, int, int]) -> torch.Tensor:
            return torch.randint(low, high, size, dtype=torch.uint8, device=device, generator=g)

        w13 = u8(0, 256, (EXPERTS, 2 * inter, HIDDEN // 2))
        w2 = u8(0, 256, (EXPERTS, HIDDEN, inter // 2))
        # e8m0 exponents 2^-9..2^-5 (weights of ~0.01-0.1), as fp32 powers of two like SGLang's loader leaves
        s13 = u8(118, 123, (EXPERTS, 2 * inter, HIDDEN // 32))
        s2 = u8(118, 123, (EXPERTS, HIDDEN, inter // 32))
        weights[inter] = (w13.view(torch.int8), w2.view(torch.int8),
                          s13.view(torch.float8_e8m0fnu).to(torch.float32), s2.view(torch.float8_e8m0fnu).to(torch.float32))
    w13, w2, s13, s2 = weights[inter]
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand((tokens, EXPERTS), generator=g, device=device).topk(TOPK, dim=1).indices.to(torch.int32)
    holes = torch.rand((tokens, TOPK), generator=g, device=device) < 0.02
    ids = torch.where(holes, torch.full_like(ids, -1), ids)
    w = torch.softmax(torch.randn((tokens, TOPK), generator=g, device=device), dim=1)
    x = torch.randn((tokens, HIDDEN), generator=g, device=device).to(torch.bfloat16)
    return {"hidden_states": x, "w13_packed": w13, "w2_packed": w2, "w13_scale": s13, "w2_scale": s2, "topk_ids": ids,
                "topk_weights": w, "hidden_size": HIDDEN, "intermediate_size": inter, "inplace": False,
                "routed_scaling_factor": SCALING, "clamp_limit": CLAMP}


def _reference(kw: Inputs) -> Any:
    from v4flash_kernels.moe.reference import moe_ref

    return moe_ref(kw["hidden_states"], kw["w13_packed"], kw["w2_packed"], kw["w13_scale"], kw["w2_scale"],
                   kw["topk_ids"], kw["topk_weights"], kw["intermediate_size"], kw.get("routed_scaling_factor"),
                   kw.get("clamp_limit"), tokens=kw["_rows"])


def _compare(out: Any, ref: Any, kw: Inputs) -> Comparison:
    import torch

    from v4flash_kernels.kit.compare import rel_err

    x = kw["hidden_states"]
    problems = []
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        problems.append(f"result is {tuple(out.shape)} {out.dtype}, expected {tuple(x.shape)} {x.dtype}")
        return Comparison(False, {}, "; ".join(problems))
    nan = bool(torch.isnan(out.float()).any())
    err = rel_err(out[kw["_rows"]], ref)
    if nan:
        problems.append("NaN in the output")
    if not err <= REL_TOL:
        problems.append(f"rel. error {err:.3g} > {REL_TOL:g}")
    return Comparison(not problems, {"rel_err": err, "nan": nan, "tokens_checked": int(kw["_rows"].numel())},
                      "; ".join(problems))
