"""The hook's pure policy (no sglang needed): switch parsing, signature comparison, the decision."""

from __future__ import annotations

import inspect

import pytest

from v4flash_kernels.hook import hook


def upstream_like(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                  extra_k_cache=None, extra_indices=None, extra_topk_length=None):
    return None


T = object  # any annotation: the comparison must look at names, kinds and defaults only


def same_annotated(q: T, k_cache: T, indices: T, topk_length: T | None, attn_sink: T | None,
                   head_dim_v: int, softmax_scale: float, extra_k_cache: T | None = None,
                   extra_indices: T | None = None, extra_topk_length: T | None = None) -> tuple:
    return ()


def extra_param(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                extra_k_cache=None, extra_indices=None, extra_topk_length=None, out=None):
    return None


def other_default(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale=None,
                  extra_k_cache=None, extra_indices=None, extra_topk_length=None):
    return None


def renamed(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
            extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None):
    return None


def varargs(*args, **kwargs):
    return None


@pytest.mark.parametrize("value,expected", [
    (None, True), ("", True), ("1", True), ("on", True), ("TRUE", True), (" yes ", True),
    ("0", False), ("off", False), ("False", False), ("no", False),
    ("2", None), ("maybe", None),
])
def test_parse_switch(value, expected):
    assert hook.parse_switch(value) is expected


def test_signature_equal_ignores_annotations():
    assert hook.signature_mismatch(upstream_like, same_annotated) is None


@pytest.mark.parametrize("fn,needle", [
    (extra_param, "out=None"),
    (other_default, "softmax_scale=None"),
    (renamed, "extra_indices_in_kvcache=None"),
    (varargs, "*args"),
])
def test_signature_differences_are_named(fn, needle):
    diff = hook.signature_mismatch(upstream_like, fn)
    assert diff is not None and needle in diff


def test_our_kernel_has_upstreams_signature():
    """Upstream's parameter list as of 0.5.13.post1, spelled out: a drift in ours must show here."""
    from v4flash_kernels.attention.op import sparse_mla_decode

    assert hook.signature_mismatch(upstream_like, sparse_mla_decode) is None
    n = len(hook.signature_params(upstream_like))
    assert hook.signature_params(sparse_mla_decode)[:n] == hook.signature_params(upstream_like)
    assert inspect.signature(sparse_mla_decode).parameters["extra_indices"].default is None


def _decide(**over):
    args = {"switch": None, "sglang_version": hook.PINNED_SGLANG, "upstream": upstream_like, "ours": same_annotated,
                "ours_error": None}
    args.update(over)
    return hook.decide(**args)


def test_decide_patches_only_when_everything_matches():
    d = _decide()
    assert d.active and not d.warn and d.sglang_version == hook.PINNED_SGLANG


@pytest.mark.parametrize("over,warn,needle", [
    ({"switch": "0"}, False, "disabled by V4FLASH_SPARSE_DECODE=0"),
    ({"switch": "off"}, False, "disabled"),
    ({"switch": "bogus"}, True, "'bogus'"),
    ({"sglang_version": "0.5.23"}, True, "0.5.23 is not the pinned 0.5.13.post1"),
    ({"sglang_version": None}, True, "None is not the pinned"),
    ({"upstream": None}, True, "not found"),
    ({"ours": None, "ours_error": "ImportError: no triton"}, True, "no triton"),
    ({"ours": extra_param}, True, "signature differs"),
])
def test_decide_refuses(over, warn, needle):
    d = _decide(**over)
    assert not d.active
    assert d.warn is warn
    assert needle in d.reason


def test_version_is_checked_before_the_signature():
    d = _decide(sglang_version="0.6.0", ours=extra_param)
    assert "0.6.0" in d.reason and "signature" not in d.reason


def test_status_before_any_decision_is_inactive():
    st = hook.status()
    assert st["pinned_sglang_version"] == hook.PINNED_SGLANG
    assert set(st["patches"]) == {p.name for p in hook.PATCHES}
    sd = st["patches"]["sparse_decode"]
    assert sd["active"] is False and sd["decided"] is False
    assert sd["ours_function"] == "v4flash_kernels.attention.op.sparse_mla_decode"


def kw_only_extra(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                  extra_k_cache=None, extra_indices=None, extra_topk_length=None, *, head_range=None):
    return None


def kw_only_required(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                     extra_k_cache=None, extra_indices=None, extra_topk_length=None, *, head_range):
    return None


def test_ours_may_add_keyword_only_options_with_defaults_only():
    assert hook.signature_mismatch(upstream_like, kw_only_extra) is None
    assert hook.signature_mismatch(upstream_like, kw_only_required) is not None
    assert hook.signature_mismatch(upstream_like, extra_param) is not None  # positional extra: refused


def test_boot_finder_watches_exactly_the_registry_modules():
    from v4flash_kernels.hook import hook_boot, patches

    assert hook_boot.TARGET_MODULES == {p.target_module for p in patches.PATCHES}
    assert len({p.name for p in patches.PATCHES}) == len(patches.PATCHES)
    assert len({s.name for s in patches.SWITCHES}) == len(patches.SWITCHES)
    # every patch belongs to a known switch, every switch turns at least one patch on or off
    assert {p.switch for p in patches.PATCHES} == {s.name for s in patches.SWITCHES}
    for s in patches.SWITCHES:
        assert s.env == "V4FLASH_" + s.name.upper() and s.help.endswith(".") and s.title


def test_the_launcher_switches_are_the_registry():
    """One table: the launcher's flags, config keys and worker env come from the kernels' registry."""
    from v4flash_kernels.hook import patches
    from v4flash_pd.cli import options
    from v4flash_pd.config.keys import DEFAULTS, PATCH_SWITCHES

    assert PATCH_SWITCHES == tuple((s.name, s.env) for s in patches.SWITCHES)
    assert set(DEFAULTS["patches"]) == {s.name for s in patches.SWITCHES}
    import click

    @click.command()
    @options.config_options
    def probe(**kw):  # pragma: no cover - only its params are read
        pass

    flags = {o for p in probe.params for o in p.opts}
    assert {s.flag for s in patches.SWITCHES} <= flags


def test_reasons_name_the_patch_switch():
    from v4flash_kernels.hook.patches import PatchSpec

    spec = PatchSpec("x", "x", "x", "sglang.m", "f", "v4flash_kernels.attention.op", "sparse_mla_decode")
    d = hook.decide("off", hook.PINNED_SGLANG, upstream_like, same_annotated, None, spec=spec)
    assert not d.active and "V4FLASH_X=off" in d.reason


# ------------------------------------------------------------------ process state, in a fresh interpreter

_FAKE_SGLANG = r'''
import json, sys, types
from v4flash_kernels.hook import hook
from v4flash_kernels.attention.op import sparse_mla_decode as ours

def flash_mla_sparse_decode_triton(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                                   extra_k_cache=None, extra_indices=None, extra_topk_length=None):
    return "upstream"

mod = types.ModuleType(hook.TARGET_MODULE)
mod.flash_mla_sparse_decode_triton = flash_mla_sparse_decode_triton
sys.modules[hook.TARGET_MODULE] = mod
holder = types.ModuleType("sglang.fake_holder")  # did `from ... import flash_mla_sparse_decode_triton`
holder.flash_mla_sparse_decode_triton = flash_mla_sparse_decode_triton
sys.modules["sglang.fake_holder"] = holder
hook._sglang_version = lambda: hook.PINNED_SGLANG  # no sglang dist-info in .venv

def installed():
    """What the patch put in (ours, or the registry adapter's wrapper of ours)."""
    return hook._installed.get("sparse_decode")
'''


def _fresh(code: str, env_extra: dict | None = None) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("V4FLASH_", "SGLANG_"))}
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-c", _FAKE_SGLANG + code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["stderr"] = p.stderr
    return out


def test_apply_patches_module_and_from_imports_then_status_tracks_reality():
    res = _fresh(r'''
st = hook.apply()["patches"]["sparse_decode"]
patched = mod.flash_mla_sparse_decode_triton is installed() and holder.flash_mla_sparse_decode_triton is installed()
patched = patched and installed() is not None
mod.flash_mla_sparse_decode_triton = flash_mla_sparse_decode_triton  # someone undoes it later
print(json.dumps({"st": st, "patched": patched, "after": hook.patch_status("sparse_decode")["active"]}))
''')
    assert res["patched"] and res["st"]["active"] is True
    assert res["after"] is False  # status reports the attribute's truth, not just the decision


def test_failure_while_patching_rolls_back_and_warns():
    res = _fresh(r'''
real_patch = hook._patch
def failing(spec, module):
    real_patch(spec, module)
    raise RuntimeError("boom")
hook._patch = failing
st = hook.apply()["patches"]["sparse_decode"]
print(json.dumps({"st": st, "fn": mod.flash_mla_sparse_decode_triton(*[None] * 7),
                  "holder": holder.flash_mla_sparse_decode_triton is installed(), "built": installed() is not None}))
''')
    assert res["fn"] == "upstream" and res["holder"] is False and res["built"] is True
    assert res["st"]["active"] is False and "hook error: RuntimeError: boom" in res["st"]["reason"]
    lines = [ln for ln in res["stderr"].splitlines() if ln.startswith("[v4flash-kernels]")]
    assert len(lines) == 1 and "WARNING" in lines[0] and "boom" in lines[0]


def test_lazy_module_getattr_elsewhere_in_sglang_is_not_triggered():
    res = _fresh(r'''
lazy = types.ModuleType("sglang.lazy_thing")
def _ga(name):
    raise RuntimeError("lazy import triggered: " + name)
lazy.__getattr__ = _ga
sys.modules["sglang.lazy_thing"] = lazy
st = hook.apply()["patches"]["sparse_decode"]
print(json.dumps({"st": st}))
''')
    assert res["st"]["active"] is True, res["st"]["reason"]


def test_unwritable_status_dir_warns_but_still_patches(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    res = _fresh(r'''
st = hook.apply()["patches"]["sparse_decode"]
print(json.dumps({"st": st, "ours": mod.flash_mla_sparse_decode_triton is installed()}))
''', {"V4FLASH_PATCH_STATUS_DIR": str(blocker / "sub")})
    assert res["ours"] and res["st"]["active"] is True
    assert "cannot write patch status" in res["stderr"]


def test_adapter_output_is_installed_and_status_tracks_it():
    res = _fresh(r"""
import dataclasses
from v4flash_kernels.hook import patches
def adapter(fn):
    def wrapped(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                extra_k_cache=None, extra_indices=None, extra_topk_length=None):
        return "adapted"
    return wrapped
sys.modules["fake_adapter_mod"] = types.ModuleType("fake_adapter_mod")
sys.modules["fake_adapter_mod"].adapter = adapter
spec = dataclasses.replace(patches.SPARSE_DECODE, adapter="fake_adapter_mod:adapter")
hook.PATCHES = (spec,)
hook.SPARSE_DECODE = spec
hook.by_name = lambda name: spec
st = hook.apply()["patches"]["sparse_decode"]
print(json.dumps({"st": st, "out": mod.flash_mla_sparse_decode_triton(*[None] * 7),
                  "holder": holder.flash_mla_sparse_decode_triton(*[None] * 7)}))
""")
    assert res["st"]["active"] is True and res["out"] == "adapted" and res["holder"] == "adapted"


def test_one_failing_patch_leaves_the_others_applied():
    res = _fresh(r"""
from v4flash_kernels.hook import patches
other_mod = types.ModuleType("sglang.other_target")
def other_fn(x):
    return "other-upstream"
other_mod.other_fn = other_fn
sys.modules["sglang.other_target"] = other_mod
# a registered switch (the hook reads its default from the registry); signature differs: refused
broken = patches.PatchSpec("other", "other", "topk", "sglang.other_target", "other_fn",
                           "v4flash_kernels.attention.op", "sparse_mla_decode")
hook.PATCHES = (patches.SPARSE_DECODE, broken)
specs = {s.name: s for s in hook.PATCHES}
hook.by_name = lambda name: specs[name]
st = hook.apply()["patches"]
print(json.dumps({"st": st, "sd": mod.flash_mla_sparse_decode_triton is installed(), "other": other_mod.other_fn(1)}))
""")
    assert res["sd"] is True and res["st"]["sparse_decode"]["active"] is True
    assert res["other"] == "other-upstream" and res["st"]["other"]["active"] is False
    assert "signature differs" in res["st"]["other"]["reason"]
    warns = [ln for ln in res["stderr"].splitlines() if "WARNING" in ln]
    assert len(warns) == 1 and "other patch NOT applied" in warns[0]


def test_a_class_attribute_target_is_patched_and_rolled_back_with_its_wrapper():
    """"Cls.method" targets (e.g. a quant method's weight-loading step): a method, a staticmethod."""
    res = _fresh(r"""
from v4flash_kernels.hook import patches
cls_mod = types.ModuleType("sglang.cls_target")
class Method:
    def forward(self, x, y=2):
        return "upstream-method"
    @staticmethod
    def helper(x):
        return "upstream-static"
cls_mod.Method = Method
sys.modules["sglang.cls_target"] = cls_mod
ours_mod = types.ModuleType("v4flash_fake_ours")
def forward(self, x, y=2):
    return "ours-method"
def helper(x):
    return "ours-static"
def bad_helper(x, extra):
    return "never"
ours_mod.forward, ours_mod.helper, ours_mod.bad_helper = forward, helper, bad_helper
sys.modules["v4flash_fake_ours"] = ours_mod
m = patches.PatchSpec("m", "m", "sparse_decode", "sglang.cls_target", "Method.forward", "v4flash_fake_ours", "forward")
s = patches.PatchSpec("s", "s", "sparse_decode", "sglang.cls_target", "Method.helper", "v4flash_fake_ours", "helper")
hook.PATCHES = (m, s)
specs = {p.name: p for p in hook.PATCHES}
hook.by_name = lambda name: specs[name]
st = hook.apply()["patches"]
obj = Method()
out = {"st": st, "call": obj.forward(1), "static": Method.helper(1), "inst_static": obj.helper(1),
       "is_static": isinstance(Method.__dict__["helper"], staticmethod)}
hook._rollback(m, cls_mod)
hook._rollback(s, cls_mod)
out.update({"back": obj.forward(1), "back_static": Method.helper(1),
            "still_static": isinstance(Method.__dict__["helper"], staticmethod),
            "after": hook.patch_status("m")["active"]})
print(json.dumps(out))
""")
    assert res["st"]["m"]["active"] is True and res["st"]["s"]["active"] is True, res["st"]
    assert res["call"] == "ours-method" and res["static"] == "ours-static" and res["inst_static"] == "ours-static"
    assert res["is_static"] and res["still_static"]
    assert res["back"] == "upstream-method" and res["back_static"] == "upstream-static"
    assert res["after"] is False


def test_a_missing_class_target_is_refused_not_raised():
    res = _fresh(r"""
from v4flash_kernels.hook import patches
cls_mod = types.ModuleType("sglang.cls_target2")
sys.modules["sglang.cls_target2"] = cls_mod
m = patches.PatchSpec("m", "m", "sparse_decode", "sglang.cls_target2", "Gone.forward",
                      "v4flash_kernels.attention.op", "sparse_mla_decode")
hook.PATCHES = (m,)
hook.by_name = lambda name: m
print(json.dumps({"st": hook.apply()["patches"]}))
""")
    assert res["st"]["m"]["active"] is False and "not found" in res["st"]["m"]["reason"]
