"""The stand-in with speculative-decoding flags: accepted as the pinned sglang accepts them, refused
where its DeepSeek-V4 hook refuses them, reported in /server_info and in a finished request's
meta_info under SGLang's field names (what `v4flash-pd bench` and `eval` read)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from rehearsal_procs import PY, REPO, post_json, request, sse_events

from v4flash_pd.rehearsal.args import parse_engine_args, speculative_problem
from v4flash_pd.rehearsal.knobs import KnobError, knobs_from_env
from v4flash_pd.rehearsal.protocol import spec_metrics

SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4"]


def _flags(**over: str) -> list[str]:
    pairs = dict(zip(SPEC[::2], SPEC[1::2]))
    for k, v in over.items():
        pairs["--speculative-" + k.replace("_", "-")] = v
    return [x for kv in pairs.items() for x in kv if x != ""]


@pytest.mark.parametrize("flags, needle", [
    (_flags(algorithm="NEXTN"), "Only EAGLE speculative algorithm is supported"),
    (_flags(algorithm="eagle"), "Only EAGLE speculative algorithm is supported"),
    (_flags(eagle_topk="2"), "topk == 1"),
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"], "topk == 1"),  # top-k unset = None
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"], "--speculative-num-steps unset"),
    (SPEC + ["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"],
     "--disaggregation-decode-enable-radix-cache is incompatible with speculative decoding"),
])
def test_the_stand_in_refuses_what_the_pinned_hook_refuses(flags: list[str], needle: str) -> None:
    argv = ["--model-path", "m", "--port", "30000", *flags]
    assert needle in speculative_problem(parse_engine_args(argv))
    res = subprocess.run([PY, "-m", "v4flash_pd.rehearsal.engine", *argv], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert res.returncode == 1 and needle in res.stderr, res.stderr


def test_accepted_flags_and_the_silent_draft_token_fix() -> None:
    a = parse_engine_args(["--model-path", "m", *SPEC])
    assert speculative_problem(a) == "" and a.speculative
    assert (a.speculative_algorithm, a.speculative_num_steps, a.speculative_eagle_topk,
            a.speculative_num_draft_tokens) == ("EAGLE", 3, 1, 4)
    assert a.ignored == ()
    # as speculative_hook.py at top-k 1: num_draft_tokens becomes num_steps + 1 (the launcher refuses it)
    b = parse_engine_args(["--model-path", "m", *_flags(num_draft_tokens="7")])
    assert b.speculative_num_draft_tokens == 4
    off = parse_engine_args(["--model-path", "m", "--disaggregation-decode-enable-radix-cache",
                             "--disaggregation-mode", "decode"])
    assert not off.speculative and speculative_problem(off) == ""  # the radix cache alone is fine


def test_spec_metrics_follow_sglangs_definitions() -> None:
    # 10 tokens, the first from prefill: 9 from verifies at 2.5 tokens each -> ceil(3.6) = 4 verifies
    m = spec_metrics(10, 9, 4, 2.5)
    assert m["spec_verify_ct"] == 4 and m["spec_accept_length"] == 10 / 4
    assert m["spec_num_correct_drafts"] == 9 - 4 and m["spec_num_proposed_drafts"] == 4 * 3
    assert m["spec_accept_rate"] == pytest.approx(5 / 12)
    assert spec_metrics(1, 0, 4, 2.5) == {}  # no verify ran: SGLang writes nothing
    full = spec_metrics(17, 16, 4, 4.0)  # every draft accepted
    assert full["spec_verify_ct"] == 4 and full["spec_accept_rate"] == 1.0


def test_accept_length_knob_is_checked() -> None:
    assert knobs_from_env({"V4FLASH_REHEARSAL_ACCEPT_LENGTH": "2.5"}).accept_length == 2.5
    assert knobs_from_env({"V4FLASH_REHEARSAL_SPEC_CORRUPT": "on"}).spec_corrupt_rate == 1.0
    with pytest.raises(KnobError, match="must be >= 1"):
        knobs_from_env({"V4FLASH_REHEARSAL_ACCEPT_LENGTH": "0.5"})
    with pytest.raises(KnobError, match="between 0 and 1"):
        knobs_from_env({"V4FLASH_REHEARSAL_SPEC_CORRUPT": "2"})


def test_server_info_and_meta_info_report_speculation(start_engine) -> None:
    e = start_engine(extra=SPEC, env={"V4FLASH_REHEARSAL_ACCEPT_LENGTH": "2.5"})
    assert "speculative=EAGLE:3/1/4" in e.text()
    info = json.loads(request("GET", e.port, "/server_info")[2])
    assert (info["speculative_algorithm"], info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == ("EAGLE", 3, 1, 4)
    assert "avg_spec_accept_length" not in info["internal_states"][0]  # no verify yet
    body = {"text": "one two", "sampling_params": {"max_new_tokens": 11, "ignore_eos": True}}
    status, reply = post_json(e.port, "/generate", body)
    mi = reply["meta_info"]
    assert status == 200 and mi["completion_tokens"] == 11
    assert mi["spec_verify_ct"] == math.ceil(10 / 2.5) == 4 and mi["spec_accept_length"] == 11 / 4
    raw = request("POST", e.port, "/generate", {**body, "stream": True})[2]
    chunks = sse_events(raw)[:-1]
    assert "spec_verify_ct" in chunks[-1]["meta_info"]  # only on the finished chunk, as SGLang
    assert not any("spec_verify_ct" in c["meta_info"] for c in chunks[:-1])
    info = json.loads(request("GET", e.port, "/server_info")[2])
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(20 / 8)


def test_without_speculation_nothing_is_reported(start_engine) -> None:
    e = start_engine()
    _, reply = post_json(e.port, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 9}})
    assert not any(k.startswith("spec_") for k in reply["meta_info"])
    info = json.loads(request("GET", e.port, "/server_info")[2])
    assert info["speculative_algorithm"] is None and "avg_spec_accept_length" not in info["internal_states"][0]


def test_spec_corrupt_knob_breaks_answers_only_with_speculation(start_engine) -> None:
    from v4flash_pd.arith import make_problems, prompt_for

    p = make_problems(1, seed=5)[0]
    body = {"text": prompt_for(p), "sampling_params": {"max_new_tokens": 64}}
    env = {"V4FLASH_REHEARSAL_SPEC_CORRUPT": "1"}
    honest = start_engine("plain", env=env)
    spec = start_engine("spec", extra=SPEC, env=env)
    assert f"The answer is {p.answer}." in post_json(honest.port, "/generate", body)[1]["text"]
    assert f"The answer is {p.answer}." not in post_json(spec.port, "/generate", body)[1]["text"]
