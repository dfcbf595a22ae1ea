"""Run the self-check cases of some patches on this process's one device, recording as it goes.

Order per patch: every case's check of ours first (eager, then a CUDA-graph capture and two
replays on fresh inputs where the case asks for it), then upstream's function on the cases that
have one. So ours' verdict is complete before upstream runs: upstream failing (or breaking the
CUDA context) on this GPU is reported, never held against ours, which is what would replace it.

A CUDA error that poisons the context (an illegal address) ends the process's usefulness: the
runner records it against the case that raised it, sets `context_lost` and stops; the launcher
starts a fresh process for the patches not yet run.
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Tuple

from v4flash_kernels.selfcheck import errors, inject, record
from v4flash_kernels.selfcheck.case import Case, Target

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"[v4flash-selfcheck] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Options:
    target: Target
    patches: Tuple[str, ...]
    modules: Mapping[str, str | None]  # switch -> its selfcheck module (None: the registry names none)
    json_path: str | None = None
    inject: Mapping[str, str] = field(default_factory=dict)
    upstream: bool = True
    log: Log = _stderr
    gpu: int | None = None  # physical index (the launcher's label; this process sees one device)


def registry_modules(switches: Tuple[str, ...] | None = None) -> Dict[str, str | None]:
    """switch name -> its selfcheck module, from `hook.patches.SWITCHES` (KeyError names an unknown one).

    The launcher turns kernels on and off by switch (`--moe off`), so a switch is what is checked
    (its module covers every patch the switch controls)."""
    from v4flash_kernels.hook.patches import SWITCHES, switch_by_name

    names = switches if switches is not None else tuple(s.name for s in SWITCHES)
    return {n: switch_by_name(n).selfcheck for n in names}


def group_first(names: Tuple[str, ...]) -> Tuple[str, ...]:
    """Checks that span the worker's GPUs first: every rank then meets its peers from a fresh process,
    before another patch could lose this one's CUDA context (its peers would wait for it in vain)."""
    from v4flash_kernels.hook.patches import SWITCHES

    group = {s.name for s in SWITCHES if s.scope == "group"}
    return tuple(n for n in names if n in group) + tuple(n for n in names if n not in group)


def run(opts: Options) -> Dict[str, Any]:
    """Check every patch of `opts`; returns the record (also written to `opts.json_path` as it grows)."""
    t = opts.target
    rec = record.new(device_info(t), asdict(t), interpreter=not t.is_cuda)
    rec["gpu"] = opts.gpu
    record.write(opts.json_path, rec)
    for name in group_first(opts.patches):
        if rec["context_lost"]:
            break
        run_patch(name, opts.modules.get(name), opts, rec)
    rec["running"] = None
    rec["done"] = not rec["context_lost"]
    record.write(opts.json_path, rec)
    return rec


def run_patch(name: str, module: str | None, opts: Options, rec: Dict[str, Any]) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"status": record.RUNNING, "phase": "ours", "class": None, "error": None,
                             "seconds": 0.0, "module": module, "injected": opts.inject.get(name), "cases": []}
    rec["patches"][name] = entry
    t0 = time.monotonic()
    try:
        if module is None:
            entry.update(status=record.UNCHECKED, error="its registry entry names no self-check module")
            return entry
        _running(rec, opts, name, "(loading its cases)")
        try:
            cases = importlib.import_module(module).cases(opts.target)
        except Exception as exc:
            entry.update(status=record.FAIL, error=f"building its cases: {errors.describe(exc)}",
                         **{"class": errors.classify(exc)})
            rec["context_lost"] = _context_lost(opts.target)
            return entry
        if not cases:
            entry.update(status=record.FAIL, error=f"{module}.cases() gave no case for this target",
                         **{"class": errors.HARNESS_ERROR})
            return entry
        ours_kind = opts.inject.get(name)
        checked: List[Tuple[Case, Dict[str, Any], int, Any]] = []
        for i, case in enumerate(cases):
            _running(rec, opts, name, case.name)
            seed = opts.target.seed + 1000 * i
            ours = inject.wrap(ours_kind, case.ours, opts.target.device) if ours_kind else case.ours
            crec, ref = check_ours(case, ours, seed, opts.target)
            lost = crec.pop("context_lost")
            entry["cases"].append(crec)
            opts.log(f"{name} {case.name}: {crec['status']}"
                     + (f" ({crec['class']}: {crec['error']})" if crec["status"] == record.FAIL else "")
                     + f" [{crec['seconds']:.1f}s]")
            record.write(opts.json_path, rec)
            if lost:
                rec["context_lost"] = True
                break
            checked.append((case, crec, seed, ref if case.upstream is not None else None))
        if opts.upstream and not rec["context_lost"]:
            entry["phase"] = "upstream"  # ours' verdict is complete from here on
            entry["upstream"] = _upstream_pass(name, checked, opts, rec)
        bad = record.first_failure(entry["cases"])
        entry["status"] = record.patch_verdict(entry["cases"])
        if bad is not None:
            entry.update(**{"class": bad["class"], "error": f"{bad['name']}: {bad['error']}"})
        elif entry["status"] == record.SKIP:
            entry.update(status=record.FAIL, **{"class": errors.HARNESS_ERROR, "error": "no case could run"})
        return entry
    finally:
        entry["seconds"] = round(time.monotonic() - t0, 3)
        record.write(opts.json_path, rec)


def check_ours(case: Case, ours: Callable[[Any], Any], seed: int, target: Target) -> Tuple[Dict[str, Any], Any]:
    """(case record, reference): ours eager vs the reference, then under a CUDA graph if asked."""
    crec: Dict[str, Any] = {"name": case.name, "size": case.size, "status": record.PASS, "class": None,
                            "error": None, "seconds": 0.0, "metrics": {}, "graph": None, "upstream": None,
                            "context_lost": False}
    t0 = time.monotonic()

    def fail(cls: str, why: str) -> None:
        crec.update(status=record.FAIL, error=why, **{"class": cls})
        crec["context_lost"] = cls != errors.WRONG_RESULT and _context_lost(target)

    ref = None
    try:
        try:
            kw = case.make_inputs(seed)
            ref = case.reference(kw)
            _sync(target)
        except Exception as exc:
            fail(errors.HARNESS_ERROR, f"inputs/reference: {errors.describe(exc)}")
            return crec, None
        try:
            out = ours(kw)
            _sync(target)
        except Exception as exc:
            fail(errors.classify(exc), errors.describe(exc))
            return crec, ref
        verdict = _compare(case, out, ref, kw)
        crec["metrics"] = dict(verdict.metrics)
        if not verdict.ok:
            fail(errors.WRONG_RESULT, verdict.why)
            return crec, ref
        if case.graph and target.is_cuda:
            crec["graph"] = check_graph(case, ours, kw, seed, target)
            if crec["graph"]["status"] == record.FAIL:
                fail(crec["graph"]["class"], "under CUDA-graph replay: " + crec["graph"]["error"])
        elif case.graph:
            crec["graph"] = {"status": record.SKIP, "why": "no CUDA graphs on the CPU interpreter"}
        return crec, ref
    finally:
        crec["seconds"] = round(time.monotonic() - t0, 3)
        _release(target)


def check_graph(case: Case, ours: Callable[[Any], Any], kw: Dict[str, Any], seed: int, target: Target) -> Dict[str, Any]:
    """Capture one call the way SGLang does (warm-up on a side stream, then capture) and replay it twice
    on fresh inputs copied into the captured buffers; each replay must match its own reference."""
    import torch

    res: Dict[str, Any] = {"status": record.PASS, "replays": 0, "class": None, "error": None}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ours(kw)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ours(kw)
        torch.cuda.synchronize()
    except Exception as exc:
        return dict(res, status=record.FAIL, error=f"capture: {errors.describe(exc)}", **{"class": errors.classify(exc)})
    for r in (1, 2):
        try:
            _refill(kw, case.make_inputs(seed + r))
            ref = case.reference(kw)
            torch.cuda.synchronize()
        except Exception as exc:
            return dict(res, status=record.FAIL, error=f"fresh inputs: {errors.describe(exc)}",
                        **{"class": errors.HARNESS_ERROR})
        try:
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:
            return dict(res, status=record.FAIL, error=f"replay {r}: {errors.describe(exc)}",
                        **{"class": errors.classify(exc)})
        verdict = _compare(case, out, ref, kw)
        res["replays"] = r
        if not verdict.ok:
            return dict(res, status=record.FAIL, error=f"replay {r}: {verdict.why}", **{"class": errors.WRONG_RESULT})
    del graph
    return res


def _upstream_pass(name: str, checked: List[Any], opts: Options, rec: Dict[str, Any]) -> str:
    """Upstream's function on the cases that have one; returns a one-line summary for the patch."""
    ran, bad = 0, []
    for case, crec, seed, ref in checked:
        if case.upstream is None:
            crec["upstream"] = {"status": record.SKIP, "why": case.upstream_skip or "not run at this size"}
            continue
        _running(rec, opts, name, f"{case.name} (upstream)")
        crec["upstream"] = check_upstream(case, seed, ref, opts.target)
        lost = crec["upstream"].pop("context_lost", False)
        record.write(opts.json_path, rec)
        ran += 1
        if crec["upstream"]["status"] == record.FAIL:
            bad.append(f"{case.name}: {crec['upstream']['error']}")
        if lost:
            rec["context_lost"] = True
            return f"upstream broke the CUDA context at {case.name}: {crec['upstream']['error']}"
    if not ran:
        why = next((c.upstream_skip for c, *_ in checked if c.upstream_skip), "no case has it")
        return f"upstream not run: {why}"
    if bad:
        return f"upstream fails {len(bad)} of {ran} case(s) on this device: {bad[0]}"
    return f"upstream agrees with the reference on {ran} case(s)"


def check_upstream(case: Case, seed: int, ref: Any, target: Target) -> Dict[str, Any]:
    res: Dict[str, Any] = {"status": record.PASS, "class": None, "error": None, "metrics": {}, "context_lost": False}
    t0 = time.monotonic()
    try:
        kw = case.make_inputs(seed)
        if ref is None:
            ref = case.reference(kw)
        assert case.upstream is not None
        out = case.upstream(kw)
        _sync(target)
        verdict = _compare(case, out, ref, kw)
        res["metrics"] = dict(verdict.metrics)
        if not verdict.ok:
            res.update(status=record.FAIL, error=verdict.why, **{"class": errors.WRONG_RESULT})
    except Exception as exc:
        res.update(status=record.FAIL, error=errors.describe(exc), **{"class": errors.classify(exc)})
        res["context_lost"] = _context_lost(target)
    finally:
        res["seconds"] = round(time.monotonic() - t0, 3)
        _release(target)
    return res


def _compare(case: Case, out: Any, ref: Any, kw: Dict[str, Any]) -> Any:
    from v4flash_kernels.selfcheck.case import Comparison

    try:
        return case.compare(out, ref, kw)
    except Exception as exc:  # wrong shape / dtype / type: the result is not what the contract says
        return Comparison(False, {}, f"the result cannot be compared with the reference: {errors.describe(exc)}")


def _refill(kw: Dict[str, Any], fresh: Dict[str, Any]) -> None:
    import torch

    for k, v in kw.items():
        new = fresh.get(k)
        if torch.is_tensor(v) and new is not v:
            if not torch.is_tensor(new) or new.shape != v.shape or new.dtype != v.dtype:
                raise ValueError(f"input {k!r} changed shape or dtype between seeds (the case cannot be replayed)")
            v.copy_(new)


def _running(rec: Dict[str, Any], opts: Options, patch: str, case: str) -> None:
    rec["running"] = {"patch": patch, "case": case, "since": time.time()}
    record.write(opts.json_path, rec)


def _sync(target: Target) -> None:
    if target.is_cuda:
        import torch

        torch.cuda.synchronize()


def _release(target: Target) -> None:
    if target.is_cuda:
        import torch

        try:
            torch.cuda.empty_cache()
        except Exception:
            pass


def _context_lost(target: Target) -> bool:
    """True when the CUDA context no longer runs anything (a sticky error): only a new process helps."""
    if not target.is_cuda:
        return False
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device=target.device).add_(1).item()
        return False
    except Exception:
        return True


def device_info(target: Target) -> Dict[str, Any]:
    """What ran the check: the GPU (as torch sees it), torch/triton/CUDA versions, the Triton cache."""
    import os

    info: Dict[str, Any] = {"device": target.device,
                            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "triton_cache_dir": _triton_cache_dir()}
    try:
        import torch
        import triton

        info.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
        if target.is_cuda:
            p = torch.cuda.get_device_properties(torch.device(target.device))
            info.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                        memory_gib=round(p.total_memory / 2**30, 1), uuid=str(getattr(p, "uuid", "")) or None)
        else:
            info.update(name="CPU (Triton interpreter)", capability=None)
    except Exception as exc:  # reported, and the cases will fail on their own with the real error
        info["error"] = errors.describe(exc)
    return info


def _triton_cache_dir() -> str | None:
    import os

    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:
        return os.environ.get("TRITON_CACHE_DIR")
