"""The MoE patches on SGLang's layer objects: repack the experts at load time, dispatch at apply.

Targets (sglang 0.5.13.post1, `layers/quantization/mxfp4_marlin_moe.py`, class `Mxfp4MarlinMoEMethod`;
registry entries `moe_repack` and `moe_apply` under the `moe` switch):

* `process_weights_after_loading(self, layer)`: upstream's runs first, unchanged. On the sm_120
  path it leaves (`layer._dsv4_mxfp4_backend == "sm120_triton"`), and only while our `apply` is the
  class's (the repacked weights are in an order only v2 and v1 with `nibbles=1` read), the layer's
  experts are then repacked in place (`repack.py`): every scale checked to be an exact power of two
  in the fast decode's range, the weights rewritten in PAIR_SPLIT nibble order chunk by chunk, the
  fp32 scale Parameters replaced by `float8_e8m0fnu` ones (a quarter of the memory and of the scale
  bytes each forward reads), and `layer._v4flash_moe` set to the `RepackedExperts` view. A layer that
  fails the check keeps its weights, its fp32 scales and SGLang's path (one warning naming the layer
  and the scales; `status_detail` reports it). Marlin (sm_90/100) and other paths are not touched.
* `apply(self, layer, dispatch_output)`: a repacked layer runs `repacked_op.moe_forward_repacked` with
  the arguments upstream's sm_120 branch passes `mxfp4_moe_forward_triton` (the runner config's
  `routed_scaling_factor` and `swiglu_limit` when the runner has a config); every other layer goes
  to upstream's `apply`.

Limits: anything else that reads a repacked layer's weight tensors sees PAIR_SPLIT order (nothing
on SGLang's sm_120 serving path does: `apply` is the only consumer); weights written into a layer
after load (online weight updates) must go through `process_weights_after_loading` again. The
scale Parameters the repack installs carry no `weight_loader`, as with upstream's own scale
conversion on this path.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, Dict, List, cast

import torch

from v4flash_kernels.moe.repack import LAYOUT, RepackedExperts, ScaleError, repack_experts

REPACKED_ATTR = "_v4flash_moe"  # the layer attribute holding its RepackedExperts (None: not repacked)
SM120_BACKEND = "sm120_triton"  # upstream's `layer._dsv4_mxfp4_backend` on its sm_120 path

# A child of the hook's logger: the same "[v4flash-kernels]" stderr line as its other decisions.
log = logging.getLogger("v4flash_kernels.hook.hook.moe_repack")
_lock = threading.Lock()
_repacked: List[str] = []  # layer prefixes repacked in this process
_kept: Dict[str, str] = {}  # layer prefix -> why it kept upstream's path


def _upstream(patch_name: str) -> Callable[..., Any]:
    """Upstream's original of one of our class-attribute patches, as the hook kept it."""
    from v4flash_kernels.hook.hook import upstream_keep_attr
    from v4flash_kernels.hook.patches import by_name

    spec = by_name(patch_name)
    fn = getattr(sys.modules.get(spec.target_module), upstream_keep_attr(spec), None)
    if fn is None:
        raise RuntimeError(f"{spec.upstream_function}: the hook kept no upstream original (patch not applied?)")
    return cast(Callable[..., Any], fn)


def repack_layer(layer: Any, prefix: str) -> RepackedExperts | None:
    """Repack one loaded layer in place (see the module doc); None when its scales fail the check."""
    try:
        experts = repack_experts(layer.w13_weight.data, layer.w2_weight.data, layer.w13_weight_scale_inv.data,
                                 layer.w2_weight_scale_inv.data, in_place=True,
                                 names=("w13_weight_scale_inv", "w2_weight_scale_inv"))
    except ScaleError as exc:
        setattr(layer, REPACKED_ATTR, None)
        _record(prefix, str(exc))
        return None
    # Same Parameter swap upstream does for byte scales on this path; frees the fp32 scales.
    layer.w13_weight_scale_inv = torch.nn.Parameter(experts.s13.view(torch.float8_e8m0fnu), requires_grad=False)
    layer.w2_weight_scale_inv = torch.nn.Parameter(experts.s2.view(torch.float8_e8m0fnu), requires_grad=False)
    setattr(layer, REPACKED_ATTR, experts)
    _record(prefix, None)
    return experts


def _record(prefix: str, why: str | None) -> None:
    with _lock:
        if prefix in _repacked:
            _repacked.remove(prefix)
        _kept.pop(prefix, None)
        if why is None:
            _repacked.append(prefix)
        else:
            _kept[prefix] = why
    if why is not None:
        log.warning("MoE layer %s not repacked, keeps SGLang's sm_120 path: %s", prefix, why)
    _refresh_status()


def _refresh_status() -> None:
    try:
        from v4flash_kernels.hook.hook import refresh_status_file

        refresh_status_file()
    except Exception:  # the status file must never break model loading
        pass


def status_detail() -> Dict[str, Any]:
    """The repack's record for the hook's status (and so `status`/`doctor`): layers repacked, layers
    that kept upstream's path and why, and a one-line summary the hook appends to the reason."""
    with _lock:
        kept = dict(_kept)
        n_ok = len(_repacked)
    total = n_ok + len(kept)
    if total == 0:
        summary = "no sm_120 MoE layer loaded yet"
    else:
        summary = f"repacked {n_ok} of {total} sm_120 MoE layers ({LAYOUT})"
        if kept:
            first, why = next(iter(kept.items()))
            summary += f"; {len(kept)} kept SGLang's path, e.g. {first}: {why}"
    return {"layout": LAYOUT, "repacked_layers": n_ok, "kept_layers": kept, "summary": summary}


def process_weights_after_loading(self: Any, layer: Any) -> None:
    """Upstream's load-time processing, then the repack on its sm_120 path (module doc)."""
    _upstream("moe_repack")(self, layer)
    if getattr(layer, "_dsv4_mxfp4_backend", None) != SM120_BACKEND:
        return
    prefix = str(getattr(self, "prefix", "?"))
    if getattr(type(self), "apply", None) is not apply:  # nothing would read the repacked order
        setattr(layer, REPACKED_ATTR, None)
        _record(prefix, "the moe_apply patch is not active, so nothing would read the repacked layer")
        return
    repack_layer(layer, prefix)


def apply(self: Any, layer: Any, dispatch_output: Any) -> Any:
    """v2 for a repacked layer on the sm_120 path, upstream's `apply` for anything else."""
    experts = getattr(layer, REPACKED_ATTR, None)
    if experts is None or getattr(layer, "_dsv4_mxfp4_backend", None) != SM120_BACKEND:
        return _upstream("moe_apply")(self, layer, dispatch_output)
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    from v4flash_kernels.moe.repacked_op import moe_forward_repacked

    topk_output = dispatch_output.topk_output
    if not TopKOutputChecker.format_is_standard(topk_output):
        raise ValueError(f"Unsupported topk output format: {topk_output.format}")
    has_config = hasattr(self.runner, "config")
    output = moe_forward_repacked(
        dispatch_output.hidden_states, experts, topk_output.topk_ids, topk_output.topk_weights,
        routed_scaling_factor=self.runner.config.routed_scaling_factor if has_config else None,
        clamp_limit=self.runner.config.swiglu_limit if has_config else None,
    )
    return StandardCombineInput(hidden_states=output)
