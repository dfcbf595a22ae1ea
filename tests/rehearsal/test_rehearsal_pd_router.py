"""Prefill + decode stand-ins behind the REAL sglang-router 0.3.2 in PD mode, on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from rehearsal_procs import Proc, free_ports, post_json, request, router_argv, spawn, sse_events, wait_status

from v4flash_pd.arith import make_problems, prompt_for
from v4flash_pd.rehearsal import REHEARSAL_MARK

pytest.importorskip("sglang_router", reason="the real sglang-router is part of the test env")


class Trio:
    def __init__(self, prefill: Proc, decode: Proc, router: Proc, port: int, boot: int) -> None:
        self.prefill, self.decode, self.router, self.port, self.boot = (prefill, decode, router,
                                                                        port, boot)

    def rooms(self, proc: Proc, event: str) -> list[int]:
        return [r["bootstrap_room"] for r in proc.records() if r.get("rehearsal") == event]


@pytest.fixture
def trio(start_engine, procs: list[Proc], tmp_path: Path) -> Callable[..., Trio]:
    def start(router_boot: str | None = "same", env: dict[str, str] | None = None) -> Trio:
        pf, dc, boot, rport, mport = free_ports(5)
        prefill = start_engine("prefill", mode="prefill", port=pf, boot_port=boot, env=env,
                               wait=False)
        decode = start_engine("decode", mode="decode", port=dc, env=env, wait=False)
        wait_status(pf, "/health", 200, timeout=20)
        wait_status(dc, "/health", 200, timeout=20)
        boot_arg = str(boot) if router_boot == "same" else router_boot
        router = spawn("router", router_argv(rport, mport, pf, boot_arg, dc), tmp_path)
        procs.append(router)
        try:
            wait_status(rport, "/readiness", 200, timeout=40)
        except AssertionError:
            raise AssertionError("router never ready; log tail:\n" + router.text()[-3000:]) \
                from None
        return Trio(prefill, decode, router, rport, boot)

    return start


def test_generate_through_router_hands_the_room_from_prefill_to_decode(trio) -> None:
    t = trio()
    status, body = post_json(t.port, "/generate", {"text": "hello through the router",
                                                   "sampling_params": {"max_new_tokens": 6}})
    assert status == 200, body
    assert body["text"].startswith(REHEARSAL_MARK)
    assert body["meta_info"]["completion_tokens"] == 6
    registered = t.rooms(t.prefill, "room_registered")
    received = t.rooms(t.decode, "room_received")
    assert len(registered) == 1 and received == registered
    dec = t.decode.wait_records(lambda r: r.get("path") == "/generate")
    assert dec, "the decode engine logged no /generate within 5 s:\n" + t.decode.text()[-2000:]
    assert dec[-1]["bootstrap_host"] == "127.0.0.1" and dec[-1]["bootstrap_port"] == t.boot
    assert dec[-1]["bootstrap_room"] == registered[0] and dec[-1]["status"] == 200


def test_streaming_through_router(trio) -> None:
    t = trio()
    status, headers, raw = request("POST", t.port, "/generate",
                                   {"text": "stream me", "stream": True,
                                    "sampling_params": {"max_new_tokens": 5}}, timeout=20)
    assert status == 200 and "text/event-stream" in headers.get("content-type", "")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
    assert counts == [1, 2, 3, 4, 5]
    assert events[-2]["text"].startswith(REHEARSAL_MARK)
    assert t.rooms(t.decode, "room_received") == t.rooms(t.prefill, "room_registered")


def test_openai_chat_and_completions_through_router(trio) -> None:
    t = trio()
    p = make_problems(1, seed=21)[0]
    status, body = post_json(t.port, "/v1/chat/completions",
                             {"model": "/models/DeepSeek-V4-Flash", "max_tokens": 200,
                              "messages": [{"role": "user", "content": prompt_for(p)}]})
    assert status == 200, body
    content = body["choices"][0]["message"]["content"]
    assert content.startswith(REHEARSAL_MARK) and content.endswith(f"The answer is {p.answer}.")
    assert body["usage"]["completion_tokens"] == len(content.split())
    status, body = post_json(t.port, "/v1/completions",
                             {"model": "/models/DeepSeek-V4-Flash", "prompt": "abc",
                              "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    raw = request("POST", t.port, "/v1/chat/completions",
                  {"model": "/models/DeepSeek-V4-Flash", "max_tokens": 3, "stream": True,
                   "messages": [{"role": "user", "content": "hi"}],
                   "stream_options": {"include_usage": True}}, timeout=20)[2]
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
    assert len(t.rooms(t.decode, "room_received")) == 3
    assert t.rooms(t.decode, "room_received") == t.rooms(t.prefill, "room_registered")


def test_wrong_bootstrap_port_in_router_wiring_fails_the_request(trio) -> None:
    wrong = free_ports(1)[0]
    t = trio(router_boot=str(wrong), env={"V4FLASH_REHEARSAL_WAITING_TIMEOUT_S": "0.5",
                                          "V4FLASH_REHEARSAL_BOOTSTRAP_TIMEOUT_S": "0.5"})
    status, body = post_json(t.port, "/generate", {"text": "doomed",
                                                   "sampling_params": {"max_new_tokens": 4}},
                             timeout=60)
    assert status >= 500, body
    assert "Decode handshake failed" in str(body) and f":{wrong}" in str(body)
    assert t.rooms(t.decode, "room_received") == []
    failed = [r for r in t.decode.records() if r.get("path") == "/generate"]
    assert failed and all(r["status"] == 500 and r["bootstrap_port"] == wrong for r in failed)


def test_router_without_bootstrap_port_uses_decode_default(trio) -> None:
    """`--prefill URL` without a port: the router sends null and decode substitutes its own
    --disaggregation-bootstrap-port (default 8998), which is not prefill's: the request fails."""
    t = trio(router_boot=None, env={"V4FLASH_REHEARSAL_WAITING_TIMEOUT_S": "0.5",
                                    "V4FLASH_REHEARSAL_BOOTSTRAP_TIMEOUT_S": "0.5"})
    status, body = post_json(t.port, "/generate", {"text": "x"}, timeout=60)
    assert status >= 500
    dec = [r for r in t.decode.records() if r.get("path") == "/generate"]
    assert dec and dec[0]["bootstrap_port"] is None
    assert ":8998" in str(body)
