"""The kernel self-check on CPU under Triton's interpreter (small shapes): the real patches pass,
deliberately broken kernels fail with the right class, and the CLI's exit codes and errors.

The broken kernels are real Triton kernels (a miscompiled one that computes wrong numbers, one
that does not compile) behind the same protocol as the ops' own `selfcheck.py`, registered as
modules for the runner; the injection seam (`V4FLASH_SELFCHECK_INJECT`) is checked on a real patch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from v4flash_kernels.hook.patches import SWITCHES
from v4flash_kernels.selfcheck import errors, inject, record
from v4flash_kernels.selfcheck.case import SMALL, Case, Comparison, Target, check_rows
from v4flash_kernels.selfcheck.runner import Options, registry_modules, run

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU self-check tests run under the interpreter"),
    # the interpreter computes masked-off lanes of the poisoned heads too (numpy overflow); the kernel never uses them
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

CPU = Target(device="cpu", small_only=True, tp_size=4, tp_rank=1)
ROOT = Path(__file__).resolve().parents[2]


def _opts(patches, modules=None, tmp: Path | None = None, **kw) -> Options:
    mods = modules if modules is not None else registry_modules(tuple(patches))
    return Options(target=CPU, patches=tuple(patches), modules=mods,
                   json_path=str(tmp / "rec.json") if tmp else None, log=lambda _m: None, **kw)


# ------------------------------------------------------------------ the real patches


# One process per patch here; a check that spans a worker's GPUs (scope "group": the all-reduce) runs as
# several meeting processes, in tests/kernels/test_allreduce_cpu.py (interpreter) and _gpu.py (H200).
CHECKED = [s.name for s in SWITCHES if s.selfcheck and s.scope == "gpu"]


def test_switches_name_importable_selfchecks():
    """sparse_decode, moe and indexer have one; any switch that names one names a real module (a switch
    without one is reported `unchecked` by the launcher, never passed)."""
    assert {"sparse_decode", "moe", "indexer"} <= set(CHECKED)
    for sw in SWITCHES:
        if sw.selfcheck:
            assert callable(__import__(sw.selfcheck, fromlist=["cases"]).cases), sw.name


@pytest.mark.parametrize("patch", CHECKED)
def test_real_patch_passes_under_the_interpreter(patch, tmp_path):
    rec = run(_opts([patch], tmp=tmp_path))
    entry = rec["patches"][patch]
    assert entry["status"] == record.PASS, entry
    assert entry["cases"] and all(c["status"] == record.PASS for c in entry["cases"])
    assert all(c["metrics"] for c in entry["cases"]), "a passing case must say what it measured"
    on_disk = json.loads((tmp_path / "rec.json").read_text())
    assert on_disk["schema"] == record.SCHEMA and on_disk["done"] and on_disk["interpreter"]
    assert on_disk["patches"][patch]["status"] == record.PASS


def test_indexer_upstream_runs_on_cpu_and_agrees():
    """Upstream's indexer is torch: it runs under the interpreter too, and must agree with fp64."""
    rec = run(_opts(["indexer"]))
    ups = [c["upstream"] for c in rec["patches"]["indexer"]["cases"]]
    assert ups and all(u["status"] == record.PASS for u in ups), ups
    assert "agrees" in rec["patches"]["indexer"]["upstream"]


def test_production_cases_follow_the_target():
    """Without running them: B=1 and the largest batch per kind, a prefill chunk, graphs on the largest
    decode call, upstream only where it is affordable."""
    from v4flash_kernels.attention import selfcheck as att
    from v4flash_kernels.indexer import selfcheck as idx
    from v4flash_kernels.moe import selfcheck as moe

    t = Target(device="cpu", batches=(1, 32), prefill_rows=8192, context=131072, tp_size=4, tp_rank=2)
    names = [c.name for c in att.cases(t)]
    for kind in ("swa", "c4", "c128"):
        assert f"decode {kind} B=1" in names and f"decode {kind} B=32" in names and f"prefill {kind} T=8192" in names
    graphs = {c.name for c in att.cases(t) if c.graph}
    assert graphs == {"decode c4 B=1", "decode c4 B=32"}
    assert {c.name for c in att.cases(t) if c.upstream is not None and c.size != SMALL} == {
        "decode swa B=1", "decode c4 B=1", "decode c128 B=1"}
    m = {c.name: c for c in moe.cases(t)}
    assert m["decode M=32"].graph and not m["decode M=1"].graph and "prefill M=8192" in m
    assert m["decode M=1"].upstream is not None and m["decode M=32"].upstream is None
    i = {c.name: c for c in idx.cases(t)}
    assert i["decode B=32 context 131072"].graph and "prefill T=8192" in i
    assert all(c.size == SMALL for c in att.cases(CPU) + moe.cases(CPU) + idx.cases(CPU))


def test_production_inputs_keep_shapes_across_seeds():
    """A captured graph is replayed on inputs of another seed copied into its buffers: same shapes,
    different data; the heads this GPU does not own are poisoned."""
    from v4flash_kernels.attention.selfcheck import production_inputs
    from v4flash_kernels.indexer.selfcheck import decode_inputs

    a, b = (production_inputs("c4", 5, 512, (16, 32), s, "cpu") for s in (1, 2))
    assert {k: tuple(v.shape) for k, v in a.items() if torch.is_tensor(v)} == {
        k: tuple(v.shape) for k, v in b.items() if torch.is_tensor(v)}
    assert not torch.equal(a["q"][:, :, 16:32], b["q"][:, :, 16:32])
    assert torch.isnan(a["q"][:, :, 0].float()).all() and torch.isfinite(a["q"][:, :, 16:32].float()).all()
    assert int(a["topk_length"][2]) == 0 and bool((a["indices"][2] == -1).all())
    x, y = (decode_inputs(4, 8, s, "cpu") for s in (1, 2))
    assert x["page_table"].shape == y["page_table"].shape and int(x["seq_lens"][0]) == 8 * 64
    assert int(x["seq_lens"][-1]) == 1 and bool((x["page_table"][-1] == 0).all())


def test_check_rows():
    assert check_rows(5) == [0, 1, 2, 3, 4]
    rows = check_rows(8192, 16)
    assert len(rows) == 16 and rows[:3] == [0, 1, 2] and 8191 in rows and rows == sorted(set(rows))


# ------------------------------------------------------------------ deliberately broken kernels


@triton.jit
def _double(X, Y, N, BLOCK: tl.constexpr, BROKEN: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m)
    y = 2.0 * x
    if BROKEN:  # what a miscompile looks like from outside: some lanes wrong, no error raised
        y = tl.where(offs % 7 == 3, y + 1.0, y)
    tl.store(Y + offs, y, mask=m)


@triton.jit
def _uncompilable(X, BLOCK: tl.constexpr):
    tl.static_assert(BLOCK < 0, "deliberately uncompilable")
    tl.store(X, 1.0)


def _launch(broken: bool):
    def ours(kw):
        y = torch.empty_like(kw["x"])
        _double[(1,)](kw["x"], y, kw["x"].numel(), BLOCK=64, BROKEN=broken)
        return y
    return ours


def _uncompilable_ours(kw):
    _uncompilable[(1,)](kw["x"], BLOCK=16)
    return kw["x"]


def _raising(kw):
    raise ValueError("ours rejected the call")


def _wrong_shape(kw):
    return kw["x"][:3]


def _cases_of(ours, reference=None):
    def cases(target):
        def inputs(seed):
            g = torch.Generator().manual_seed(seed)
            return {"x": torch.randn(40, generator=g)}

        def ref(kw):
            return 2.0 * kw["x"].double()

        def compare(out, r, kw):
            err = float((out.double() - r).abs().max() / r.abs().max())
            return Comparison(err <= 1e-6, {"rel_err": err}, f"rel. error {err:.3g} > 1e-06")

        return [Case("x2 N=40", SMALL, inputs, ours, reference or ref, compare)]
    return cases


def _bad_reference(kw):
    raise RuntimeError("reference blew up")


FAKE = {
    "good": _cases_of(_launch(False)),
    "miscompiled": _cases_of(_launch(True)),
    "uncompilable": _cases_of(_uncompilable_ours),
    "raising": _cases_of(_raising),
    "wrong_shape": _cases_of(_wrong_shape),
    "bad_reference": _cases_of(_launch(False), _bad_reference),
}


@pytest.fixture
def fake_modules(monkeypatch):
    mods = {}
    for name, cases in FAKE.items():
        mod = types.ModuleType(f"_v4flash_test_selfcheck_{name}")
        mod.cases = cases
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        mods[name] = mod.__name__
    return mods


@pytest.mark.parametrize("name, status, cls", [
    ("good", "pass", None),
    ("miscompiled", "fail", errors.WRONG_RESULT),
    ("uncompilable", "fail", errors.COMPILE_ERROR),
    ("raising", "fail", errors.EXCEPTION),
    ("wrong_shape", "fail", errors.WRONG_RESULT),
    ("bad_reference", "fail", errors.HARNESS_ERROR),
])
def test_broken_kernels_fail_with_their_class(fake_modules, name, status, cls, tmp_path):
    rec = run(_opts([name], {name: fake_modules[name]}, tmp_path))
    entry = rec["patches"][name]
    assert entry["status"] == status, entry
    assert entry["class"] == cls
    if status == "fail":
        assert entry["error"].startswith("x2 N=40: "), entry["error"]
    assert json.loads((tmp_path / "rec.json").read_text())["patches"][name]["status"] == status


def test_one_broken_patch_leaves_the_others_alone(fake_modules):
    names = ["good", "miscompiled", "good2"]
    mods = {"good": fake_modules["good"], "miscompiled": fake_modules["miscompiled"], "good2": fake_modules["good"]}
    rec = run(_opts(names, mods))
    assert [rec["patches"][n]["status"] for n in names] == ["pass", "fail", "pass"]
    assert rec["done"] and not rec["context_lost"]


def test_patch_without_selfcheck_is_unchecked_not_passed():
    rec = run(_opts(["nothing"], {"nothing": None}))
    assert rec["patches"]["nothing"]["status"] == record.UNCHECKED


def test_a_module_that_cannot_build_its_cases_fails():
    rec = run(_opts(["gone"], {"gone": "v4flash_kernels.no_such_module_for_selfcheck"}))
    assert rec["patches"]["gone"]["status"] == "fail"
    assert "building its cases" in rec["patches"]["gone"]["error"]


# ------------------------------------------------------------------ injection seam


@pytest.mark.parametrize("kind, cls", [("wrong", errors.WRONG_RESULT), ("compile", errors.COMPILE_ERROR),
                                       ("resource", errors.RESOURCE_ERROR), ("launch", errors.LAUNCH_ERROR)])
def test_injected_failure_on_a_real_patch(kind, cls):
    rec = run(_opts(["indexer"], inject={"indexer": kind}))
    entry = rec["patches"]["indexer"]
    assert entry["status"] == "fail" and entry["class"] == cls and entry["injected"] == kind, entry


def test_inject_grammar():
    assert inject.parse("moe:wrong, indexer:compile@5") == {"moe": "wrong", "indexer": "compile"}
    assert inject.parse("moe:wrong,indexer:compile@5", gpu=4) == {"moe": "wrong"}
    assert inject.parse("indexer:compile@5", gpu=5) == {"indexer": "compile"}
    for bad in ("moe", "moe:melt", ":wrong", "moe:wrong@x"):
        with pytest.raises(ValueError, match="PATCH:KIND"):
            inject.parse(bad)


def test_classify():
    from triton.runtime.errors import OutOfResources

    cases = [
        (OutOfResources(1, 0, "shared memory"), errors.RESOURCE_ERROR),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), errors.RESOURCE_ERROR),
        (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), errors.LAUNCH_ERROR),
        (RuntimeError("CUDA error: misaligned address"), errors.LAUNCH_ERROR),
        (RuntimeError("PassManager::run failed"), errors.COMPILE_ERROR),
        (ValueError("q must be [B, 1, H, 512]"), errors.EXCEPTION),
    ]
    for exc, cls in cases:
        assert errors.classify(exc) == cls, exc


# ------------------------------------------------------------------ the CLI


def _cli(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("V4FLASH_SELFCHECK")}
    e["PYTHONPATH"] = f"{ROOT / 'kernels'}:{ROOT / 'launcher'}"
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "v4flash_kernels.selfcheck", *args], capture_output=True,
                          text=True, env=e, timeout=300)


def test_cli_pass_and_injected_failure(tmp_path):
    ok = _cli("--device", "cpu", "--patches", "indexer", "--gpu", "3", "--json", str(tmp_path / "a.json"))
    assert ok.returncode == 0, ok.stderr
    rec = json.loads((tmp_path / "a.json").read_text())
    assert rec["gpu"] == 3 and rec["patches"]["indexer"]["status"] == "pass"
    bad = _cli("--device", "cpu", "--patches", "indexer", "--gpu", "3", env={inject.ENV: "indexer:wrong@3"})
    assert bad.returncode == 1 and "wrong_result" in bad.stdout
    other = _cli("--device", "cpu", "--patches", "indexer", "--gpu", "2", env={inject.ENV: "indexer:wrong@3"})
    assert other.returncode == 0, "an injection for GPU 3 must not touch GPU 2"


@pytest.mark.parametrize("args, env, words", [
    (["--patches", "nope"], None, "unknown kernel switch"),
    (["--batches", "0"], None, "below 1"),
    (["--batches", "x"], None, "not an integer"),
    (["--tp-size", "4", "--tp-rank", "4"], None, "not below --tp-size"),
    (["--context", "131072,262144"], None, "one integer each"),
    (["--context", "100"], None, "below 256"),
    ([], {inject.ENV: "moe:melt"}, "PATCH:KIND"),
])
def test_cli_bad_input_is_one_error_and_fix(args, env, words):
    res = _cli("--device", "cpu", *args, env=env)
    assert res.returncode == 2, res
    assert res.stderr.startswith("error: ") and "\nfix: " in res.stderr and words in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_without_a_gpu_says_so():
    res = _cli("--patches", "indexer")
    assert res.returncode == 2 and "no CUDA GPU" in res.stderr and "Traceback" not in res.stderr
