"""The hook against the real pinned sglang 0.5.13.post1 wheel, each scenario in a fresh interpreter."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from hookenv import BOOT_MODULES, HEAVY, build_hook_env, sglang_overlay

from v4flash_kernels import __version__ as OURS_VERSION
from v4flash_kernels.attention import reference as R
from v4flash_kernels.kit.compare import rel_err

PINNED = "0.5.13.post1"
OURS = "v4flash_kernels.attention.op.sparse_mla_decode"
UPSTREAM = "sglang.srt.layers.attention.flash_mla_sm120_triton.flash_mla_sparse_decode_triton"


def test_wheel_ships_pth_at_root(hook_wheel):
    with zipfile.ZipFile(hook_wheel) as z:
        names = set(z.namelist())
        assert "v4flash_kernels_hook.pth" in names, sorted(n for n in names if "/" not in n)
        pth = z.read("v4flash_kernels_hook.pth").decode()
    assert {"v4flash_kernels/hook/hook.py", "v4flash_kernels/hook/hook_boot.py", "v4flash_kernels/attention/op.py"} <= names
    lines = [ln for ln in pth.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines == ["import v4flash_kernels.hook.hook_boot; v4flash_kernels.hook.hook_boot.boot()"]


def test_interpreter_start_loads_only_the_finder(hook_env):
    code = (  # snapshot sys.modules before the snippet imports json itself
        "import sys; mods = sorted(sys.modules); finder = type(sys.meta_path[0]).__name__\n"
        "import json; print(json.dumps({'mods': mods, 'finder': finder}))"
    )
    p = hook_env.python_c(code)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["finder"] == "SglangKernelFinder"
    ours = {m for m in res["mods"] if m.startswith("v4flash")}
    assert ours == BOOT_MODULES
    heavy = [m for m in res["mods"] if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY))]
    assert heavy == [], f"the .pth imported heavy modules at interpreter start: {heavy}"
    assert p.stderr == ""


def test_import_gives_our_function_logs_once_and_records(hook_env, tmp_path):
    run = hook_env.run("identity", env={"V4FLASH_PATCH_STATUS_DIR": str(tmp_path / "st")})
    assert run.rc == 0, run.stderr
    res = run.result
    assert res["is_ours"] and res["fn"] == OURS
    assert res["booted"] is True
    st = res["status"]["patches"]["sparse_decode"]
    assert st["active"] is True and st["decided"] is True
    assert st["sglang_version"] == PINNED and res["status"]["ours_version"] == OURS_VERSION
    assert len(run.hook_lines) == 1, run.stderr
    line = run.hook_lines[0]
    assert "WARNING" not in line
    for part in ("ACTIVE", UPSTREAM, OURS, f"sglang {PINNED}", f"v4flash-kernels {OURS_VERSION}"):
        assert part in line, line
    rec = json.loads((tmp_path / "st" / f"patch-{res['pid']}.json").read_text())
    sd = rec["patches"]["sparse_decode"]
    assert sd["active"] is True and rec["pid"] == res["pid"] and sd["sglang_version"] == PINNED
    assert [p.name for p in (tmp_path / "st").iterdir()] == [f"patch-{res['pid']}.json"]


def test_switch_off_leaves_sglang_untouched(hook_env, tmp_path):
    run = hook_env.run("identity", env={"V4FLASH_SPARSE_DECODE": "0", "V4FLASH_PATCH_STATUS_DIR": str(tmp_path)})
    assert run.rc == 0, run.stderr
    assert not run.result["is_ours"] and run.result["fn"] == UPSTREAM
    st = run.result["status"]["patches"]["sparse_decode"]
    assert st["active"] is False and "V4FLASH_SPARSE_DECODE=0" in st["reason"]
    assert len(run.hook_lines) == 1 and "WARNING" not in run.hook_lines[0]
    rec = json.loads((tmp_path / f"patch-{run.result['pid']}.json").read_text())
    assert rec["patches"]["sparse_decode"]["active"] is False and rec["patches"]["sparse_decode"]["switch"] == "0"


def test_sglang_torch_backend_is_flagged(hook_env):
    run = hook_env.run("identity", env={"SGLANG_SM120_TRITON_FLASHMLA": "0"})
    assert run.rc == 0, run.stderr
    assert run.result["is_ours"] and run.result["status"]["patches"]["sparse_decode"]["sglang_sm120_triton_flashmla"] == "0"
    assert len(run.hook_lines) == 1
    assert "WARNING" in run.hook_lines[0] and "SGLANG_SM120_TRITON_FLASHMLA=0" in run.hook_lines[0]


def test_unrecognised_switch_value_refuses_and_warns(hook_env):
    run = hook_env.run("identity", env={"V4FLASH_SPARSE_DECODE": "maybe"})
    assert run.rc == 0, run.stderr
    assert run.result["fn"] == UPSTREAM and run.result["status"]["patches"]["sparse_decode"]["active"] is False
    assert len(run.hook_lines) == 1 and "WARNING" in run.hook_lines[0] and "'maybe'" in run.hook_lines[0]


@pytest.mark.parametrize("switch,rc,active", [("1", 0, True), ("0", 0, False), ("maybe", 1, False)])
def test_status_cli_reports_this_interpreter(hook_env, switch, rc, active):
    p = hook_env.python_args("-m", "v4flash_kernels.hook.hook", env={"V4FLASH_SPARSE_DECODE": switch})
    assert p.returncode == rc, p.stderr
    out = json.loads(p.stdout)
    st = out["patches"]["sparse_decode"]
    assert st["active"] is active and st["decided"] is True and out["hook_booted_by_pth"] is True
    assert st["sglang_version"] == PINNED


@pytest.mark.parametrize("mode", ["late-boot", "late-apply"])
def test_module_imported_before_the_hook_is_patched(hook_env, mode):
    run = hook_env.run(mode, flags=("-S",))  # -S: the .pth does not run at start
    assert run.rc == 0, run.stderr
    res = run.result
    assert res["before"] == "sglang.srt.layers.attention.flash_mla_sm120_triton"
    assert res["is_ours"] and res["status"]["patches"]["sparse_decode"]["active"] is True
    assert len(run.hook_lines) == 1 and "ACTIVE" in run.hook_lines[0]


def test_spawned_child_gets_the_patch(hook_env, tmp_path):
    run = hook_env.run("spawn", env={"V4FLASH_PATCH_STATUS_DIR": str(tmp_path)})
    assert run.rc == 0, run.stderr
    res = run.result
    assert res["parent_imported_sglang"] is False
    child = res["child"]
    assert "error" not in child, child
    assert child["pid"] != res["parent_pid"]
    assert child["is_ours"] and child["booted"] and child["status"]["patches"]["sparse_decode"]["active"] is True
    assert [p.name for p in tmp_path.iterdir()] == [f"patch-{child['pid']}.json"]
    assert len(run.hook_lines) == 1 and f"[pid {child['pid']}]" in run.hook_lines[0]


# ------------------------------------------------------------------ SGLang's dispatcher, both ways


def _dispatch(env, tmp_path, switch: str, seed: int, batch: int, heads: int, extra: str):
    out = tmp_path / f"dispatch-{switch}.pt"
    run = env.run("dispatch", str(seed), str(out), str(batch), str(heads), extra,
                  env={"TRITON_INTERPRET": "1", "V4FLASH_SPARSE_DECODE": switch}, timeout=600)
    assert run.rc == 0, run.stderr[-4000:]
    return run, torch.load(out, weights_only=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_equivalence(hook_env, tmp_path, seed, batch, heads, extra):
    on, res_on = _dispatch(hook_env, tmp_path, "1", seed, batch, heads, extra)
    off, res_off = _dispatch(hook_env, tmp_path, "0", seed, batch, heads, extra)
    assert on.result["entered"] == ["ours"] and on.result["status"]["patches"]["sparse_decode"]["active"] is True
    assert off.result["entered"] == ["upstream"] and off.result["status"]["patches"]["sparse_decode"]["active"] is False
    kw = res_on["kw"]
    for k, v in res_off["kw"].items():  # same seed -> the same inputs in both interpreters
        if isinstance(v, torch.Tensor):
            assert torch.equal(_bits(v), _bits(kw[k])), k
    ref_out, ref_lse = R.sparse_mla_decode_ref(**kw)
    ours, up = (res_on["out"], res_on["lse"]), (res_off["out"], res_off["lse"])
    for name, (o, lse) in (("ours", ours), ("upstream", up)):
        assert o.shape == ref_out.shape and o.dtype == torch.bfloat16, name
        assert lse.shape == ref_lse.shape and lse.dtype == torch.float32, name
        assert rel_err(o, ref_out) < 1e-2, (name, rel_err(o, ref_out))
        assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=1e-4), name
    # upstream's own kernel as the oracle for ours
    assert rel_err(ours[0], up[0].double()) < 1e-2
    assert torch.allclose(ours[1], up[1], atol=1e-3, rtol=1e-4)
    return ours, up


@pytest.mark.slow  # ~30 s: both kernels under the Triton interpreter
def test_dispatcher_runs_ours_on_and_upstream_off_and_they_agree(hook_env, tmp_path):
    # B=3 has a full row, a short row and an empty row; c4-like extra cache, sink on; H=8 (TP8).
    ours, up = _check_equivalence(hook_env, tmp_path, seed=7, batch=3, heads=8, extra="c4")
    assert not torch.equal(ours[0], torch.zeros_like(ours[0]))


@pytest.mark.slow
@pytest.mark.parametrize("extra,heads", [("none", 64), ("c128", 16)])
def test_dispatcher_equivalence_more_shapes(hook_env, tmp_path, extra, heads):
    _check_equivalence(hook_env, tmp_path, seed=11, batch=2, heads=heads, extra=extra)


# ------------------------------------------------------------------ refusing: other sglang


def test_other_sglang_version_no_patch_one_warning_sglang_works(tmp_path, hook_wheel, sglang_layer):
    overlay = sglang_overlay(tmp_path / "overlay", sglang_layer, version="0.5.99")
    env = build_hook_env(tmp_path / "venv", hook_wheel, sglang_layer, overlay)
    st_dir = tmp_path / "st"
    out = tmp_path / "o.pt"
    run = env.run("dispatch", "3", str(out), "1", "2", "c4",
                  env={"TRITON_INTERPRET": "1", "V4FLASH_PATCH_STATUS_DIR": str(st_dir)}, timeout=600)
    assert run.rc == 0, run.stderr[-4000:]
    assert run.result["entered"] == ["upstream"]
    st = run.result["status"]["patches"]["sparse_decode"]
    assert st["active"] is False and st["sglang_version"] == "0.5.99"
    assert len(run.hook_lines) == 1, run.stderr
    line = run.hook_lines[0]
    assert "WARNING" in line and "NOT applied" in line
    assert "0.5.99" in line and PINNED in line and f"v4flash-kernels {OURS_VERSION}" in line
    res = torch.load(out, weights_only=False)
    ref_out, _ = R.sparse_mla_decode_ref(**res["kw"])
    assert rel_err(res["out"], ref_out) < 1e-2  # SGLang's own path still computes correctly
    rec = json.loads((st_dir / f"patch-{run.result['pid']}.json").read_text())
    assert rec["patches"]["sparse_decode"]["active"] is False and "0.5.99" in rec["patches"]["sparse_decode"]["reason"]


def test_changed_upstream_signature_no_patch_one_warning(tmp_path, hook_wheel, sglang_layer):
    rel = "sglang/srt/layers/attention/flash_mla_sm120_triton.py"
    old = "    extra_topk_length: Optional[torch.Tensor] = None,\n) -> Tuple[torch.Tensor, torch.Tensor]:"
    new = ("    extra_topk_length: Optional[torch.Tensor] = None,\n    out: Optional[torch.Tensor] = None,\n"
           ") -> Tuple[torch.Tensor, torch.Tensor]:")
    overlay = sglang_overlay(tmp_path / "overlay", sglang_layer, edit=(rel, old, new))
    env = build_hook_env(tmp_path / "venv", hook_wheel, sglang_layer, overlay)
    run = env.run("identity")
    assert run.rc == 0, run.stderr
    assert run.result["fn"] == UPSTREAM and not run.result["is_ours"]
    assert run.result["status"]["patches"]["sparse_decode"]["active"] is False
    assert len(run.hook_lines) == 1, run.stderr
    line = run.hook_lines[0]
    assert "WARNING" in line and "signature differs" in line and "out=None" in line
    assert PINNED in line and OURS_VERSION in line
