"""Pure parts of the stand-in: argv parsing, env knobs, deterministic text, request parsing."""

from __future__ import annotations

import pytest

from v4flash_pd.arith import extract_final_number, make_problems, prompt_for
from v4flash_pd.rehearsal import REHEARSAL_MARK
from v4flash_pd.rehearsal import protocol as P
from v4flash_pd.rehearsal.args import parse_engine_args
from v4flash_pd.rehearsal.knobs import KnobError, knobs_from_env
from v4flash_pd.rehearsal.textgen import generate, is_corrupted, prompt_from_text

# The argv shape the plan builds for the reference box (tests/launcher/test_launcher_plan.py checks the plan's).
PLAN_ARGV = ("--model-path /models/dsv4 --trust-remote-code --tp 4 --host 127.0.0.1 --port 30000 "
             "--disaggregation-mode prefill --disaggregation-transfer-backend nixl "
             "--disaggregation-bootstrap-port 8998 --moe-runner-backend marlin "
             "--kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.70 --numa-node 0 0 0 0 "
             "--enable-metrics --cuda-graph-max-bs 32 --served-model-name dsv4").split()


def test_parses_plan_argv_and_keeps_unknown_flags_aside() -> None:
    a = parse_engine_args(PLAN_ARGV)
    assert (a.tp_size, a.port, a.host) == (4, 30000, "127.0.0.1")
    assert a.disaggregation_mode == "prefill" and a.role == "prefill"
    assert a.disaggregation_transfer_backend == "nixl"
    assert a.disaggregation_bootstrap_port == 8998
    assert a.kv_cache_dtype == "fp8_e4m3"
    assert a.model_name == "dsv4"
    assert "--numa-node" in a.ignored and "--enable-metrics" in a.ignored


def test_defaults_match_sglang() -> None:
    a = parse_engine_args(["--model-path", "/m"])
    assert (a.disaggregation_mode, a.disaggregation_bootstrap_port, a.port, a.tp_size) == \
        ("null", 8998, 30000, 1)
    assert a.role == "server" and a.model_name == "/m"
    assert parse_engine_args(["--model", "/x", "--tp-size", "2"]).tp_size == 2


@pytest.mark.parametrize("argv", [
    ["--model-path", "/m", "--disaggregation-transfer-backend", "ucx"],
    ["--model-path", "/m", "--disaggregation-mode", "both"],
    ["--tp", "4"],  # --model-path is required, as in SGLang
    ["--model-path", "/m", "--port", "70000"],
])
def test_rejects_what_sglang_rejects(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_engine_args(argv)
    assert e.value.code == 2


def test_knobs_defaults_and_values() -> None:
    k = knobs_from_env({})
    assert k.load_seconds == 1.0 and k.corrupt_rate == 0.0 and k.crash_after_s is None
    k = knobs_from_env({"V4FLASH_REHEARSAL_LOAD_SECONDS": "2.5", "V4FLASH_REHEARSAL_TTFT_MS": "40",
                        "V4FLASH_REHEARSAL_ITL_MS": "5", "V4FLASH_REHEARSAL_CORRUPT": "1",
                        "V4FLASH_REHEARSAL_CRASH_AFTER_S": "3"})
    assert (k.load_seconds, k.ttft_ms, k.itl_ms, k.corrupt_rate, k.crash_after_s) == \
        (2.5, 40.0, 5.0, 1.0, 3.0)
    assert knobs_from_env({"V4FLASH_REHEARSAL_CORRUPT": "0.25"}).corrupt_rate == 0.25


@pytest.mark.parametrize("env", [
    {"V4FLASH_REHEARSAL_LOAD_SECONDS": "soon"},
    {"V4FLASH_REHEARSAL_ITL_MS": "-1"},
    {"V4FLASH_REHEARSAL_CORRUPT": "2"},
    {"V4FLASH_REHEARSAL_CORRUPT": "sometimes"},
    {"V4FLASH_REHEARSAL_CRASH_EXIT_CODE": "0"},
])
def test_bad_knobs_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(KnobError) as e:
        knobs_from_env(env)
    assert next(iter(env)) in str(e.value)


def test_generation_is_deterministic_and_counts_words() -> None:
    p = prompt_from_text("tell me something")
    a, b = generate(p, 128), generate(p, 128)
    assert a == b
    assert a.words[0] == REHEARSAL_MARK and a.finish == "stop"
    assert a.n_tokens == len(a.text.split())
    assert p.n_tokens == 3


def test_budget_and_ignore_eos() -> None:
    p = prompt_from_text("hello")
    short = generate(p, 5)
    assert short.n_tokens == 5 and short.finish == "length"
    assert generate(p, 0).n_tokens == 0
    natural = generate(p, 10_000)
    assert natural.finish == "stop" and natural.n_tokens < 10_000
    forced = generate(p, 300, ignore_eos=True)
    assert forced.n_tokens == 300 and forced.finish == "length"
    assert len(forced.text.split()) == 300


def test_stream_deltas_rebuild_the_text() -> None:
    c = generate(prompt_from_text("x y z"), 12)
    assert "".join(c.delta(i) for i in range(c.n_tokens)) == c.text
    assert c.text_upto(3) == " ".join(c.words[:3])


def test_arithmetic_answers_right_and_corrupt_answers_wrong() -> None:
    problems = make_problems(24, seed=1)
    for pr in problems:
        right = generate(prompt_from_text(prompt_for(pr)), 256)
        assert right.text.startswith(REHEARSAL_MARK)
        assert extract_final_number(right.text) == pr.answer
        wrong = generate(prompt_from_text(prompt_for(pr)), 256, corrupt_rate=1.0)
        assert extract_final_number(wrong.text) != pr.answer


def test_partial_corruption_rate_is_deterministic_and_roughly_right() -> None:
    digests = [prompt_from_text(prompt_for(p)).digest for p in make_problems(400, seed=9)]
    hits = [is_corrupted(d, 0.5) for d in digests]
    assert hits == [is_corrupted(d, 0.5) for d in digests]
    assert 120 < sum(hits) < 280


def test_parse_generate_and_openai_requests() -> None:
    g = P.parse_generate({"text": "a b", "sampling_params": {"max_new_tokens": 7},
                          "bootstrap_host": "127.0.0.1", "bootstrap_port": None,
                          "bootstrap_room": 123, "stream": True})
    assert (g.max_new_tokens, g.bootstrap_room, g.bootstrap_port, g.stream) == (7, 123, None, True)
    assert P.parse_generate({"input_ids": [1, 2, 3]}).prompt.n_tokens == 3
    assert P.parse_generate({"text": "q"}).max_new_tokens == P.DEFAULT_MAX_NEW_TOKENS
    c = P.parse_completions({"prompt": "hi", "stream_options": {"include_usage": True}})
    assert c.max_new_tokens == 16 and c.include_usage
    ch = P.parse_chat({"messages": [{"role": "user", "content": "hi"}],
                       "max_completion_tokens": 3})
    assert ch.max_new_tokens == 3 and ch.api == P.API_CHAT
    assert P.parse_chat({"messages": [{"role": "user", "content": "hi"}]}).max_new_tokens is None


@pytest.mark.parametrize("fn,body", [
    (P.parse_generate, {}),
    (P.parse_generate, {"text": ["a", "b"]}),
    (P.parse_generate, {"text": "a", "sampling_params": {"max_new_tokens": -1}}),
    (P.parse_generate, {"text": "a", "bootstrap_room": "x"}),
    (P.parse_completions, {"prompt": 5}),
    (P.parse_chat, {"messages": []}),
])
def test_bad_requests(fn, body) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(P.BadRequest):
        fn(body)


def test_openai_chunks_carry_usage_only_when_asked() -> None:
    req = P.parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                        "stream": True, "stream_options": {"include_usage": True}})
    comp = generate(req.prompt, 3)
    chunks = [c for _, c in P.openai_chunks(req, comp, "m", 0)]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    no_usage = P.parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert all("usage" not in c for _, c in P.openai_chunks(no_usage, comp, "m", 0))


def test_bind_delay_knob() -> None:
    assert knobs_from_env({"V4FLASH_REHEARSAL_BIND_DELAY_S": "2"}).bind_delay_s == 2.0
    assert knobs_from_env({}).bind_delay_s == 0.0
