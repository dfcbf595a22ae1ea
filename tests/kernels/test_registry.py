"""The patch registry names each op folder's whole contract, and the hubs find every op through it.

Adding a kernel patch is one op folder + one registry entry + its test files (docs/architecture.md has
the checklist); these tests fail when a switch lacks any piece: its self-check, its compile list, its
step-bench builders, the folder's files, or the CPU and GPU test files.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from v4flash_bench.step import model as M
from v4flash_bench.step import ops as step_ops
from v4flash_kernels import check_sm120
from v4flash_kernels.hook.patches import PATCHES, SWITCHES, by_name, patches_of

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "kernels" / "v4flash_kernels"



def _folder(switch) -> str:
    """The op folder of a switch: where its compile list lives (`v4flash_kernels.<folder>.compile`)."""
    parts = (switch.compile or "").split(".")
    assert len(parts) == 3 and parts[0] == "v4flash_kernels" and parts[2] == "compile", (switch.name, switch.compile)
    return parts[1]


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: s.name)
def test_every_switch_names_its_three_contract_modules(switch):
    assert switch.compile, f"{switch.name}: no compile list (Switch.compile)"
    assert switch.step, f"{switch.name}: no step-bench builders (Switch.step)"
    assert switch.selfcheck, f"{switch.name}: no self-check (Switch.selfcheck)"


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: s.name)
def test_each_contract_module_is_the_op_folders_and_has_its_entry_point(switch):
    folder = _folder(switch)
    assert callable(importlib.import_module(switch.compile).binaries)
    assert switch.step == f"v4flash_bench.step.ops.{folder}"
    assert callable(importlib.import_module(switch.step).build)
    if switch.selfcheck is not None:
        assert switch.selfcheck == f"v4flash_kernels.{folder}.selfcheck"
        assert callable(importlib.import_module(switch.selfcheck).cases)
    # the folder holds the kernel, its host side and its fp64 reference, and every patch of the switch
    # puts a function of this folder into SGLang
    for name in ("__init__.py", "kernel.py", "op.py", "reference.py", "compile.py"):
        assert (KERNELS / folder / name).is_file(), f"{folder}/{name} missing"
    for spec in patches_of(switch.name):
        assert spec.ours_module.startswith(f"v4flash_kernels.{folder}."), spec.name


@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: s.name)
def test_each_op_folder_has_its_cpu_and_gpu_tests(switch):
    folder = _folder(switch)
    for kind in ("cpu", "gpu"):
        assert (REPO / "tests" / "kernels" / f"test_{folder}_{kind}.py").is_file(), f"test_{folder}_{kind}.py missing"


def test_the_op_folders_are_exactly_the_switches():
    """No op folder outside the registry (it would be in no hub) and no switch without a folder."""
    not_ops = {"hook", "kit", "selfcheck", "__pycache__"}
    folders = {p.name for p in KERNELS.iterdir() if p.is_dir() and p.name not in not_ops}
    assert folders == {_folder(s) for s in SWITCHES}


def test_check_sm120_compiles_every_switchs_list_and_names_no_op():
    assert check_sm120.compile_lists() == [s.compile for s in SWITCHES]
    text = (KERNELS / "check_sm120.py").read_text()
    for switch in SWITCHES:
        assert f"v4flash_kernels.{_folder(switch)}" not in text, switch.name


def test_the_step_bench_reaches_every_patched_op_through_the_registry():
    # switches off by default are composed when opted in (`--opt-in`), so they are reached too
    off = tuple(s.name for s in SWITCHES if not s.default_on)
    specs = (M.decode_specs([1, 64], [128 * 1024], 8192, 16, opt_in=off) + M.prefill_specs([1024], 16)
             + M.verify_specs([16], [2], 128 * 1024, 8192, 16))
    used = {op.patch for op in M.unique_ops(specs).values() if op.patch is not None}
    # every op's patch is a registry patch (no second vocabulary) whose switch names the builders
    assert used <= {p.name for p in PATCHES}
    for patch in used:
        assert step_ops.builder_module(patch) == next(s.step for s in SWITCHES if s.name == by_name(patch).switch)
    # every switch whose kernels the step times is reached (the all-reduce is an estimate on one GPU)
    assert {by_name(p).switch for p in used} == {s.name for s in SWITCHES} - {"allreduce"}
    hub = (REPO / "kernels" / "v4flash_bench" / "step" / "ops" / "__init__.py").read_text()
    for switch in SWITCHES:
        assert f"ops.{_folder(switch)}" not in hub, switch.name
