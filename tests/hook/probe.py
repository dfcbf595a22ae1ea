"""Runs inside the hook test venvs (a fresh interpreter per call) and reports JSON on stdout.

Kept free of pytest so each scenario is a real interpreter start: the .pth runs, SGLang is imported
the way a TP worker imports it, and nothing from the test process leaks in.

    probe.py identity            import SGLang's module, report which function it now holds
    probe.py late-boot|late-apply  (run with -S) import SGLang first, then install/apply the hook
    probe.py dispatch SEED OUT   call SGLang's dispatcher on random real-layout inputs, save to OUT
    probe.py spawn               report `identity` from a multiprocessing spawn child
"""

from __future__ import annotations

import json
import os
import sys

TARGET = "sglang.srt.layers.attention.flash_mla_sm120_triton"
DISPATCHER = "sglang.srt.layers.attention.flash_mla_sm120"
ENTRIES = {  # (file suffix, function name) -> who
    ("v4flash_kernels/attention/op.py", "sparse_mla_decode"): "ours",
    ("layers/attention/flash_mla_sm120_triton.py", "flash_mla_sparse_decode_triton"): "upstream",
}


def identity() -> dict:
    import importlib

    mod = importlib.import_module(TARGET)
    fn = mod.flash_mla_sparse_decode_triton
    adapter = fn if hasattr(fn, "v4flash_ours") else None  # a patch adapter (tp_heads) wrapping ours
    fn = getattr(fn, "v4flash_ours", fn)
    from v4flash_kernels.hook import hook

    return {
        "pid": os.getpid(),
        "fn": f"{fn.__module__}.{fn.__qualname__}",
        "is_ours": fn is importlib.import_module("v4flash_kernels.attention.op").sparse_mla_decode,
        "adapter": f"{adapter.__module__}.{adapter.__qualname__}" if adapter else None,
        "status": hook.status(),
        "booted": sys.modules["v4flash_kernels.hook.hook_boot"].booted,
    }


def _interpreter_shims() -> None:
    """TRITON_INTERPRET=1 only: what the CPU interpreter needs to run both kernels.

    - numpy >= 2.4 refuses `int()` of a 1-element array, which Triton 3.6's interpreter uses for
      `__index__` of loaded scalars (`v4flash_kernels.interpreter.fix_index`, as tests/kernels/conftest.py);
    - upstream's `@triton.autotune` benchmarks its configs through a GPU driver the interpreter
      lacks: report equal timings so its first config (BLOCK_T=16) runs; the math is unchanged.
    """
    from triton.runtime import autotuner as _a

    from v4flash_kernels.interpreter import fix_index

    fix_index()
    _a.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]


def dispatch(seed: int, out_path: str, batch: int, heads: int, extra: str) -> dict:
    """SGLang's own entry point on the same inputs the parent rebuilds; records whose code ran."""
    import importlib

    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter_shims()
    from v4flash_kernels.attention import reference as R

    extra_cfg: dict = {
        "none": {},
        "c4": {"extra_width": 64, "extra_page_size": 64},
        "c128": {"extra_width": 64, "extra_page_size": 2, "extra_dense": True, "ctx_tokens": 40},
    }[extra]
    case = R.Case(batch=batch, heads=heads, width=128, page_size=256, **extra_cfg)
    kw = R.make_inputs(case, seed=seed)
    call_kw = dict(kw)
    if "extra_indices" in call_kw:  # the dispatcher's keyword is SGLang's backend's
        call_kw["extra_indices_in_kvcache"] = call_kw.pop("extra_indices")
    disp = importlib.import_module(DISPATCHER)

    entered: list[str] = []

    def prof(frame, event, arg):  # first of the two entry points wins, then stop profiling
        if event == "call":
            code = frame.f_code
            for (suffix, name), who in ENTRIES.items():
                if code.co_name == name and code.co_filename.replace(os.sep, "/").endswith(suffix):
                    entered.append(who)
                    sys.setprofile(None)

    sys.setprofile(prof)
    try:
        out, lse = disp.flash_mla_with_kvcache_sm120(**call_kw)
    finally:
        sys.setprofile(None)
    torch.save({"kw": kw, "out": out, "lse": lse}, out_path)
    return {"pid": os.getpid(), "entered": entered, "status": _status()}


def _status() -> dict:
    from v4flash_kernels.hook import hook

    return hook.status()


def _child(q) -> None:  # runs in the spawned interpreter
    try:
        q.put(identity())
    except BaseException as exc:  # report instead of hanging the parent
        q.put({"error": f"{type(exc).__name__}: {exc}"})


def spawn() -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        child = q.get(timeout=120)
    finally:
        p.join(timeout=60)
    return {"parent_pid": os.getpid(), "parent_imported_sglang": "sglang" in sys.modules, "child": child}


def late(mode: str) -> dict:
    """Run with `python -S`: the .pth did not run, so SGLang's module loads unpatched first."""
    import importlib

    sys.path[:0] = [p for p in os.environ["PROBE_PATHS"].split(os.pathsep) if p]
    mod = importlib.import_module(TARGET)
    before = mod.flash_mla_sparse_decode_triton.__module__
    if mode == "late-boot":
        import v4flash_kernels.hook.hook_boot as boot

        boot.boot()
    else:
        from v4flash_kernels.hook import hook

        hook.apply()
    res = identity()
    res["before"] = before
    return res


def main(argv: list[str]) -> None:
    cmd = argv[0]
    if cmd == "identity":
        res = identity()
    elif cmd in ("late-boot", "late-apply"):
        res = late(cmd)
    elif cmd == "dispatch":
        seed, out_path = int(argv[1]), argv[2]
        batch, heads, extra = int(argv[3]), int(argv[4]), argv[5]
        res = dispatch(seed, out_path, batch, heads, extra)
    elif cmd == "spawn":
        res = spawn()
    else:
        raise SystemExit(f"unknown probe command {cmd!r}")
    print("PROBE-JSON " + json.dumps(res, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
