"""CPU tests of the step bench's plan: layer counts, bytes/FLOPs per op from the shapes, floors,
composition arithmetic, the report with stand-in timings, and the CLI's --dry-run / bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from v4flash_bench.step import model as M
from v4flash_bench.step import ops as O
from v4flash_bench.step import report as R
from v4flash_bench.step import runner
from v4flash_bench.step.__main__ import main
from v4flash_bench.step.ops import attention as ops_attention
from v4flash_bench.step.ops import common
from v4flash_bench.step.ops import indexer as ops_indexer
from v4flash_bench.step.ops import mhc as ops_mhc
from v4flash_bench.step.ops import moe as ops_moe
from v4flash_kernels.hook import patches

REPO = Path(__file__).resolve().parents[2]
K, MIB = 1024, 1 << 20


def _by_name(ops, name, variant=None):
    """The op of that name (on that path: a `variant` or `path` row)."""
    hits = [o for o in ops if o.name == name and (variant is None or variant in (o.p.get("variant"), o.p.get("path")))]
    assert len(hits) == 1, (name, [o.name for o in ops])
    return hits[0]


def test_layer_counts_match_the_config():
    assert M.layer_counts() == {"window": 2, "c4": 21, "c128": 20, "all": 43}
    kinds = M.layer_kinds()
    assert kinds[:2] == ("window", "window") and kinds[2:4] == ("c4", "c128") and kinds[-1] == "c4"


def test_decode_op_counts_per_step():
    ops = M.decode_ops(M.StepSpec("decode", 16, 128 * K, 8 * K))
    assert _by_name(ops, "sparse-MLA attention (window)", "upstream").count == 2
    assert _by_name(ops, "sparse-MLA attention (c4)", "patched").count == 21
    assert _by_name(ops, "sparse-MLA attention (c128)", "upstream").count == 20
    assert _by_name(ops, "routed MoE (MXFP4)").count == 43
    assert _by_name(ops, "indexer logits (c4)").count == 21
    assert _by_name(ops, "indexer top-512").count == 21
    assert _by_name(ops, "compressor c128 wkv_gate (bf16->fp32)").count == 20
    assert _by_name(ops, "wq_b (FP8)").count == 43
    assert _by_name(ops, "lm_head (bf16, vocab/TP)").count == 1
    # each path runs each attention kind once
    for path in ("upstream", "patched"):
        names = [o.name for o in M.ops_for_path(ops, path)]
        assert len(names) == len(set(names))


def test_fp8_gemm_bytes_and_flops_from_shapes():
    op = _by_name(M.decode_ops(M.StepSpec("decode", 1, 128 * K, 8 * K)), "wqkv_a (FP8)")
    # N = q_lora 1024 + head 512, K = 4096: fp8 weights + 12 x 32 fp32 block scales + bf16 x in + bf16 out
    assert op.bytes == 1536 * 4096 + 12 * 32 * 4 + 4096 * 2 + 1536 * 2
    assert op.flops == 2 * 1536 * 4096
    wq_b = _by_name(M.decode_ops(M.StepSpec("decode", 1, 128 * K, 8 * K)), "wq_b (FP8)")
    # 16 local heads x 512 at TP4, on both paths by default; with the fused q path opted in, at decode rows
    # only upstream's path runs it alone (the patched path fuses it with the q norm + RoPE: `QNORM_ROPE_NAME`)
    assert wq_b.p == {"m": 1, "n": 16 * 512, "k": 1024}
    fused = M.StepSpec("decode", 1, 128 * K, 8 * K, opt_in=("qnorm_rope",))
    assert _by_name(M.decode_ops(fused), "wq_b (FP8)").p == {"m": 1, "n": 16 * 512, "k": 1024, "path": "upstream"}


def test_bf16_ops_bytes():
    ops = M.decode_ops(M.StepSpec("decode", 1, 128 * K, 8 * K))
    wo_a = _by_name(ops, "wo_a einsum (bf16)")
    assert wo_a.bytes == 2 * (1024 * 4096 * 2 + 4096 * 2 + 1024 * 2)  # 2 local groups
    lm = _by_name(ops, "lm_head (bf16, vocab/TP)")
    assert lm.bytes == 32320 * 4096 * 2 + 4096 * 2 + 32320 * 2
    comp = _by_name(ops, "compressor c4 wkv_gate (bf16->fp32)")
    assert comp.bytes == 2048 * 4096 * 2 + 4096 * 2 + 2048 * 4  # fp32 out


def test_moe_bytes_follow_distinct_experts():
    assert M.moe_expert_bytes() == 1024 * 4096 // 2 + 4096 * 512 // 2 + (1024 * 128 + 4096 * 16) * 4
    assert M.expected_distinct_experts(1) == pytest.approx(6.0)
    assert M.expected_distinct_experts(16) == pytest.approx(81.0, abs=0.5)  # 256 (1 - (1 - 6/256)^16)
    assert M.expected_distinct_experts(8192) == pytest.approx(256.0, abs=1e-6)
    op = M.moe_op(1, 43)
    assert op.bytes == round(6 * M.moe_expert_bytes()) + 4096 * 4 + 6 * 8
    assert op.flops == 2 * 6 * (1024 * 4096 + 4096 * 512)


def test_attention_and_indexer_bytes():
    ops = M.decode_ops(M.StepSpec("decode", 1, 1 * MIB, 8 * K, heads_patched=16))
    c4 = _by_name(ops, "sparse-MLA attention (c4)", "upstream")
    assert c4.bytes == (128 + 512) * (584 + 4) + 2 * 16 * 512 * 2  # window + top-512, 16 needed heads
    c128 = _by_name(ops, "sparse-MLA attention (c128)", "patched")
    assert c128.p["width_extra"] == MIB // 128 and c128.p["valid_extra"] == 8 * K // 128 and c128.p["heads"] == 16
    idx = _by_name(ops, "indexer logits (c4)")
    # valid keys of 8K/4 positions, q + weights, and the full configured-width fp32 logits
    assert idx.bytes == 2048 * 132 + 64 * 132 + (MIB // 4) * 4
    topk = _by_name(ops, "indexer top-512")
    assert topk.p == {"rows": 1, "width": MIB // 4, "valid": 2048}  # reads only the row's c4 length
    assert topk.bytes == 2048 * 4 + 512 * 4


def test_prefill_shares_the_request_cache():
    ops = M.prefill_ops(M.StepSpec("prefill", 1024, 1024, 1024))
    win = _by_name(ops, "sparse-MLA attention (window)", "upstream")
    total = sum(min(t + 1, 128) for t in range(1024))
    assert win.bytes == 1024 * 584 + 4 * total + 2 * 1024 * 16 * 512 * 2
    assert win.flops == 4 * 16 * total * 512
    idx = _by_name(ops, "indexer logits (c4)")
    assert idx.p["configured_ctx"] == 1024 and idx.bytes == 256 * 132 + 1024 * 64 * 132 + 1024 * 256 * 4
    assert _by_name(ops, "lm_head (bf16, vocab/TP)").p["m"] == 1
    with pytest.raises(ValueError):
        M.prefill_ops(M.StepSpec("prefill", 11674, 11674, 11674))


def test_floors_bytes_or_flops_bound():
    rtx = M.RTX6000
    small = M.fp8_gemm("x", 1, 8192, 1024, 1)
    assert small.floor_us(rtx) == pytest.approx(small.bytes / 1.792e12 * 1e6)
    big = M.fp8_gemm("x", 8192, 8192, 1024, 1)
    assert big.floor_us(rtx) == pytest.approx(2 * 8192 * 8192 * 1024 / rtx.fp8_flops * 1e6)
    unknown = M.machine_for("Some GPU", 1e12)
    assert unknown.floor_us(big.bytes, big.flops, True) == pytest.approx(big.bytes / 1e12 * 1e6)
    assert M.machine_for("NVIDIA H200", 4.3e12).bf16_flops == 989e12


def test_step_floor_is_the_documented_order():
    ops = M.decode_ops(M.StepSpec("decode", 1, 128 * K, 8 * K))
    floor_ms = sum(o.floor_us(M.RTX6000) * o.count for o in M.ops_for_path(ops, "patched")) / 1e3
    assert 2.0 < floor_ms < 2.8  # ~2.4 ms: ~4.3 GB of weights and cache per step at 1.792 TB/s
    ops16 = M.decode_ops(M.StepSpec("decode", 16, 128 * K, 8 * K))
    floor16 = sum(o.floor_us(M.RTX6000) * o.count for o in M.ops_for_path(ops16, "patched")) / 1e3
    assert 8.0 < floor16 < 11.0  # ~9.5 ms at B=16


def test_only_the_all_reduce_is_estimated():
    est = M.estimates("decode", 1)
    assert [e.name for e in est] == ["NCCL all-reduce over PCIe (TP4)"]
    ar = est[0]
    assert ar.count == 87 and ar.us_per_call == pytest.approx(13.9)  # 8 KB over NCCL at TP4
    assert all(e.source.startswith("estimate") for e in est)


def test_allreduce_estimates_tp2_custom_tp4_nccl():
    assert M.allreduce_us(8192, 4) == (13.9, "NCCL")
    assert M.allreduce_us(8192, 2)[0] == 6.4 and "custom" in M.allreduce_us(8192, 2)[1]
    assert M.allreduce_us(24576, 4)[0] == pytest.approx((14.7 + 15.6) / 2)  # interpolated between 16 and 32 KB
    # past 64 KB: + 2(n-1)/n x the extra bytes at the assumed bus bandwidth
    msg = 64 * 4096 * 2
    assert M.allreduce_us(msg, 4)[0] == pytest.approx(71.2 + 1.5 * (msg - 65536) / 20e9 * 1e6)
    assert M.allreduce_us(msg, 2)[0] == pytest.approx(11.8 + 1.0 * (msg - 65536) / 25e9 * 1e6)
    # SGLang's custom all-reduce stops at 8 MiB: a prefill chunk's all-reduce at TP2 goes through NCCL
    assert M.allreduce_us(8192 * 4096 * 2, 2)[1] == "NCCL"
    assert M.estimates("decode", 1, 2)[0].name == "SGLang custom all-reduce over PCIe (TP2)"


def _fake_times(spec, ours_for=()):
    """1 µs per upstream call, 0.5 µs for the ops whose patch is listed in `ours_for`."""
    us, src = {}, {}
    for op in M.step_ops(spec):
        for path in ("upstream", "patched"):
            v = op.p.get("variant")
            if v is not None and v != path:
                continue
            patched = path == "patched" and (op.patch in ours_for)
            us[(op.key, path)] = 0.5 if patched else 1.0
            src[(op.key, path)] = "ours" if patched else "no patch yet"
    return us, src


def test_compose_arithmetic():
    spec = M.StepSpec("decode", 16, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    us, src = _fake_times(spec, ours_for=("moe",))
    gpu = M.machine_for("NVIDIA H200", 4.3e12)
    up = M.compose(spec, "upstream", ops, us, src, gpu)
    pa = M.compose(spec, "patched", ops, us, src, gpu)
    calls = sum(o.count for o in M.ops_for_path(ops, "upstream"))
    calls_pa = sum(o.count for o in M.ops_for_path(ops, "patched"))
    assert up.timed_ms == pytest.approx(calls * 1.0 / 1e3)
    assert pa.timed_ms == pytest.approx((calls_pa - 43 * 0.5) / 1e3)  # MoE at half the time on 43 layers
    # the patched path's fused mHC: per layer 2 boundaries instead of 2 pre + 2 post + 2 RMSNorms, but for
    # the first layer's pre and norm and the last layer's post; and each compressor one fused row instead
    # of its GEMM row and its compress + store row (c4 and the indexer's on 21 layers, c128 on 20). The
    # fused q path is off by default: opted in, it saves one more call per layer (wq_b + the q norm + RoPE)
    assert calls - calls_pa == (86 + 86 + 87) - (1 + 1 + 85 + 2) + (21 + 20 + 21)
    opted = M.step_ops(dataclasses.replace(spec, opt_in=("qnorm_rope",)))
    assert sum(o.count for o in M.ops_for_path(opted, "patched")) == calls_pa - 43
    assert up.total_ms == pytest.approx(up.timed_ms + up.estimate_ms)
    assert up.tok_s() == pytest.approx(16 / (up.total_ms / 1e3))
    moe = [ln for ln in pa.lines if ln.group == "moe"][0]
    assert moe.source == "ours" and moe.ms_step == pytest.approx(43 * 0.5 / 1e3)
    assert pa.floor_rtx_ms > pa.floor_gpu_ms > 0


def test_compose_needs_every_op_timed():
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    us, src = _fake_times(spec)
    us.pop(next(iter(us)))
    with pytest.raises(KeyError):
        M.compose(spec, "upstream", ops, us, src, M.RTX6000)


def test_report_tables_render():
    gpu = M.machine_for("NVIDIA H200", 4.3e12)
    pairs = []
    for spec in (M.StepSpec("decode", 1, MIB, 8 * K), M.StepSpec("prefill", 1024, 1024, 1024)):
        ops = M.step_ops(spec)
        us, src = _fake_times(spec, ours_for=("moe", "indexer", "sparse_decode"))
        pairs.append((M.compose(spec, "upstream", ops, us, src, gpu), M.compose(spec, "patched", ops, us, src, gpu)))
    text = R.summary_table(pairs, md=False)
    assert "decode B=1 C=1M L=8K" in text and "prefill T=1024" in text
    md = R.composition_table(*pairs[0], gpu, md=True)
    assert md.startswith("| op |") and "routed MoE (MXFP4)" in md and "(estimate)" in md and "tok/s" in md
    assert "TTFT" in R.composition_table(*pairs[1], gpu, md=False)


def test_path_times_prefers_ours_and_falls_back():
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    meas = {}
    for op in ops:
        for impl in runner.impls_for(op):
            err = "no patch yet" if (impl == "ours" and op.patch == "indexer") else None
            meas[(op.key, impl)] = runner.Measurement(op.key, impl, op.name, 2.0 if impl == "ours" else 3.0, 1, 1,
                                                      True, 0.0, "", impl, err)
    us, src = runner.path_times(ops, meas)
    moe = _by_name(ops, "routed MoE (MXFP4)")
    idx = _by_name(ops, "indexer logits (c4)")
    assert us[(moe.key, "patched")] == 2.0 and us[(moe.key, "upstream")] == 3.0
    assert us[(idx.key, "patched")] == 3.0 and "no patch yet" in src[(idx.key, "patched")]
    att = _by_name(ops, "sparse-MLA attention (c4)", "patched")
    assert us[(att.key, "patched")] == 2.0
    assert runner.all_ok(meas)


def test_dry_run_prints_the_plan_without_torch():
    code = ("import sys; from v4flash_bench.step.__main__ import main; rc = main(['--dry-run']); "
            "assert 'torch' not in sys.modules, 'dry run imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO / "kernels"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    for needle in ("decode B=1 C=128K L=8K", "decode B=64 C=1M L=8K", "prefill T=8192", "routed MoE (MXFP4)",
                   "indexer logits (c4)", "lm_head", "estimate: NCCL all-reduce", "distinct shapes to time"):
        assert needle in out.stdout, needle


def test_bad_input_is_one_error_and_fix(capsys):
    assert main(["--batches", "1,x", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "\nfix: " in err and "Traceback" not in err
    assert main(["--prefill", "16K", "--dry-run"]) == 2
    assert "11673" in capsys.readouterr().err
    assert main(["--batches", "0", "--dry-run"]) == 2


def _pd(argv, capsys):
    from v4flash_pd.cli.main import main as pd_main

    with pytest.raises(SystemExit) as exc:
        pd_main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


def test_launcher_bench_step_without_gpu_is_an_error_with_a_fix(monkeypatch, capsys):
    from v4flash_pd.cli import cmd_bench

    monkeypatch.setattr(cmd_bench.shutil, "which", lambda name: None)  # as on a host without a driver
    code, text = _pd(["bench", "--step"], capsys)
    assert code == 1 and "error: no NVIDIA GPU" in text and "fix:" in text and "Traceback" not in text


def test_launcher_bench_step_passes_options_through(capsys):
    code, text = _pd(["bench", "--step", "--step-args", "--dry-run --batches 1,x"], capsys)
    assert code == 2 and "refused" in text and "'x' is not a number" not in text  # the child printed that
    ok = subprocess.run([sys.executable, "-c", "from v4flash_pd.cli.main import main; main()", "bench", "--step",
                         "--step-args", "--dry-run --batches 1 --contexts 1M --prefill ''"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "decode B=1 C=1M L=8K" in ok.stdout and "prefill T=" not in ok.stdout


def test_from_json_recomposes_a_finished_run(tmp_path, capsys):

    run = _run_json(tmp_path, M.decode_specs([1], [128 * K], 8 * K, 64), {"heads_patched": 64, "opt_in": ""})
    md = tmp_path / "out.md"
    args = ["--batches", "1", "--contexts", "128K", "--prefill", "", "--from-json", str(run), "--md", str(md)]
    assert main(args) == 0
    text = md.read_text()
    assert "| decode B=1 C=128K L=8K |" in text and "routed MoE (MXFP4)" in text
    # 10 µs per upstream call, 5 µs for our attention/MoE/indexer: the patched timed total is smaller
    line = [ln for ln in text.splitlines() if ln.startswith("| decode B=1")][0].split("|")
    assert float(line[2]) > float(line[3])
    assert main(["--batches", "16", "--contexts", "128K", "--prefill", "", "--from-json", str(run)]) == 2
    assert "no measurement" in capsys.readouterr().err
    code = ("import sys; from v4flash_bench.step.__main__ import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 're-rendering imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO / "kernels"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


def _cpu_ops(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    return O


def _wheel_or_skip():
    from v4flash_kernels import upstream

    if upstream.find_wheel() is None:
        pytest.skip("pinned sglang wheel not present (make venv fetches it)")


def _small_indexer_op():
    return M.indexer_op(3, 1024, 150, 1, "idx-test",
                        (("actual_ctx", 600), ("configured_ctx", 4096), ("prefill", False), ("rows", 3)))


def test_indexer_check_passes_for_upstream_and_catches_a_wrong_kernel(monkeypatch):
    ops = _cpu_ops(monkeypatch)
    _wheel_or_skip()
    op = _small_indexer_op()
    assert ops.build(op, "upstream", 1 << 20, 3).check().ok  # the wheel's torch function vs our fp64 reference
    up = ops_indexer.upstream_indexer().fp8_paged_mqa_logits_torch_sm120

    def off_by_5pct(*args):
        return up(*args) * 1.05

    monkeypatch.setattr(common, "patch_function", lambda kind: (off_by_5pct, "ours: broken"))
    m = runner.measure_one(op, "ours", 1 << 20, 3)  # a mismatch is reported before any timing (no GPU needed)
    assert not m.ok and m.error.startswith("MISMATCH") and m.us != m.us
    assert not runner.all_ok({(op.key, "ours"): m})


def test_missing_patch_is_no_patch_yet_not_a_failure(monkeypatch):
    _cpu_ops(monkeypatch)
    gone = dataclasses.replace(patches.INDEXER, ours_module="v4flash_kernels.no_such_module")
    monkeypatch.setattr(patches, "PATCHES", tuple(gone if p is patches.INDEXER else p for p in patches.PATCHES))
    m = runner.measure_one(_small_indexer_op(), "ours", 1 << 20, 3)
    assert m.ok and m.error == "no patch yet" and m.us != m.us


def test_gemm_and_topk_checks_on_cpu(monkeypatch):
    ops = _cpu_ops(monkeypatch)
    for op in (M.bf16_gemm("x", 3, 64, 256, 1), M.bf16_gemm("x", 3, 64, 256, 1, out_fp32=True),
               M.bf16_gemm("x", 3, 64, 256, 1, groups=2), M.topk_op(3, 4096, 1, 1000),
               M.topk_op(3, 256, 1, 256)):
        prep = ops.build(op, "upstream", 1 << 20, 5)
        assert prep.check().ok, op.key
    assert common.rotations(8 << 20, 60 << 20) == 16 and common.rotations(300 << 20, 60 << 20) == 1


def test_moe_reference_matches_a_hand_dequant(monkeypatch):
    _cpu_ops(monkeypatch)
    import torch

    # one byte 0x2F: low nibble 0xF = -6.0 (even k), high nibble 0x2 = 1.0 (odd k); scale 2^-1 per 32
    packed = torch.full((1, 16), 0x2F, dtype=torch.uint8).view(torch.int8)
    deq = ops_moe.mxfp4_dequant(packed, torch.full((1, 1), 0.5))
    assert deq.shape == (1, 32) and deq[0, 0].item() == -3.0 and deq[0, 1].item() == 0.5


# ---------------------------------------------------------------- mHC (step 1)


def test_mhc_ops_counts_bytes_and_fallback():
    ops = M.decode_ops(M.StepSpec("decode", 16, 128 * K, 8 * K))
    pre = _by_name(ops, M.MHC_PRE_NAME, "upstream")
    post = _by_name(ops, M.MHC_POST_NAME, "upstream")
    assert pre.count == post.count == 86  # a pre and a post around attention and around the MoE of 43 layers
    # residual 4 x 4096 bf16 per row + the 24 x 16384 fp32 hc_fn + y out + post/comb mixes (4 + 16 fp32)
    assert pre.bytes == 16 * 4 * 4096 * 2 + 24 * 16384 * 4 + 16 * 4096 * 2 + 16 * 20 * 4
    assert pre.flops == 2 * 16 * 24 * 16384
    assert post.bytes == 16 * 4096 * 2 + 2 * 16 * 4 * 4096 * 2 + 16 * 20 * 4
    assert pre.patch == "mhc_pre" and post.patch == "mhc_post"
    fused = _by_name(ops, M.MHC_FUSED_NAME, "patched")
    # hc_fn + x + residual in + residual out + layer input out + mixes in and out + the norm weight
    assert fused.bytes == 24 * 16384 * 4 + 16 * 4096 * 2 + 2 * 16 * 4 * 4096 * 2 + 16 * 4096 * 2 + 2 * 16 * 20 * 4 \
        + 4096 * 2
    assert fused.flops == pre.flops + post.flops and fused.patch == "mhc_fused"
    assert pre.fallback[0] == pytest.approx(28.3) and pre.fallback[1].startswith("estimate")
    assert M.interp(((1, 2.0), (3, 4.0)), 2) == 3.0 and M.interp(((1, 2.0), (3, 4.0)), 5) == 6.0
    assert M.interp(M.MHC_FALLBACK_POST_US, 64) == pytest.approx(2.6)


@pytest.mark.parametrize("spec", [M.StepSpec("decode", 16, 128 * K, 8 * K), M.StepSpec("prefill", 1024, 1024, 1024),
                                  M.StepSpec("verify", 4, 128 * K, 8 * K, k=2)], ids=lambda s: s.phase)
def test_patched_path_runs_the_models_fused_mhc_structure(spec):
    """Upstream: 2n pre + 2n post + 2n + 1 RMSNorms per forward of n layers. Patched (the mhc patch turns
    the model's fused path on): the first layer's pre and input norm, 2n - 1 fused boundaries (each with
    its sub-layer's norm), the last layer's post, the final norm. Same boundaries either way."""
    ops = M.step_ops(spec)
    fwd = {"target": (43, 1, ""), "draft": (1, spec.k, "draft: ")} if spec.phase == "verify" else {
        "target": (43, 1, "")}
    for n, reps, prefix in fwd.values():
        mine = [o for o in ops if o.name.startswith("draft: ") == bool(prefix)]
        rows = spec.batch if prefix else spec.rows

        def count(path, name, mine=mine, prefix=prefix):
            hits = [o for o in M.ops_for_path(mine, path) if o.name == prefix + name]
            return sum(o.count for o in hits), hits

        extra_norm = 1 if prefix else 0  # the draft's enorm (its hnorm is a 4B-row row of its own)
        up_pre, _ = count("upstream", M.MHC_PRE_NAME)
        up_post, _ = count("upstream", M.MHC_POST_NAME)
        up_fused, _ = count("upstream", M.MHC_FUSED_NAME)
        up_rms, _ = count("upstream", M.RMS4096_NAME)
        pa_pre, _ = count("patched", M.MHC_PRE_NAME)
        pa_post, _ = count("patched", M.MHC_POST_NAME)
        pa_fused, fused = count("patched", M.MHC_FUSED_NAME)
        pa_rms, _ = count("patched", M.RMS4096_NAME)
        assert (up_pre, up_post, up_fused, up_rms) == (2 * n * reps, 2 * n * reps, 0, (2 * n + 1 + extra_norm) * reps)
        assert (pa_pre, pa_post, pa_fused, pa_rms) == (reps, reps, (2 * n - 1) * reps, (2 + extra_norm) * reps)
        assert pa_pre + pa_fused == up_pre and pa_fused + pa_post == up_post  # every boundary, once
        assert up_rms - pa_rms == pa_fused  # the sub-layer norms moved into the fused op
        assert fused[0].p["rows"] == rows and fused[0].key == f"mhc-fused:{rows}:patched"
    # each path runs each name once; the fused row is timed as ours only, pre/post both ways, the norm once
    for path in ("upstream", "patched"):
        names = [o.name for o in M.ops_for_path(ops, path)]
        assert len(names) == len(set(names))
    uniq = M.unique_ops([spec])
    assert runner.impls_for(uniq[f"mhc-fused:{spec.rows}:patched"]) == ["ours"]
    assert runner.impls_for(uniq[f"mhc-pre:{spec.rows}"]) == ["upstream", "ours"]
    rms_key = _by_name(ops, M.RMS4096_NAME, "patched").key
    assert rms_key == _by_name(ops, M.RMS4096_NAME, "upstream").key and runner.impls_for(uniq[rms_key]) == ["upstream"]


def test_fused_mhc_row_composes_and_renders():
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    meas = {}
    for op in M.unique_ops([spec]).values():
        for impl in runner.impls_for(op):
            us = {"mhc-pre": 20.0, "mhc-post": 5.0, "mhc-fused": 4.0}.get(op.key.split(":")[0], 1.0)
            if op.key.startswith("glue:rms4096"):
                us = 3.0
            meas[(op.key, impl)] = runner.Measurement(op.key, impl, op.name, us / 2 if impl == "ours" and
                                                      op.group == "mhc" and "fused" not in op.key else us,
                                                      1, 1, True, 0.0, "", impl)
    us, src = runner.path_times(ops, meas)
    gpu = M.machine_for("NVIDIA H200", 4.2e12)
    up, pa = M.compose(spec, "upstream", ops, us, src, gpu), M.compose(spec, "patched", ops, us, src, gpu)
    mhc_up = sum(ln.ms_step for ln in up.lines if ln.group == "mhc")
    mhc_pa = sum(ln.ms_step for ln in pa.lines if ln.group == "mhc")
    assert mhc_up == pytest.approx((86 * 20.0 + 86 * 5.0) / 1e3)
    assert mhc_pa == pytest.approx((1 * 10.0 + 1 * 2.5 + 85 * 4.0) / 1e3)
    rms = {c.path: [ln for ln in c.lines if ln.name == M.RMS4096_NAME][0] for c in (up, pa)}
    assert rms["upstream"].ms_step == pytest.approx(87 * 3.0 / 1e3) and rms["patched"].ms_step == pytest.approx(
        2 * 3.0 / 1e3)
    text = R.composition_table(up, pa, gpu, md=True)
    fused_row = [ln for ln in text.splitlines() if ln.startswith(f"| {M.MHC_FUSED_NAME} |")]
    assert len(fused_row) == 1 and "| 85 | - | 4.00 | - |" in fused_row[0]
    assert f"| {M.MHC_PRE_NAME} | 86 / 1 |" in text and f"| {M.RMS4096_NAME} | 87 / 2 |" in text
    # the fused row sits after the patched path's preceding row, not at the end
    lines = text.splitlines()
    assert lines.index(fused_row[0]) < [i for i, ln in enumerate(lines) if ln.startswith("| **timed ops**")][0]


def test_fused_mhc_builder_checks_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = _cpu_ops(monkeypatch)
    op = _by_name(M.mhc_ops(1, n_layers=1), M.MHC_FUSED_NAME)
    with pytest.raises(common.Unavailable, match="gated off"):
        ops.build(op, "upstream", 1 << 20, 5)
    prep = ops.build(op, "ours", 1 << 20, 5)
    chk = prep.check()
    assert chk.ok and chk.rel_err < 1e-2, chk
    assert prep.source == "ours: v4flash_kernels.mhc.op.mhc_fused_post_pre" and prep.calls == 2


def test_untimed_op_falls_back_to_its_labelled_estimate():
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    meas = {}
    for op in ops:
        for impl in runner.impls_for(op):
            if op.group == "mhc":
                err = "TileLang mHC unavailable here: ImportError" if impl == "upstream" else "no patch yet"
                meas[(op.key, impl)] = runner.Measurement(op.key, impl, op.name, float("nan"), 0, 0, True,
                                                          float("nan"), "", err, err)
            else:
                meas[(op.key, impl)] = runner.Measurement(op.key, impl, op.name, 1.0, 1, 1, True, 0.0, "", impl)
    us, src = runner.path_times(ops, meas)
    pre = _by_name(ops, M.MHC_PRE_NAME, "upstream")
    assert us[(pre.key, "upstream")] == pytest.approx(17.9) and us[(pre.key, "patched")] == pytest.approx(17.9)
    assert src[(pre.key, "upstream")].startswith("estimate") and "TileLang mHC unavailable" in src[(pre.key, "upstream")]
    gpu = M.machine_for("NVIDIA H200", 4.2e12)
    comp = M.compose(spec, "upstream", ops, us, src, gpu)
    est = [ln for ln in comp.lines if ln.estimated]
    assert {ln.group for ln in est} == {"mhc"}
    assert comp.timed_ms == pytest.approx(sum(ln.ms_step for ln in comp.lines if ln.group != "mhc"))
    assert comp.estimate_ms > sum(ln.ms_step for ln in est) > 0  # never a silent zero, never counted as timed
    text = R.composition_table(comp, M.compose(spec, "patched", ops, us, src, gpu), gpu, md=True)
    assert f"{M.MHC_PRE_NAME} (estimate)" in text


def test_mhc_references_from_the_definition(monkeypatch):
    _cpu_ops(monkeypatch)
    import torch

    g = torch.Generator().manual_seed(3)
    x = torch.randn((2, 4, 4096), generator=g).to(torch.bfloat16)
    fn, scale, base = ops_mhc.mhc_params(g)
    y, post, comb = ops_mhc.mhc_pre_ref(x, fn, scale, base)
    assert y.shape == (2, 4096) and post.shape == (2, 4) and comb.shape == (2, 4, 4)
    # Sinkhorn ends on a column normalisation: columns sum to ~1, rows close to 1, all positive
    assert torch.allclose(comb.sum(1), torch.ones(2, 4, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(comb.sum(2), torch.ones(2, 4, dtype=torch.float64), atol=1e-3) and bool((comb > 0).all())
    assert bool(((post > 0) & (post < 2)).all())
    # pre weights are sigmoid + eps: y is a positive combination of the 4 copies
    xf = x.double().reshape(2, -1)
    mix = (xf @ fn.double().t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
    pre = torch.sigmoid(mix[:, :4] * scale[0].double() + base[:4].double()) + 1e-6
    assert torch.allclose(y, (pre[:, :, None] * x.double()).sum(1))
    out = ops_mhc.mhc_post_ref(y.float().to(torch.bfloat16), x, post, comb)
    j = 2
    want = post[:, j, None] * y.to(torch.bfloat16).double() + sum(comb[:, k, j, None] * x[:, k].double() for k in range(4))
    assert torch.allclose(out[:, j], want)


def test_mhc_without_tilelang_is_unavailable_not_failed(monkeypatch):
    _cpu_ops(monkeypatch)
    _wheel_or_skip()
    monkeypatch.setitem(common.loaded, "mhc", common.Unavailable("TileLang mHC unavailable here: test"))
    op = M.mhc_ops(1)[0]
    m = runner.measure_one(op, "upstream", 1 << 20, 3)
    assert m.ok and m.us != m.us and "TileLang mHC unavailable" in m.error
    # Ours does not need TileLang: the mhc patch is found (timing it needs the GPU).
    fn, why = common.patch_function("mhc_pre")
    assert fn is not None and why == "ours: v4flash_kernels.mhc.op.hc_pre"


# ---------------------------------------------------------------- glue (step 2)


def test_glue_ops_counts_and_bytes():
    counts = M.layer_counts()
    rms = {o.p["path"]: o for o in M.glue_ops(16, counts, prefill=False) if o.p["kind"] == "rms4096"}
    # upstream 2 per layer + final; patched: the first layer's input norm + final (the rest are in the fused mHC)
    assert rms["upstream"].count == 87 and rms["patched"].count == 2 and rms["upstream"].key == rms["patched"].key
    ops = {o.p["kind"]: o for o in M.glue_ops(16, counts, prefill=False)}
    assert ops["rms1024"].count == 43  # q_norm per layer
    assert ops["rms4096"].bytes == 16 * 4096 * 2 * 2 + 4096 * 2 and ops["rms4096"].p["impl"] == "rmsnorm"
    assert ops["kvstore"].bytes == 16 * 512 * 2 + 16 * 584  # bf16 kv in, fp8_ds_mla token out
    assert ops["qrope16"].bytes == 2 * 16 * 16 * 512 * 2  # 16 local heads at TP4, in place
    assert ops["comp4"].count == 21 and ops["comp128"].count == 20 and ops["compidx"].count == 21
    assert ops["comp4"].kernels == 3 and ops["kvstore"].kernels == 1
    # decode c4: every row writes its fp32 kv+score (2 x 2 x 512) into the state ring
    assert ops["comp4"].p["launches"][0] == (16 * 2048 * 4, 16 * 2048 * 4)
    assert ops["silu4"].bytes == 16 * 1024 * 2 + 16 * 512 * 2
    assert all(o.group == "glue" and o.flops == 0 for o in ops.values())
    pre = {o.p["kind"]: o for o in M.glue_ops(1024, counts, prefill=True)}
    # prefill: every 4th token is compressed (256 of 1024), every token's projection is read
    assert pre["comp4"].p["launches"][0] == (1024 * 2048 * 4, 256 * 512 * 4)
    assert pre["comp4"].p["launches"][2] == (256 * 512 * 4, 256 * 584)
    assert len({o.key for o in ops.values()}) == len(ops)
    step = M.decode_ops(M.StepSpec("decode", 16, 128 * K, 8 * K))
    assert sum(o.group == "glue" for o in step) == 13  # 12 kinds, the RMSNorm 4096 once per path


def test_glue_builders_check_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = _cpu_ops(monkeypatch)
    _wheel_or_skip()
    counts = M.layer_counts()
    for op in M.glue_ops(3, counts, prefill=False):
        if op.p["kind"] not in ("rms1024", "kvstore", "comp4", "add"):
            continue
        prep = ops.build(op, "upstream", 1 << 20, 5)
        chk = prep.check()
        assert chk.ok, (op.key, chk)
        assert ("proxy" in prep.source) == (op.p["impl"] != "torch_add")


# ---------------------------------------------------------------- RTX PRO 6000 range (step 3)


PUBLIC = json.loads((Path(__file__).parent / "data" / "rtx6000_public.json").read_text())["figures"]


def _rtx_floor_ms(spec: M.StepSpec) -> float:
    return sum(o.floor_us(M.RTX6000) * o.count for o in M.ops_for_path(M.step_ops(spec), "patched")) / 1e3


def test_rtx_floor_agrees_with_the_public_calculation_and_no_public_measurement_beats_it():
    """The model's RTX PRO 6000 floors against figures it did not produce (tests/kernels/data/
    rtx6000_public.json): the B=1 TP4 bytes floor within 10 % of a public calculation of the same bytes,
    and no public measurement of a whole step on the card below the model's floor for that batch at the
    shortest context we model (1K tokens; a real stack cannot beat a true floor, so a floor above a
    measurement would be wrong). At 64 streams the public stack runs at 1.01x our floor."""
    b1 = _rtx_floor_ms(M.StepSpec("decode", 1, 128 * K, 8 * K))
    assert b1 == pytest.approx(PUBLIC["tp4_b1_bytes_floor_ms"]["value"], rel=0.10)
    assert PUBLIC["tp4_b1_step_ms"]["value"] >= _rtx_floor_ms(M.StepSpec("decode", 1, 128 * K, 1 * K))
    b64 = _rtx_floor_ms(M.StepSpec("decode", 64, 128 * K, 1 * K))
    assert PUBLIC["tp4_64_streams_step_ms"]["value"] >= b64
    assert all(f["kind"] in ("calculation", "measurement") and f["source"] for f in PUBLIC.values())


def test_rtx_range_brackets_the_floor_and_renders():
    """The range's structure (not its formula): it lies between the H200 time and above the card's
    floor, its tok/s are the inverse of its ms, and the summary shows it."""
    h200 = M.machine_for("NVIDIA H200", 4.2e12)
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    us, src = _fake_times(spec)
    comp = M.compose(spec, "patched", ops, us, src, h200)
    lo, hi = comp.rtx_range_ms
    assert comp.total_ms <= lo <= hi
    assert lo >= _rtx_floor_ms(spec)
    gemv = M.fp8_gemm("x", 1, 8192, 1024, 1)
    g_lo, g_hi = M.rtx_range_us(gemv, 1.0, h200)
    assert g_lo >= gemv.floor_us(M.RTX6000) and g_hi >= g_lo
    t_lo, t_hi = comp.rtx_tok_s_range()
    assert t_lo == pytest.approx(1 / (hi / 1e3)) and t_hi == pytest.approx(1 / (lo / 1e3))
    md = R.summary_table([(M.compose(spec, "upstream", ops, us, src, h200), comp)], md=True)
    assert "RTX 6000" in md and f"{lo:.1f} - {hi:.1f}" in md


# ---------------------------------------------------------------- TP2 vs TP4 (step 4)


def test_tp2_shapes_bytes_and_floors():
    s4 = M.StepSpec("decode", 16, 128 * K, 8 * K, heads_patched=16)
    s2 = M.StepSpec("decode", 16, 128 * K, 8 * K, heads_patched=32, tp=2)
    o4, o2 = M.decode_ops(s4), M.decode_ops(s2)
    assert s2.label == "decode TP2 B=16 C=128K L=8K" and s4.label == "decode B=16 C=128K L=8K"
    assert _by_name(o2, "wq_b (FP8)").p == {"m": 16, "n": 32 * 512, "k": 1024}
    fused2 = M.decode_ops(dataclasses.replace(s2, opt_in=("qnorm_rope",)))
    assert _by_name(fused2, M.QNORM_ROPE_NAME, "patched").p["heads"] == 32
    assert _by_name(o2, "wo_b (FP8)").p["k"] == 4096 and _by_name(o2, "wo_a einsum (bf16)").p["groups"] == 4
    assert _by_name(o2, "lm_head (bf16, vocab/TP)").p["n"] == 129280 // 2
    # replicated projections keep their shape; the routed experts hold twice the bytes per GPU
    assert _by_name(o2, "wqkv_a (FP8)").key == _by_name(o4, "wqkv_a (FP8)").key
    assert M.moe_expert_bytes(2) == 2 * M.moe_expert_bytes(4)
    moe2 = _by_name(o2, "routed MoE (MXFP4)")
    assert moe2.key == "moe:16:tp2" and moe2.p["tp"] == 2 and _by_name(o4, "routed MoE (MXFP4)").key == "moe:16"
    att2 = _by_name(o2, "sparse-MLA attention (c4)", "patched")
    assert att2.p["heads"] == 32 and att2.bytes > _by_name(o4, "sparse-MLA attention (c4)", "patched").bytes
    # upstream attends all 64 heads at any TP: its attention shapes are shared between the layouts
    assert (_by_name(o2, "sparse-MLA attention (c4)", "upstream").key
            == _by_name(o4, "sparse-MLA attention (c4)", "upstream").key)
    fl = {tp: sum(o.floor_us(M.RTX6000) * o.count for o in M.ops_for_path(ops, "patched"))
          for tp, ops in ((4, o4), (2, o2))}
    assert 1.5 < fl[2] / fl[4] < 2.0  # the weight bytes per GPU almost double
    gl2 = {o.p["kind"] for o in o2 if o.group == "glue"}
    assert {"qrope32", "orope32", "silu2"} <= gl2


def test_tp_option_and_table(capsys):
    from v4flash_bench.step.__main__ import specs_from

    class A:
        batches, contexts, actual_context, prefill, tp, mtp, verify_batches = "1,16", "128K,1M", "8K", "1K", "4,2", "", None
        opt_in = ""

    specs = specs_from(A)
    assert [s.tp for s in specs].count(2) == 2  # TP2 decode at the first context only
    assert all(s.configured_ctx == 128 * K and s.phase == "decode" for s in specs if s.tp == 2)
    A.tp = "3"
    assert main(["--tp", "3", "--dry-run"]) == 2 and "fix:" in capsys.readouterr().err
    gpu = M.machine_for("NVIDIA H200", 4.2e12)
    pairs = []
    # equal total streams on the same 4 GPUs: one TP4 worker at B = S, two TP2 workers at B = S/2 each
    for tp, b in ((4, 32), (2, 16), (4, 128), (2, 64)):
        spec = M.StepSpec("decode", b, 128 * K, 8 * K, heads_patched=64 // tp, tp=tp)
        ops = M.step_ops(spec)
        us, src = _fake_times(spec)
        pairs.append((M.compose(spec, "upstream", ops, us, src, gpu), M.compose(spec, "patched", ops, us, src, gpu)))
    text = R.tp_table(pairs, md=True)
    row = [r for r in text.splitlines() if r.startswith("| 32 |")][0].split("|")
    p4, p2 = pairs[0][1], pairs[1][1]
    assert float(row[4]) == pytest.approx(round(32 / (p4.total_ms / 1e3) / 4, 1), abs=0.06)
    assert float(row[6]) == pytest.approx(round(2 * 16 / (p2.total_ms / 1e3) / 4, 1), abs=0.06)
    # 64 streams per TP2 worker do not fit its KV pool (32 8K-token streams): no 128-stream row
    assert not M.streams_fit(2, 64) and M.streams_fit(2, 32) and M.streams_fit(4, 128)
    assert not [r for r in text.splitlines() if r.startswith("| 128 |")]
    assert R.tp_table(pairs[:1], md=True) == ""


def test_kv_pool_constants_are_the_launchers_arithmetic():
    """The step bench's KV pools (which TP rows exist) are what `plan` computes for the profiles."""
    from v4flash_pd.memory import REPACKED_SCALE_BYTES, fit

    for tp, frac in ((4, 0.70), (2, 0.85)):
        f = fit("decode-0", "decode", 0, tp, 97887, frac, 131072, True, scale_bytes=REPACKED_SCALE_BYTES)
        assert f.kv_tokens == M.KV_POOL_TOKENS[tp], (tp, f.kv_tokens)


def test_accept_lengths_are_a_cited_range_per_draft_depth():
    for k, acc in M.ACCEPT.items():
        assert 1.0 < acc.low < acc.mid < acc.high <= k + 1 and acc.source
    assert (M.ACCEPT[2].low, M.ACCEPT[2].high) == (2.2, 2.76)  # docs/speculative.md's sources
    assert M.accept_range(5).high <= 6 and M.accept_range(5).low == M.ACCEPT[3].low


# ---------------------------------------------------------------- speculative verify (step 5)


def test_verify_composition_rows_and_drafts():
    spec = M.StepSpec("verify", 16, 128 * K, 8 * K, heads_patched=16, k=3)
    assert spec.rows == 64 and spec.label == "verify k=3 B=16 C=128K L=8K"
    ops = M.step_ops(spec)
    target = [o for o in ops if not o.name.startswith("draft: ")]
    draft = [o for o in ops if o.name.startswith("draft: ")]
    assert _by_name(target, "routed MoE (MXFP4)").p["m"] == 64  # B x (k+1) rows through every op
    assert _by_name(target, "wq_b (FP8)").p["m"] == 64 and _by_name(target, "lm_head (bf16, vocab/TP)").p["m"] == 64
    att = _by_name(target, "sparse-MLA attention (c4)", "patched")
    assert att.p["rows"] == 16 and att.p["reps"] == 4 and att.key.startswith("attn:c4:B16x4:")
    # the 4 rows of one request share its cache: the floor reads its 640 attended tokens once, not 4 times
    assert att.bytes == 16 * 640 * 584 + 4 * 64 * 640 + 2 * 64 * 16 * 512 * 2
    idx = _by_name(target, "indexer logits (c4)")
    assert idx.p["reps"] == 4 and idx.bytes == 16 * 2048 * 132 + 64 * 64 * 132 + 64 * (128 * K // 4) * 4
    # drafts: k forwards of one window layer + head at B rows
    moe_d = _by_name(draft, "draft: routed MoE (MXFP4)")
    assert moe_d.p["m"] == 16 and moe_d.count == 3 and moe_d.key == "moe:16"
    assert _by_name(draft, "draft: sparse-MLA attention (window)", "upstream").count == 3
    assert _by_name(draft, "draft: NextN h_proj (FP8)").p == {"m": 64, "n": 4096, "k": 4096}
    assert _by_name(draft, "draft: " + M.MHC_PRE_NAME, "upstream").count == 3 * 2
    assert _by_name(draft, "draft: " + M.MHC_FUSED_NAME, "patched").count == 3 * 1
    assert _by_name(draft, "draft: lm_head (bf16, vocab/TP)").p["m"] == 16
    assert _by_name(draft, "draft: RMSNorm 4096 (input / post-attn / final)", "upstream").count == 3 * 4
    assert _by_name(draft, "draft: RMSNorm 4096 (input / post-attn / final)", "patched").count == 3 * 3
    assert not any("compressor" in o.name or "indexer" in o.name for o in draft)
    # the plain decode step of the same B shares the draft's shapes (one measurement)
    plain = {o.key for o in M.step_ops(M.StepSpec("decode", 16, 128 * K, 8 * K, heads_patched=16))}
    assert {moe_d.key, _by_name(draft, "draft: wq_b (FP8)").key} <= plain
    est = M.estimates("verify", spec.rows, 4, spec.batch, spec.k)
    assert [e.count for e in est] == [9, 87]
    assert est[1].us_per_call == M.allreduce_us(64 * 4096 * 2, 4)[0]


def test_spec_tok_s_and_table():
    assert M.spec_tok_s(10.0, 16, 3.1, 3) == pytest.approx((310.0, 4960.0))
    per, agg = M.spec_tok_s(10.0, 16, 2.5, 1)
    assert per != per and agg != agg  # a k=1 cycle emits at most 2 tokens
    gpu = M.machine_for("NVIDIA H200", 4.2e12)
    pairs = []
    for spec in (M.StepSpec("decode", 1, 128 * K, 8 * K, heads_patched=16),
                 M.StepSpec("verify", 1, 128 * K, 8 * K, heads_patched=16, k=3)):
        ops = M.step_ops(spec)
        us, src = _fake_times(spec)
        pairs.append((M.compose(spec, "upstream", ops, us, src, gpu), M.compose(spec, "patched", ops, us, src, gpu)))
    text = R.spec_table(pairs, md=True)
    row = [r for r in text.splitlines() if r.startswith("| 1 | 3 |")][0].split("|")
    plain, cyc = pairs[0][1].total_ms, pairs[1][1].total_ms
    assert float(row[4]) == pytest.approx(cyc, abs=0.006)
    assert row[-2].strip().startswith(f"{3.1 / (cyc / 1e3):.1f} / ")
    assert f"({3.1 / (cyc / 1e3) * plain / 1e3:.2f}x)" in row[-2]
    assert R.spec_table(pairs[:1], md=True) == ""


def test_verify_attention_and_indexer_inputs_share_a_request_cache(monkeypatch):
    _cpu_ops(monkeypatch)
    spec = M.StepSpec("verify", 2, 4096, 1024, heads_patched=16, k=2)
    op = _by_name(M.decode_ops(spec), "sparse-MLA attention (c128)", "upstream")
    kw = ops_attention.decode_attention_inputs(op.p, 3)
    assert kw["q"].shape[0] == 6 and kw["indices"].shape[0] == 6
    import torch

    assert torch.equal(kw["extra_indices"][0], kw["extra_indices"][2])  # rows of one request: one cache
    idx = _by_name(M.decode_ops(spec), "indexer logits (c4)")
    ki = ops_indexer.indexer_inputs(idx.p, 3)
    assert ki["q_fp8"].shape[0] == 6 and torch.equal(ki["page_table"][0], ki["page_table"][1])
    assert ki["seq_lens"].view(-1).tolist() == [256, 256, 256, 256, 256, 256]  # (1024 + j) // 4 for j < 3


def test_dry_run_and_from_json_keep_the_new_compositions(tmp_path):
    import json

    args = ["--batches", "1,2", "--contexts", "128K", "--prefill", "", "--tp", "4,2", "--mtp", "1",
            "--verify-batches", "1"]
    from v4flash_bench.step.__main__ import main as step_main

    class A:
        batches, contexts, actual_context, prefill, tp, mtp, verify_batches = "1,2", "128K", "8K", "", "4,2", "1", "1"
        opt_in = ""

    from v4flash_bench.step.__main__ import specs_from

    specs = specs_from(A)
    assert [s.label for s in specs] == ["decode B=1 C=128K L=8K", "decode B=2 C=128K L=8K",
                                        "verify k=1 B=1 C=128K L=8K", "decode TP2 B=1 C=128K L=8K",
                                        "decode TP2 B=2 C=128K L=8K"]
    meas = []
    for key, op in M.unique_ops(specs).items():
        for impl in runner.impls_for(op):
            meas.append(runner.to_json(runner.Measurement(key, impl, op.name, 5.0, 1, 3, True, 1e-3, "", impl)))
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "copy_bw_tbs": 4.2, "heads_patched": 16, "tp": "4,2",
                                        "mtp": "1", "verify_batches": "1", "opt_in": ""}, "measurements": meas}))
    md = tmp_path / "out.md"
    assert step_main(["--batches", "1,2", "--contexts", "128K", "--prefill", "", "--from-json", str(run),
                      "--md", str(md)]) == 0
    text = md.read_text()
    assert "## TP4 vs 2x TP2" in text and "## Speculative decoding" in text and "verify k=1 B=1" in text
    assert step_main([*args, "--dry-run"]) == 0


# ---------------------------------------------------------------- what the patched path composes


def test_opt_in_names_only_switches_that_are_off_by_default(capsys):
    off = [s.name for s in patches.SWITCHES if not s.default_on]
    on = [s.name for s in patches.SWITCHES if s.default_on]
    assert "qnorm_rope" in off and on
    assert main(["--opt-in", on[0], "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "on by default already" in err and "fix:" in err and "qnorm_rope" in err
    assert main(["--opt-in", "no_such_switch", "--dry-run"]) == 2
    assert "not a kernel switch" in capsys.readouterr().err
    assert main(["--opt-in", "qnorm_rope", "--dry-run", "--batches", "1", "--contexts", "128K", "--prefill", "",
                 "--mtp", "", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "decode B=1 C=128K L=8K +qnorm_rope" in out and M.QNORM_ROPE_NAME in out
    assert main(["--dry-run", "--batches", "1", "--contexts", "128K", "--prefill", "", "--mtp", "", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "+qnorm_rope" not in out and M.QNORM_ROPE_NAME not in out


def _run_json(tmp_path, specs, meta, graphs=()):
    meas = []
    for key, op in M.unique_ops(specs).items():
        for impl in runner.impls_for(op):
            meas.append(runner.to_json(runner.Measurement(key, impl, op.name, 10.0 if impl == "upstream" else 5.0,
                                                          1, 3, True, 1e-3, "", impl)))
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "copy_bw_tbs": 4.2, "heads_patched": 16, "tp": "4",
                                        "mtp": "", **meta}, "measurements": meas, "step_graphs": list(graphs)}))
    return run


def test_a_run_before_opt_in_re_renders_as_it_was_composed_and_as_the_default(tmp_path, capsys):
    """Runs before --opt-in composed the fused q path and labelled their graphs without '+qnorm_rope':
    re-rendered as they were, the graphs pair with their per-op sums; re-rendered as the shipped default
    (--opt-in ''), the fused row is gone and the graphs, which captured another composition, are left out."""
    old = M.decode_specs([1], [128 * K], 8 * K, 16, opt_in=("qnorm_rope",))
    default = M.decode_specs([1], [128 * K], 8 * K, 16)
    graph = {"spec": "decode B=1 C=128K L=8K", "path": "patched", "ms": 4.25, "kernels": 900, "other_nodes": {},
             "calls": 900, "error": None}
    run = _run_json(tmp_path, old + default, {}, [graph])
    args = ["--batches", "1", "--contexts", "128K", "--prefill", "", "--from-json", str(run)]
    md = tmp_path / "as-run.md"
    assert main([*args, "--md", str(md)]) == 0
    text = md.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| decode B=1 C=128K L=8K +qnorm_rope | patched"))
    assert "4.25" in row and row.split("|")[3].strip() not in ("-", "nan"), row  # the per-op sum beside the graph
    assert M.QNORM_ROPE_NAME in text
    capsys.readouterr()
    md = tmp_path / "default.md"
    assert main([*args, "--opt-in", "", "--md", str(md)]) == 0
    text = md.read_text()
    assert "captured its own composition" in capsys.readouterr().err
    assert "+qnorm_rope" not in text and M.QNORM_ROPE_NAME not in text and "4.25" not in text
    assert "| decode B=1 C=128K L=8K |" in text


def test_a_run_whose_opt_in_has_since_become_the_default_re_renders_and_a_forged_one_is_refused(
        tmp_path, capsys, monkeypatch):
    """A run that opted into qnorm_rope, re-rendered after qnorm_rope became on by default: its composition is
    the default now, its graphs pair with it (no traceback on a name --opt-in would refuse today). A run whose
    JSON names no kernel switch ends in error + fix."""
    fused = M.decode_specs([1], [128 * K], 8 * K, 16, opt_in=("qnorm_rope",))
    graph = {"spec": "decode B=1 C=128K L=8K +qnorm_rope", "path": "patched", "ms": 4.25, "kernels": 900,
             "other_nodes": {}, "calls": 900, "error": None}
    run = _run_json(tmp_path, fused, {"opt_in": "qnorm_rope"}, [graph])
    flipped = tuple(dataclasses.replace(s, default_on=True) if s.name == "qnorm_rope" else s for s in patches.SWITCHES)
    monkeypatch.setattr(patches, "SWITCHES", flipped)
    md = tmp_path / "now.md"
    assert main(["--batches", "1", "--contexts", "128K", "--prefill", "", "--from-json", str(run), "--md", str(md)]) == 0
    text = md.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| decode B=1 C=128K L=8K | patched"))
    assert "4.25" in row and M.QNORM_ROPE_NAME in text and "+qnorm_rope" not in text
    monkeypatch.undo()
    forged = _run_json(tmp_path, fused, {"opt_in": "no_such_switch"})
    assert main(["--batches", "1", "--contexts", "128K", "--prefill", "", "--from-json", str(forged)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "fix:" in err and "Traceback" not in err


def test_the_default_composition_is_cheaper_by_the_fusions_measured_cost(tmp_path):
    """With the fused q path timed slower than wq_b + the norm/RoPE glue, the default (no opt-in) patched
    step is faster, by exactly layers x (fused - wq_b ours - glue) µs."""
    spec = M.decode_specs([1], [128 * K], 8 * K, 16)[0]
    fused = dataclasses.replace(spec, opt_in=("qnorm_rope",))
    ops = {s.opt_in: M.step_ops(s) for s in (spec, fused)}
    us = {}
    for o in {**M.unique_ops([spec]), **M.unique_ops([fused])}.values():
        for impl in runner.impls_for(o):
            us[(o.key, impl)] = runner.Measurement(o.key, impl, o.name, 20.0 if o.patch == "qnorm_rope" else 5.0,
                                                   1, 3, True, 1e-3, "", impl)
    totals = {}
    for opt, sops in ops.items():
        t, src = runner.path_times(sops, us)
        totals[opt] = M.compose(spec if not opt else fused, "patched", sops, t, src, M.RTX6000).timed_ms
    n = M.layer_counts()["all"]
    assert totals[("qnorm_rope",)] - totals[()] == pytest.approx(n * (20.0 - 5.0 - 5.0) / 1e3)


# ---------------------------------------------------------------- seeds, bounds, failed rows (issue 28)

# The seed of the H200 run where the old fixed 1e-2 bound failed ours on fp8:4x4096x512 by luck.
SEEDS = (1, 2, 1796172714)


def test_the_seed_is_fixed_and_an_ops_inputs_depend_only_on_it_and_its_key():
    from v4flash_bench.step.__main__ import DEFAULT_SEED

    assert isinstance(DEFAULT_SEED, int)
    keys = list(M.unique_ops(M.decode_specs([1, 16], [128 * K], 8 * K, 16)))
    assert common.op_seed(DEFAULT_SEED, keys[5]) == common.op_seed(DEFAULT_SEED, keys[5])
    assert len({common.op_seed(DEFAULT_SEED, k) for k in keys}) == len(keys)
    assert common.op_seed(1, keys[0]) != common.op_seed(2, keys[0])


def test_fp8_verdicts_do_not_depend_on_the_seed(monkeypatch):
    """Ours passes, and a kernel 3 % off fails, for every seed: the bound is the arithmetic's (the
    definitional quant, bf16 output rounding, the fp8 MMAs' accumulation at 2^-10 of the sum of |terms|),
    not one draw's. (1 % off sits at 0.99 of that bound on one of these draws at K = 512.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _cpu_ops(monkeypatch)
    _wheel_or_skip()
    from v4flash_bench.step.ops import fp8_gemm

    op = M.fp8_gemm("x", 4, 256, 512, 1)
    # Ours only: under the interpreter upstream's Triton quant casts to e4m3 by truncation (a GPU rounds
    # to nearest), so here its error is not the GPU's; ours rounds explicitly and is checked as on a GPU.
    for seed in SEEDS:
        chk = O.build(op, "ours", 1 << 20, seed).check()
        assert chk.ok, (seed, chk)
        assert "upstream's rel. err on these inputs" in chk.detail
    ours, why = common.patch_function("fp8_gemm")

    def off_by_3pct(*args, **kw):
        return ours(*args, **kw) * 1.03

    monkeypatch.setattr(common, "patch_function", lambda patch: (off_by_3pct, "ours: broken"))
    for seed in SEEDS:
        chk = O.build(op, "ours", 1 << 20, seed).check()
        assert not chk.ok, (seed, chk)
    assert fp8_gemm.NO_WORSE >= 1.0


def test_fp8_bound_is_the_accumulators_not_one_draws(monkeypatch):
    """A linear whose fp32 accumulation is as coarse as fp8 MMAs may make it (0.9 of 2^-10 of the sum of
    |terms| per element) passes for every seed, though its relative error crosses the old fixed 1e-2 on
    some (long K: much cancellation), which is how an H200 run failed ours by luck."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _cpu_ops(monkeypatch)
    _wheel_or_skip()
    import torch

    from v4flash_bench.step.ops import fp8_gemm
    from v4flash_kernels.fp8_gemm.reference import linear_ref

    def coarse(x, w, block, s):
        ref, mag = linear_ref(x, w, s)
        g = torch.Generator().manual_seed(int(ref.abs().sum()) % 1000)
        sign = torch.where(torch.rand(ref.shape, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
        return (ref + 0.9 * fp8_gemm.ATOL_MAG * mag * sign).to(torch.bfloat16)

    monkeypatch.setattr(common, "patch_function", lambda patch: (coarse, "ours: coarse accumulator"))
    op = M.fp8_gemm("x", 4, 128, 4096, 1)
    checks = [O.build(op, "ours", 1 << 20, seed).check() for seed in SEEDS]
    assert all(c.ok for c in checks), checks
    assert max(c.rel_err for c in checks) > 1e-2


def test_gemm_and_add_bounds_catch_two_roundings_for_every_seed(monkeypatch):
    _cpu_ops(monkeypatch)
    import torch

    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        x, w = torch.randn((3, 256), generator=g).to(torch.bfloat16), torch.randn((64, 256), generator=g)
        w = (w * 256 ** -0.5).to(torch.bfloat16)
        ref, mag = x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t()
        out = (x.float() @ w.float().t()).to(torch.bfloat16)
        assert common.rounding_check(out, ref, mag, common.U_BF16, 256 * common.U_FP32, "t").ok
        off = (out.double() * (1 + 4 * common.U_BF16)).to(torch.bfloat16)  # a few ulps off everywhere
        assert not common.rounding_check(off, ref, mag, common.U_BF16, 256 * common.U_FP32, "t").ok
        for op in (M.bf16_gemm("x", 3, 64, 256, 1), M.bf16_gemm("x", 3, 64, 256, 1, groups=2),
                   M.bf16_gemm("x", 3, 64, 256, 1, out_fp32=True)):
            assert O.build(op, "upstream", 1 << 20, seed).check().ok, (seed, op.key)


def test_a_failed_check_leaves_no_substituted_time_and_the_step_incomplete(tmp_path, capsys):
    spec = M.StepSpec("decode", 1, 128 * K, 8 * K)
    ops = M.step_ops(spec)
    meas = {}
    for op in M.unique_ops([spec]).values():
        for impl in runner.impls_for(op):
            bad = impl == "ours" and op.patch == "fp8_gemm" and op.key.startswith("fp8:1x1536")
            meas[(op.key, impl)] = runner.Measurement(
                op.key, impl, op.name, float("nan") if bad else 2.0, 1, 1, not bad, 0.02 if bad else 1e-3, "", impl,
                "MISMATCH vs reference: rel err 2.0e-02" if bad else None)
    us, src = runner.path_times(ops, meas)
    failed = [o for o in ops if o.key.startswith("fp8:1x1536")][0]
    assert us[(failed.key, "patched")] != us[(failed.key, "patched")]  # NaN, not upstream's 2.0
    assert src[(failed.key, "patched")].startswith("FAILED: MISMATCH")
    gpu = M.machine_for("NVIDIA H200", 4.2e12)
    up, pa = M.compose(spec, "upstream", ops, us, src, gpu), M.compose(spec, "patched", ops, us, src, gpu)
    assert pa.failed == (failed.name,) and up.failed == ()
    summary = R.summary_table([(up, pa)], md=True)
    assert f"incomplete (FAILED: {failed.name})" in summary
    row = [ln for ln in R.composition_table(up, pa, gpu, md=True).splitlines() if ln.startswith(f"| {failed.name} |")]
    assert len(row) == 1 and "| FAILED |" in row[0] and "| 2.00 |" in row[0]  # upstream's own cell keeps its time
    # the CLI writes the tables, says FAILED and exits non-zero; the JSON says the step is incomplete
    import json

    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200", "copy_bw_tbs": 4.2, "heads_patched": 64, "opt_in": ""},
                               "measurements": [runner.to_json(m) for m in meas.values()]}))
    out_json = tmp_path / "again.json"
    assert main(["--batches", "1", "--contexts", "128K", "--prefill", "", "--mtp", "", "--tp", "4",
                 "--from-json", str(run), "--json", str(out_json)]) == 1
    assert "FAILED" in capsys.readouterr().err
    comp = json.loads(out_json.read_text())["compositions"][0]
    assert comp["complete"] is False and comp["failed"]["patched"] == [failed.name]
