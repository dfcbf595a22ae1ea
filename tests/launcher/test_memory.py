"""Per-GPU memory arithmetic (memory.py): checked against the pinned wheel's own code where it has the
formula (the MoE weight layout, the DSV4 KV pool's bytes per token), against the step bench's model
facts, and by hand; then what `plan`, `up` and `doctor` do with it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from v4flash_bench.step import model as step
from v4flash_pd import memory as M
from v4flash_pd.config.load import load_config
from v4flash_pd.doctor import memory as dmemory
from v4flash_pd.doctor.context import DoctorInput, Expect
from v4flash_pd.doctor.probe import system_probe
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host
from v4flash_pd.plan import build_plan
from v4flash_pd.topology import load as load_topology

T8 = Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json"
GIB = 2**30

WHEEL = r"""
import json, torch
from types import SimpleNamespace
from sglang.srt.layers.quantization.mxfp4_marlin_moe import Mxfp4MarlinMoEMethod
from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator
out = {"experts": {}, "pool": {}}
for tp in (2, 4):
    with torch.device("meta"):  # the real create_weights: shapes and dtypes, no memory
        layer = torch.nn.Module()
        Mxfp4MarlinMoEMethod(None, "x").create_weights(layer, 256, 4096, 2048 // tp, torch.bfloat16)
    out["experts"][tp] = sum(p.numel() * p.element_size() for p in layer.parameters())
ratios = [0, 0] + [4, 128] * 20 + [4] + [0]  # + the MTP layer's entry, sliced off by end_layer
for spec in (None, "EAGLE"):
    cfg = SimpleNamespace(qk_nope_head_dim=448, qk_rope_head_dim=64, index_head_dim=128, compress_ratios=ratios,
                          window_size=128)
    mr = SimpleNamespace(model_config=cfg, start_layer=0, end_layer=43, pp_size=1, enable_hisparse=False,
                         server_args=SimpleNamespace(swa_full_tokens_ratio=0.1, speculative_algorithm=spec),
                         spec_algorithm=None)
    out["pool"][str(spec)] = DSV4PoolConfigurator(mr).bytes_per_full_token
print("RESULT " + json.dumps(out))
"""


def test_arithmetic_is_the_pinned_wheels(sglang_python) -> None:
    res = subprocess.run([str(sglang_python), "-c", WHEEL], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    shape = M.ModelShape()
    for tp in (2, 4):
        assert M.routed_experts_bytes(shape, tp) == got["experts"][str(tp)], tp
    assert M.bytes_per_token(shape, speculative=False) == pytest.approx(got["pool"]["None"], rel=1e-12)
    assert M.bytes_per_token(shape, speculative=True) == pytest.approx(got["pool"]["EAGLE"], rel=1e-12)


def test_model_facts_agree_with_the_step_bench() -> None:
    s = M.ModelShape()
    assert (s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.head_dim, s.q_lora_rank, s.o_lora_rank,
            s.o_groups, s.index_n_heads, s.index_head_dim, s.n_routed_experts, s.moe_intermediate_size,
            s.vocab_size, s.hc_mult, s.window_size) == \
        (step.HIDDEN, step.N_LAYERS, step.N_HEADS, step.HEAD_DIM, step.Q_LORA, step.O_LORA, step.O_GROUPS,
         step.INDEX_HEADS, step.INDEX_DIM, step.N_EXPERTS, step.MOE_INTER, step.VOCAB, step.HC_MULT, step.WINDOW)
    assert s.compress_ratios == step.COMPRESS_RATIOS
    for tp in (2, 4):  # the bench's bytes of one expert on one GPU (fp32 scales), written independently
        assert M.routed_experts_bytes(s, tp) == step.N_EXPERTS * step.moe_expert_bytes(tp)


def test_tp2_weights_by_hand() -> None:
    """The number the docs state: 86.0 GiB of weights per GPU at TP2 (43.6 at TP4)."""
    # routed experts: 256 experts x (w13 2x1024x4096 + w2 4096x1024) weights at TP2, half a byte each,
    # + one fp32 scale per 32 weights, in 43 layers
    per_expert = 3 * 1024 * 4096
    experts = 43 * 256 * (per_expert // 2 + per_expert // 32 * 4)
    assert experts == 43 * 2_013_265_920
    w = M.target_weights(M.ModelShape(), 2)
    assert w.experts == experts
    # the split dense weights: wq_b 32768x1024 fp8, wo_a 8192x4096 bf16, wo_b 4096x8192 fp8, shared expert
    # 4096x4096 + 4096x2048 fp8 (each + fp32 128x128 block scales) per layer; embedding + lm_head bf16
    dense = 32768 * 1024 + 256 * 8 * 4 + 8192 * 4096 * 2 + 4096 * 8192 + 32 * 64 * 4 \
        + 4096 * 4096 + 32 * 32 * 4 + 4096 * 2048 + 32 * 16 * 4
    assert w.split == (43 * dense + 2 * 129280 * 4096 * 2) // 2
    assert w.total / GIB == pytest.approx(86.02, abs=0.01)
    assert M.target_weights(M.ModelShape(), 4).total / GIB == pytest.approx(43.62, abs=0.01)
    assert M.mtp_weights(M.ModelShape(), 2).total / GIB == pytest.approx(1.99, abs=0.01)
    # the issue-21 repack (uint8 scales) takes a quarter of the scale bytes
    assert M.target_weights(M.ModelShape(), 2, scale_bytes=1).total / GIB == pytest.approx(73.93, abs=0.01)


@pytest.mark.parametrize("tp, frac, spec, status, needle", [
    (4, 0.70, False, "ok", "fits"),
    (4, 0.70, True, "ok", "fits"),
    (2, 0.70, False, "error", "do not fit in the static pool"),
    (2, 0.94, False, "warn", "SGLang's own default leaves 10 GiB"),
    (2, 0.94, True, "warn", "less than one request at the context length 131,072"),
    (4, 0.95, False, "warn", "4.7 GiB per GPU stays outside the static pool"),
])
def test_fit_verdicts(tp: int, frac: float, spec: bool, status: str, needle: str) -> None:
    f = M.fit("decode-0", "decode", 0, tp, 97887, frac, 131072, spec)
    assert f.status == status and needle in f.finding, f.finding
    if status != "ok":
        assert f.fix and ("mem_fraction_static" in f.fix or "TP" in f.fix)
    assert f.kv_gib == pytest.approx(frac * (97887 / 1024 - 1.0) - f.weights_gib, abs=0.02)
    assert f.mtp_gib > 0 if spec else f.mtp_gib == 0


def test_error_fix_names_a_fraction_that_fits() -> None:
    f = M.fit("decode-1", "decode", 1, 2, 97887, 0.70, 131072, False)
    assert "--set decode.1.mem_fraction_static=0.93 " in f.fix
    # the smallest fraction (in hundredths) whose pool holds one request at the context length
    assert M.fit("decode-1", "decode", 1, 2, 97887, 0.93, 131072, False).kv_tokens >= 131072
    assert M.fit("decode-1", "decode", 1, 2, 97887, 0.92, 131072, False).kv_tokens < 131072


CARDS_MIB = (900, 24576, 49152, 97887, 143771)  # a card too small for its own runtime up to an H200


@pytest.mark.parametrize("card", CARDS_MIB)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("ctx", [None, 131072, 1048576])
def test_a_suggested_fraction_is_below_1_above_0_and_works(card: int, tp: int, ctx: int | None) -> None:
    """Whatever the card, TP and context, a fix names only a mem_fraction_static SGLang takes, and one
    that fixes what was found (the pool then holds the weights, and one request at the context length)."""
    for frac in (0.5, 0.7, 0.94):
        for spec in (False, True):
            f = M.fit("decode-0", "decode", 0, tp, card, frac, ctx, spec)
            assert f.status == "ok" or f.fix, f
            for value in re.findall(r"mem_fraction_static=(\S+)", f.fix):
                suggested = float(value)
                assert 0 < suggested < 1, (card, tp, ctx, frac, spec, f.fix)
                again = M.fit("decode-0", "decode", 0, tp, card, suggested, ctx, spec)
                assert again.kv_gib > 0 and (again.status != "error"), (f.fix, again.finding)
                if "and a shorter engine.context_length" not in f.fix:
                    assert again.kv_tokens >= (ctx or 0), (f.fix, again.finding)
            for value in re.findall(r"context_length=(\d+)", f.fix):
                assert 0 < int(value) < (ctx or 0), f.fix


def test_weights_that_fit_no_fraction_get_a_fix_that_is_not_a_fraction() -> None:
    f = M.fit("server-0", "server", 0, 1, 97887, 0.7, None, False)  # TP1: ~170 GiB of weights on a 96 GiB card
    assert f.status == "error" and "mem_fraction_static=" not in f.fix
    assert "larger TP" in f.fix and "larger card" in f.fix
    tiny = M.fit("d", "decode", 0, 4, 900, 0.7, None, False)  # less memory than the runtime takes
    assert tiny.status == "error" and "mem_fraction_static=" not in tiny.fix, tiny.fix


def test_a_context_no_fraction_holds_is_fixed_by_a_shorter_context() -> None:
    f = M.fit("decode-0", "decode", 0, 2, 97887, 0.94, 1048576, True)
    assert f.status == "warn" and "less than one request" in f.finding
    assert "mem_fraction_static=" not in f.fix and f"--set engine.context_length={f.kv_tokens} " in f.fix


def test_card_from_topology_or_assumed() -> None:
    assert M.fit("d", "decode", 0, 4, 49152, 0.7, None, False).status == "error"  # a 48 GB card
    f = M.fit("d", "decode", 0, 4, None, 0.7, None, False)
    assert f.card_source == "assumed" and f.card_mib == M.RTX6000_MIB
    unset = M.fit("d", "decode", 0, 4, 97887, None, None, False)
    assert unset.fraction_source.startswith("sglang default") and unset.headroom_gib == pytest.approx(10 - 0.1, abs=0.2)
    assert unset.status == "ok"  # SGLang's own default is not "less than SGLang's own default"
    assert M.fit("d", "decode", 0, 4, 97887, None, None, True).mem_fraction_static < unset.mem_fraction_static


def _plan(*sets: str, profile: str = "rtx6000-8x-pd-2xtp2", rehearse: bool = False, strict: bool = False):
    cfg = load_config(profile=profile, env={}, sets=sets)
    return build_plan(cfg, Host.remote(load_topology(T8)), rehearse=rehearse, require_gpus=strict)


def test_2xtp2_plan_memory_rows_and_warnings() -> None:
    plan = _plan()
    fits = {f.worker: f for f in plan.memory}
    assert set(fits) == {"prefill-0", "decode-0", "decode-1"}
    assert fits["prefill-0"].tp == 4 and fits["prefill-0"].status == "ok"
    for name in ("decode-0", "decode-1"):
        f = fits[name]
        # the moe switch's e8m0 expert scales: 73.9 GiB at TP2; the pool holds the 32 8K-token streams its graphs cover
        assert (f.tp, f.mem_fraction_static, f.card_source, f.status) == (2, 0.85, "topology", "ok")
        assert f.kv_tokens >= 32 * 8192 and f.weights_gib == pytest.approx(73.9, abs=0.05)
        assert (f.graph_max_bs, f.graph_rows) == (32, 96)
    assert not plan.warned("memory-tight", "memory-unfit")
    # the pinned fp32 scales (moe switch off): 86.0 GiB, which 0.85 cannot hold
    off = {f.worker: f for f in _plan("patches.moe=false").memory}
    assert off["decode-0"].weights_gib == pytest.approx(86.02, abs=0.01) and off["decode-0"].status == "error"


def test_weights_that_cannot_fit_refuse_up_and_warn_plan() -> None:
    sets = ("decode.0.mem_fraction_static=0.7",)
    plan = _plan(*sets)  # `plan`: shown, with what `up` will do
    assert [w.text.startswith("memory: decode-0: weights 73.9 GiB") and "`up` will refuse it" in w.text
            for w in plan.warned("memory-unfit")] == [True]
    rehearsal = _plan(*sets, rehearse=True)  # `up --rehearse`
    assert ["rehearsal loads no weights" in w.text for w in rehearsal.warned("memory-unfit")] == [True]
    with pytest.raises(UserError) as e:  # a real `up`
        _plan(*sets, strict=True)
    assert "decode-0: weights 73.9 GiB per GPU at TP2 do not fit" in e.value.message
    assert "--set decode.0.mem_fraction_static=0.82 " in e.value.hint


def test_default_profile_fits_without_a_word() -> None:
    plan = _plan(profile="rtx6000-8x-pd")
    assert [f.status for f in plan.memory] == ["ok", "ok"]
    assert not plan.warned("memory-unfit", "memory-tight")


def test_doctor_rows_redo_the_arithmetic_with_the_checkpoints_config(tmp_path: Path) -> None:
    plan = _plan(profile="rtx6000-8x-pd")
    model = tmp_path / "m"
    model.mkdir()
    inp = DoctorInput(Expect(model_path=str(model), memory=plan.memory), load_topology(T8), system_probe())
    rows = {c.name: c for c in dmemory.run(inp)}
    assert set(rows) == {"memory-prefill-0", "memory-decode-0"}
    assert rows["memory-decode-0"].status == "ok" and "weights 37.6 GiB" in rows["memory-decode-0"].detail
    assert "DeepSeek-V4-Flash's config (no readable config.json)" in rows["memory-decode-0"].detail
    # a checkpoint with twice the experts: the same worker no longer fits
    (model / "config.json").write_text(json.dumps({"n_routed_experts": 512, "num_hidden_layers": 43}))
    rows = {c.name: c for c in dmemory.run(inp)}
    c = rows["memory-decode-0"]
    assert c.status == "error" and "do not fit" in c.detail and str(model / "config.json") in c.detail and c.fix
