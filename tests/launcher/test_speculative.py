"""Speculative decoding in the launcher: the [speculative] table and `--mtp N` put the same four
flags on every worker and `plan` shows them; every combination the pinned sglang would refuse at
start (or silently change) is refused before anything starts, with `error:` and `fix:`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from v4flash_pd.config.load import load_config
from v4flash_pd.config.speculative import OWNED_FLAGS
from v4flash_pd.errors import UserError

T8 = str(Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json")
FLAGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4")


def _argvs(plan: dict) -> dict[str, list[str]]:
    return {p["name"]: p["argv"] for p in plan["processes"] if p["role"] != "router"}


def _window(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[i:i + len(FLAGS)]


def test_two_draft_steps_by_default_and_off_with_mtp_0(plan_json) -> None:
    """On by default with 2 draft steps (the public evidence for this checkpoint on the card: best at 1
    and at 64 streams); --mtp 0 turns it off."""
    plan = plan_json("--topology", T8)
    for name, argv in _argvs(plan).items():
        assert tuple(_window(argv, "--speculative-algorithm")) == (
            "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "3"), name
    assert plan["config"]["speculative"]["num_steps"] == 2
    off = plan_json("--topology", T8, "--mtp", "0")
    assert not any(a.startswith("--speculative") for argv in _argvs(off).values() for a in argv)
    assert off["speculative"] == "" and off["config"]["speculative"]["num_steps"] == 0


@pytest.mark.parametrize("how", [("--mtp", "3"), ("--set", "speculative.num_steps=3"),
                                 ("--set", "speculative.num_steps=3", "--set", "speculative.num_draft_tokens=4")])
def test_mtp_puts_the_same_flags_on_prefill_and_decode(plan_json, how: tuple[str, ...]) -> None:
    plan = plan_json("--topology", T8, *how)
    argvs = _argvs(plan)
    assert set(argvs) == {"prefill-0", "decode-0"}
    for name, argv in argvs.items():
        assert tuple(_window(argv, "--speculative-algorithm")) == FLAGS, name
        assert sum(a.startswith("--speculative") for a in argv) == 4, name
    assert plan["speculative"].startswith("EAGLE with the MTP layer: 3 draft step(s), top-k 1, 4 tokens verified")
    assert plan["config"]["speculative"] == {"algorithm": "EAGLE", "num_steps": 3, "eagle_topk": 1,
                                             "num_draft_tokens": 4}
    assert "--speculative-algorithm" not in " ".join(next(p for p in plan["processes"] if p["role"] == "router")["argv"])


def test_env_config_file_and_mtp_zero(plan_json, cli, tmp_path: Path) -> None:
    plan = plan_json("--topology", T8, extra_env={"V4FLASH_MTP": "2"})
    assert "--speculative-num-steps" in _argvs(plan)["decode-0"]
    assert plan["config"]["speculative"]["num_draft_tokens"] == 3
    cfg = tmp_path / "spec.toml"
    cfg.write_text("[speculative]\nnum_steps = 1\n")
    plan = plan_json("--topology", T8, "--config", str(cfg))
    assert _window(_argvs(plan)["prefill-0"], "--speculative-algorithm")[3] == "1"
    plan = plan_json("--topology", T8, "--config", str(cfg), "--mtp", "0")  # the flag wins: off
    assert plan["speculative"] == "" and "--speculative-algorithm" not in _argvs(plan)["prefill-0"]


def test_aggregated_server_gets_them_too(plan_json) -> None:
    plan = plan_json("--topology", T8, "--profile", "rtx6000-tp4", "--mtp", "3")
    assert tuple(_window(_argvs(plan)["server-0"], "--speculative-algorithm")) == FLAGS


def test_plan_text_shows_them(cli) -> None:
    res = cli("plan", "--topology", T8, "--mtp", "3")
    assert res.returncode == 0, res.stderr
    assert ("spec     EAGLE with the MTP layer: 3 draft step(s), top-k 1, 4 tokens verified per step "
            "(the same flags on every worker)") in res.stdout
    assert res.stdout.count("--speculative-num-draft-tokens 4") == 2  # prefill's and decode's command
    assert "MTP LAYER" in res.stdout and "0.9 GiB" in res.stdout  # the draft layer in the memory table
    off = cli("plan", "--topology", T8, "--mtp", "0")
    assert "spec     off (--mtp N" in off.stdout


def test_extra_speculative_knobs_go_to_every_worker_through_engine_extra_args(plan_json) -> None:
    plan = plan_json("--topology", T8, "--mtp", "2", "--set",
                     'engine.extra_args=["--speculative-attention-mode", "decode"]')
    for argv in _argvs(plan).values():
        assert argv[-2:] == ["--speculative-attention-mode", "decode"]


def test_decode_radix_cache_without_speculation_is_left_alone(plan_json) -> None:
    plan = plan_json("--topology", T8, "--mtp", "0",
                     "--set", 'decode.0.extra_args=["--disaggregation-decode-enable-radix-cache"]')
    assert _argvs(plan)["decode-0"][-1] == "--disaggregation-decode-enable-radix-cache"


REFUSED = [
    (("--set", "speculative.algorithm=NEXTN", "--mtp", "3"), "accepts only \"EAGLE\"", "speculative.algorithm"),
    (("--set", "speculative.algorithm=eagle", "--mtp", "3"), "upper-cases it only after", "speculative.algorithm"),
    (("--set", "speculative.algorithm=EAGLE3", "--mtp", "3"), "accepts only \"EAGLE\"", "= \"EAGLE\""),
    (("--set", "speculative.eagle_topk=2", "--mtp", "3"), "accepts only eagle_topk = 1", "eagle_topk = 1"),
    (("--set", "speculative.eagle_topk=0", "--mtp", "3"), "accepts only eagle_topk = 1", "eagle_topk = 1"),
    (("--set", "speculative.num_draft_tokens=6", "--mtp", "3"), "replaces it by num_steps + 1 = 4",
     "speculative.num_draft_tokens = 4"),
    (("--mtp", "0", "--set", "speculative.num_draft_tokens=4"), "turns speculative decoding off", "--mtp 3"),
    (("--set", "speculative.num_steps=-1"), "must be >= 0", "speculative.num_steps"),
    (("--mtp", "-1"), "-1", "--mtp"),
    (("--set", 'engine.extra_args=["--speculative-num-steps", "3"]'), "the [speculative] table writes",
     "--mtp N"),
    (("--mtp", "3", "--set", 'prefill.0.extra_args=["--speculative-algorithm=EAGLE"]'),
     "prefill.0.extra_args passes --speculative-algorithm", "--mtp N"),
    (("--mtp", "0", "--set", 'engine.extra_args=["--speculative-attention-mode", "decode"]'),
     "speculative decoding is off", "--mtp N"),
    (("--mtp", "3", "--set", 'decode.0.extra_args=["--speculative-attention-mode", "decode"]'),
     "to decode-0 only", "engine.extra_args"),
    (("--mtp", "3", "--set", 'engine.extra_args=["--disaggregation-decode-enable-radix-cache"]'),
     "refuses the decode radix cache with speculative decoding", "--mtp 0"),
    (("--mtp", "3", "--set", 'decode.0.extra_args=["--disaggregation-decode-enable-radix-cache"]'),
     "decode.0.extra_args passes --disaggregation-decode-enable-radix-cache", "drop"),
    (("--mtp", "3", "--set", 'engine.extra_args=["--pp-size", "2"]'), "pipeline parallelism", "--pp-size"),
    (("--mtp", "3", "--set", 'engine.extra_args=["--enable-lora"]'), "LoRA only with NGRAM", "--enable-lora"),
    (("--mtp", "3", "--set", "env.SGLANG_OPT_USE_ONLINE_COMPRESS=1"), "cannot roll back drafts",
     "SGLANG_OPT_USE_ONLINE_COMPRESS"),
    (("--mtp", "3", "--set", "decode.0.env.SGLANG_OPT_USE_ONLINE_COMPRESS=true"), "decode.0.env sets",
     "remove SGLANG_OPT_USE_ONLINE_COMPRESS"),
    (("--mtp", "65"), "65", "--mtp"),
    # the same bound as --mtp through --set, V4FLASH_SET and a config file (one declaration, keys.py)
    (("--set", "speculative.num_steps=65"), "speculative.num_steps = 65 must be <= 64", "speculative.num_steps="),
    (("--set", "speculative.num_steps=100000"), "must be <= 64", "speculative.num_steps="),
]


@pytest.mark.parametrize("args, needle, fix", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_refused_before_start(cli, args: tuple[str, ...], needle: str, fix: str) -> None:
    res = cli("plan", "--topology", T8, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr
    assert err.startswith("error: ") and "fix: " in err and "Traceback" not in err, err
    head, _, hint = err.partition("fix: ")
    assert needle in head, err
    assert fix in hint or fix in head, err


@pytest.mark.parametrize("args", [REFUSED[0][0], REFUSED[5][0], REFUSED[13][0]], ids=["algorithm", "draft", "radix"])
def test_up_refuses_them_before_anything_starts(cli, tmp_path: Path, args: tuple[str, ...]) -> None:
    run = tmp_path / "run"
    res = cli("up", "--rehearse", "--topology", T8, "--run-dir", str(run), *args)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "fix: " in res.stderr, res.stderr
    assert not run.exists() or not list(run.glob("*.log"))


def test_the_owned_flags_are_exactly_what_the_plan_writes(plan_json) -> None:
    argv = _argvs(plan_json("--topology", T8, "--mtp", "1"))["decode-0"]
    assert tuple(a for a in argv if a.startswith("--speculative")) == OWNED_FLAGS


def test_refusals_name_the_layer_they_came_from() -> None:
    with pytest.raises(UserError) as e:
        load_config(profile="rtx6000-8x-pd", env={}, sets=("speculative.num_steps=2",
                                                             "speculative.num_draft_tokens=5"))
    assert "num_draft_tokens = 5 with num_steps = 2" in e.value.message and "= 3" in e.value.hint


def test_json_plan_roundtrips_the_table(plan_json) -> None:
    plan = plan_json("--topology", T8, "--mtp", "3")
    assert json.loads(json.dumps(plan["config"]["speculative"]))["num_steps"] == 3


def test_a_config_file_and_v4flash_set_take_the_bound_of_mtp(cli, tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[speculative]\nnum_steps = 65\n")
    for res in (cli("plan", "--topology", T8, "--config", str(cfg)),
                cli("plan", "--topology", T8, extra_env={"V4FLASH_SET": "speculative.num_steps=65"})):
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.startswith("error: config key speculative.num_steps = 65 must be <= 64"), res.stderr
        assert "fix: " in res.stderr
    assert cli("plan", "--topology", T8, "--set", "speculative.num_steps=64").returncode == 0
