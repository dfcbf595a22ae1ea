"""The stand-in as a real subprocess on 127.0.0.1: endpoints, PD handshake failures, signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from rehearsal_procs import HOST, engine_argv, free_ports, post_json, request, spawn, sse_events, wait_status

from v4flash_pd.arith import make_problems, prompt_for
from v4flash_pd.rehearsal import REHEARSAL_HEADER, REHEARSAL_MARK


def test_health_is_503_while_loading_then_200(start_engine) -> None:
    e = start_engine(env={"V4FLASH_REHEARSAL_LOAD_SECONDS": "1.5"}, wait=False)
    wait_status(e.port, "/ping", 200, timeout=15)
    for path in ("/health", "/health_generate"):
        assert request("GET", e.port, path)[0] == 503
    status, _ = post_json(e.port, "/generate", {"text": "hi"})
    assert status == 503
    took = wait_status(e.port, "/health", 200, timeout=15)
    assert took > 0.3
    assert request("GET", e.port, "/health_generate")[0] == 200
    assert '"rehearsal": "ready"' in e.text()
    assert "rehearsal stand-in" in e.text() and "role=server" in e.text()


def test_info_endpoints(start_engine) -> None:
    e = start_engine(extra=["--served-model-name", "dsv4-flash", "--numa-node", "0", "0", "0",
                            "0", "--enable-metrics", "--cuda-graph-max-bs", "32"])
    for path in ("/server_info", "/get_server_info"):
        status, headers, body = request("GET", e.port, path)
        info = json.loads(body)
        assert status == 200 and headers[REHEARSAL_HEADER.lower()] == "1"
        assert info["rehearsal"] is True and info["tp_size"] == 4
        assert info["disaggregation_mode"] == "null" and info["dp_size"] == 1
        assert info["version"].startswith("0.5.13")
        assert "--enable-metrics" in info["ignored_args"]
    for path in ("/model_info", "/get_model_info"):
        info = json.loads(request("GET", e.port, path)[2])
        assert info["model_path"] == "/models/DeepSeek-V4-Flash" and info["is_generation"]
    models = json.loads(request("GET", e.port, "/v1/models")[2])
    assert [m["id"] for m in models["data"]] == ["dsv4-flash"]
    assert request("GET", e.port, "/v1/models/dsv4-flash")[0] == 200
    assert request("GET", e.port, "/v1/models/other")[0] == 404
    load = json.loads(request("GET", e.port, "/get_load")[2])
    assert load[0]["dp_rank"] == 0 and "num_tokens" in load[0]
    assert request("GET", e.port, "/ping")[0] == 200
    assert request("GET", e.port, "/flush_cache")[0] == 200
    assert request("POST", e.port, "/flush_cache")[0] == 200
    assert request("GET", e.port, "/no_such_endpoint")[0] == 404


def test_generate_plain_and_streamed(start_engine) -> None:
    e = start_engine()
    status, headers, raw = request("POST", e.port, "/generate",
                                   {"text": "one two three", "sampling_params":
                                    {"max_new_tokens": 5}})
    body = json.loads(raw)
    assert status == 200 and headers[REHEARSAL_HEADER.lower()] == "1"
    assert body["text"].startswith(REHEARSAL_MARK)
    mi = body["meta_info"]
    assert mi["completion_tokens"] == 5 == len(body["text"].split())
    assert mi["prompt_tokens"] == 3
    assert mi["finish_reason"]["type"] == "length" and "e2e_latency" in mi and mi["id"]

    status, headers, raw = request("POST", e.port, "/generate",
                                   {"text": "one two three", "stream": True,
                                    "sampling_params": {"max_new_tokens": 5}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1]["text"] == body["text"]  # cumulative, like SGLang's default
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    natural = post_json(e.port, "/generate", {"input_ids": [5, 6, 7]})[1]
    assert natural["meta_info"]["finish_reason"]["type"] == "stop"
    assert natural["meta_info"]["prompt_tokens"] == 3


def test_openai_completions_and_chat(start_engine) -> None:
    e = start_engine()
    status, body = post_json(e.port, "/v1/completions", {"model": "x", "prompt": "hello there",
                                                        "max_tokens": 4})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"].startswith(REHEARSAL_MARK)
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6,
                             "prompt_tokens_details": None}
    status, body = post_json(e.port, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
    assert status == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith(REHEARSAL_MARK)
    assert body["usage"]["completion_tokens"] == 6 == len(msg["content"].split())

    for path, req in (("/v1/completions", {"prompt": "hello there", "max_tokens": 4}),
                      ("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
        raw = request("POST", e.port, path, {**req, "stream": True,
                                             "stream_options": {"include_usage": True}})[2]
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
        pieces = []
        for ev in events[:-2]:
            ch = ev["choices"][0]
            pieces.append(ch.get("text") if "text" in ch else ch["delta"].get("content") or "")
        assert "".join(pieces).startswith(REHEARSAL_MARK)
        assert len("".join(pieces).split()) == 4
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        no_usage = sse_events(request("POST", e.port, path, {**req, "stream": True})[2])
        assert all("usage" not in ev for ev in no_usage[:-1])


def test_bad_requests_get_400(start_engine) -> None:
    e = start_engine()
    status, body = post_json(e.port, "/generate", {"sampling_params": {}})
    assert status == 400 and "text" in body["error"]["message"]
    status, _, _ = request("POST", e.port, "/generate", None)
    assert status == 400
    status, body = post_json(e.port, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and body["code"] == 400


def test_arithmetic_right_then_corrupted(start_engine) -> None:
    problems = make_problems(6, seed=4)
    good = start_engine("good")
    bad = start_engine("bad", env={"V4FLASH_REHEARSAL_CORRUPT": "1"})
    for p in problems:
        ok = post_json(good.port, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": prompt_for(p)}],
                        "max_tokens": 200})[1]["choices"][0]["message"]["content"]
        assert ok.endswith(f"The answer is {p.answer}.")
        wrong = post_json(bad.port, "/generate", {"text": prompt_for(p),
                                                  "sampling_params": {"max_new_tokens": 200}})[1]
        assert "The answer is" in wrong["text"]
        assert not wrong["text"].endswith(f"The answer is {p.answer}.")


def test_ttft_and_itl_knobs_shape_timing(start_engine) -> None:
    e = start_engine(env={"V4FLASH_REHEARSAL_TTFT_MS": "300", "V4FLASH_REHEARSAL_ITL_MS": "50"})
    t0 = time.monotonic()
    post_json(e.port, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 5}})
    took = time.monotonic() - t0
    assert 0.45 <= took < 3.0  # 300 + 4 * 50 ms


def test_prefill_requires_a_bootstrap_room(start_engine) -> None:
    pf, boot = free_ports(2)
    e = start_engine("prefill", mode="prefill", port=pf, boot_port=boot)
    status, body = post_json(pf, "/generate", {"text": "hi"})
    assert status == 400 and "bootstrap room" in body["error"]["message"]
    # The health-check style request (fake bootstrap host) needs no peer, like SGLang's.
    status, _ = post_json(pf, "/generate", {"text": "hi", "bootstrap_host": "2.2.2.2",
                                             "bootstrap_room": 0})
    assert status == 200
    # A real room with no decode to take it: prefill times out like a stuck KV transfer.
    status, body = post_json(pf, "/generate", {"text": "hi", "bootstrap_host": HOST,
                                                "bootstrap_port": boot, "bootstrap_room": 9})
    assert status == 500 and "no decode fetched it" in body["message"]
    assert any(r.get("rehearsal") == "room_registered" and r["bootstrap_room"] == 9
               for r in e.records())


def test_prefill_bootstrap_server_speaks_sglang_route(start_engine) -> None:
    pf, boot = free_ports(2)
    start_engine("prefill", mode="prefill", port=pf, boot_port=boot)
    assert request("GET", boot, "/health")[0] == 200
    q = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    status, _, body = request("GET", boot, "/route?" + q)
    assert status == 200 and json.loads(body)["attn_tp_size"] == 4
    assert request("GET", boot, "/route")[0] == 400


def test_decode_failures_say_why(start_engine) -> None:
    dc, pf, boot, dead = free_ports(4)
    e = start_engine("decode", mode="decode", port=dc)
    base = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    # no room at all: rejected before any transfer (400, SGLang's message)
    status, body = post_json(dc, "/generate", base)
    assert status == 400 and "without bootstrap room id" in body["error"]["message"]
    # bootstrap server unreachable
    t0 = time.monotonic()
    status, body = post_json(dc, "/generate", {**base, "bootstrap_host": HOST,
                                               "bootstrap_port": dead, "bootstrap_room": 1})
    assert status == 500 and "Decode handshake failed" in body["message"]
    assert f"{HOST}:{dead}" in body["message"]
    assert time.monotonic() - t0 < 5  # bounded by V4FLASH_REHEARSAL_WAITING_TIMEOUT_S=1
    # bootstrap server up, room never registered
    start_engine("prefill", mode="prefill", port=pf, boot_port=boot)
    status, body = post_json(dc, "/generate", {**base, "bootstrap_host": HOST,
                                               "bootstrap_port": boot, "bootstrap_room": 77})
    assert status == 500 and "bootstrap_room 77 never appeared" in body["message"]
    # missing host
    status, body = post_json(dc, "/generate", {**base, "bootstrap_room": 5})
    assert status == 500 and "bootstrap_host is missing" in body["message"]
    # streamed: SGLang has already answered 200 and puts the abort into the stream
    status, _, raw = request("POST", dc, "/generate", {**base, "stream": True,
                                                       "bootstrap_host": HOST,
                                                       "bootstrap_port": dead,
                                                       "bootstrap_room": 2})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[0]["meta_info"]["finish_reason"]["status_code"] == 500
    # the engine logs a streamed request after its last byte, so the client may read [DONE] first
    deadline = time.monotonic() + 5
    while True:
        failed = [r for r in e.records() if r.get("path") == "/generate" and r.get("error")]
        if {r["bootstrap_room"] for r in failed} >= {1, 77, 5, 2} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {r["bootstrap_room"] for r in failed} >= {1, 77, 5, 2}


def test_decode_detects_a_prompt_that_does_not_match_prefills_kv(start_engine) -> None:
    import threading
    dc, pf, boot = free_ports(3)
    start_engine("prefill", mode="prefill", port=pf, boot_port=boot)
    start_engine("decode", mode="decode", port=dc)
    room = {"bootstrap_host": HOST, "bootstrap_port": boot, "bootstrap_room": 4242}
    results: dict[str, tuple[int, object]] = {}
    t = threading.Thread(target=lambda: results.__setitem__(
        "p", post_json(pf, "/generate", {"text": "the real prompt", **room})))
    t.start()
    results["d"] = post_json(dc, "/generate", {"text": "another prompt", **room})
    t.join(10)
    status, body = results["d"]
    assert status == 500 and "KV mismatch" in body["message"]  # type: ignore[index]


def test_decode_uses_its_own_bootstrap_port_when_the_router_sends_null(start_engine) -> None:
    import threading
    dc, pf, boot = free_ports(3)
    start_engine("prefill", mode="prefill", port=pf, boot_port=boot)
    d = start_engine("decode", mode="decode", port=dc, boot_port=boot)
    body = {"text": "same prompt", "bootstrap_host": HOST, "bootstrap_port": None,
            "bootstrap_room": 31337, "sampling_params": {"max_new_tokens": 4}}
    out: dict[str, tuple[int, object]] = {}
    t = threading.Thread(target=lambda: out.__setitem__("p", post_json(pf, "/generate", body)))
    t.start()
    status, reply = post_json(dc, "/generate", body)
    t.join(10)
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 4  # type: ignore[index]
    assert out["p"][0] == 200
    got = [r for r in d.records() if r.get("rehearsal") == "room_received"]
    assert got and got[0]["bootstrap_port"] == boot and got[0]["bootstrap_room"] == 31337


def test_sigterm_exits_zero_quickly(start_engine) -> None:
    pf, boot = free_ports(2)
    e = start_engine("prefill", mode="prefill", port=pf, boot_port=boot)
    t0 = time.monotonic()
    os.kill(e.popen.pid, signal.SIGTERM)
    assert e.popen.wait(5) == 0
    assert time.monotonic() - t0 < 2.0
    # both ports are free again
    for port in (pf, boot):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((HOST, port))


def test_sigint_exits_zero(start_engine) -> None:
    e = start_engine()
    os.kill(e.popen.pid, signal.SIGINT)
    assert e.popen.wait(5) == 0


def test_crash_knob_exits_nonzero(start_engine) -> None:
    e = start_engine(env={"V4FLASH_REHEARSAL_CRASH_AFTER_S": "1.0"})
    assert e.popen.wait(10) == 3
    assert "crashing on purpose" in e.text()


def test_busy_port_is_a_clear_failure(procs, tmp_path) -> None:
    with socket.socket() as s:
        s.bind((HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        p = spawn("busy", engine_argv(port), tmp_path)
        procs.append(p)
        assert p.popen.wait(15) == 1
    assert f"cannot bind the HTTP server on {HOST}:{port}" in p.text()


def test_bad_knob_exits_2(procs, tmp_path) -> None:
    p = spawn("badknob", engine_argv(free_ports(1)[0]), tmp_path,
              {"V4FLASH_REHEARSAL_ITL_MS": "fast"})
    procs.append(p)
    assert p.popen.wait(15) == 2
    assert "V4FLASH_REHEARSAL_ITL_MS" in p.text()


@pytest.mark.parametrize("flag", ["--disaggregation-transfer-backend=ucx",
                                  "--disaggregation-mode=both"])
def test_invalid_sglang_values_exit_2(procs, tmp_path, flag: str) -> None:
    p = spawn("badflag", engine_argv(free_ports(1)[0], extra=[flag]), tmp_path)
    procs.append(p)
    assert p.popen.wait(15) == 2
    assert "invalid choice" in p.text()


def test_one_json_line_per_request(start_engine) -> None:
    e = start_engine()
    for i in range(3):
        post_json(e.port, "/generate", {"text": f"req {i}"})
    # the access record is written after the reply is sent: give the last one a moment (bounded)
    deadline = time.monotonic() + 5
    lines = [r for r in e.records() if r.get("path") == "/generate"]
    while len(lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
        lines = [r for r in e.records() if r.get("path") == "/generate"]
    assert len(lines) == 3
    for r in lines:
        assert {"role", "method", "path", "status", "bootstrap_host", "bootstrap_port",
                "bootstrap_room", "rid", "completion_tokens"} <= set(r)
        assert r["role"] == "server" and r["status"] == 200


def test_bind_delay_refuses_connections_then_loads(start_engine) -> None:
    e = start_engine(env={"V4FLASH_REHEARSAL_BIND_DELAY_S": "1.0",
                          "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.5"}, wait=False)
    time.sleep(0.3)
    with pytest.raises(OSError):
        request("GET", e.port, "/health", timeout=2)
    took = wait_status(e.port, "/health", 200, timeout=15)
    assert took >= 0.9  # refused for ~0.7 s more, then 503 for 0.5 s
    assert "HTTP port opens in" in e.text()


def test_runs_on_the_stdlib_alone(procs, tmp_path) -> None:
    """The slim image has only click + stdlib: `python -S` (no site-packages) must serve."""
    from rehearsal_procs import PY, REPO
    port = free_ports(1)[0]
    argv = [PY, "-S", "-m", "v4flash_pd.rehearsal.engine", "--model-path", "/m", "--host", HOST,
            "--port", str(port)]
    p = spawn("stdlib", argv, tmp_path, {"PYTHONPATH": str(REPO / "launcher"),
                                         "V4FLASH_REHEARSAL_LOAD_SECONDS": "0"})
    procs.append(p)
    wait_status(port, "/health", 200, timeout=15)
    status, body = post_json(port, "/generate", {"text": "hi"})
    assert status == 200 and body["text"].startswith(REHEARSAL_MARK)
