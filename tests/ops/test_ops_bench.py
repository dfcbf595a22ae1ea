"""bench: the pure arithmetic, then the HTTP client against a stand-in with known timing."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
from ops_standin import StandIn

from v4flash_pd import benchmark as b


def test_percentile_matches_numpy_linear():
    rng = random.Random(3)
    for n in (1, 2, 5, 100, 1001):
        xs = [rng.uniform(0, 50) for _ in range(n)]
        for p in (0, 50, 90, 99, 100):
            assert b.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert b.percentile([], 50) is None
    assert b.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5


def test_timings_from_events_counts_tokens_per_token_itl():
    # first token at +0.5 s, then one event bringing 3 tokens 0.3 s later, then 1 token 0.1 s later
    r = b.timings_from_events(10.0, [(10.5, 1), (10.5, 1), (10.8, 4), (10.9, 5)], end=11.0)
    assert r.ok and r.output_tokens == 5
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itls_s == pytest.approx((0.1, 0.1, 0.1, 0.1))
    assert r.latency_s == pytest.approx(1.0)
    assert not b.timings_from_events(0.0, [(1.0, 0)], end=2.0).ok


def test_parse_sse_line():
    assert b.parse_sse_line(b'data: {"meta_info": {"completion_tokens": 3}}\n') == {
        "meta_info": {"completion_tokens": 3}}
    assert b.parse_sse_line("data: [DONE]") is b.DONE
    assert b.parse_sse_line(b"\n") is None
    assert b.parse_sse_line(b": keep-alive") is None
    assert b.parse_sse_line(b"data: not json") is None
    assert b.completion_tokens({"meta_info": {"completion_tokens": 7}}) == 7
    assert b.completion_tokens({"text": "x"}) is None


def test_summarize_and_concurrency_parse():
    rs = [b.RequestResult(True, 10, 0.1, (0.01,) * 9, 0.2), b.RequestResult(True, 30, 0.3, (0.02,) * 29, 0.9),
          b.RequestResult(False, error="HTTP 500")]
    s = b.summarize(4, rs, 2.0)
    assert (s.requests, s.completed, s.errors, s.output_tokens) == (3, 2, 1, 40)
    assert s.output_tok_s == pytest.approx(20.0) and s.req_s == pytest.approx(1.0)
    assert s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.itl_ms.p50 == pytest.approx(20.0) and s.itl_ms.p90 == pytest.approx(20.0)
    assert s.error_samples == ("HTTP 500",)
    assert b.parse_concurrency("1, 16,64") == (1, 16, 64)
    for bad in ("0", "x", ",", "-2"):
        with pytest.raises(ValueError):
            b.parse_concurrency(bad)


def test_stream_against_standin_with_known_timing():
    with StandIn(ttft_s=0.08, itl_s=0.02) as srv:
        r = b.stream_generate(srv.url, b.generate_payload("a b c", 20))
    assert r.ok, r.error
    assert r.output_tokens == 20
    assert 0.075 <= r.ttft_s < 0.3  # upper bounds tolerate a loaded CI box
    assert len(r.itls_s) == 19
    assert 0.018 <= b.percentile(r.itls_s, 50) < 0.06


def test_multi_token_events_are_counted_per_token():
    with StandIn(ttft_s=0.02, itl_s=0.015, tokens_per_event=3) as srv:
        r = b.stream_generate(srv.url, b.generate_payload("a", 10))
    assert r.ok and r.output_tokens == 10
    assert len(r.itls_s) == 9  # tokens 2..10, each an ITL sample of (gap / tokens in the event)
    assert 0.013 <= b.percentile(r.itls_s, 50) < 0.04  # one sample per event would be 0.045


def test_run_level_throughput_matches_known_timing():
    # 8 requests x 10 tokens at concurrency 4: each request ~ 0.05 + 9 * 0.02 = 0.23 s -> two waves ~0.46 s
    with StandIn(ttft_s=0.05, itl_s=0.02) as srv:
        s = b.run_level(srv.url, 4, ["p"] * 8, 10)
    assert (s.requests, s.errors, s.output_tokens) == (8, 0, 80)
    ideal = 80 / 0.46
    assert 0.3 * ideal <= s.output_tok_s <= 1.05 * ideal
    assert 45 <= s.ttft_ms.p50 < 150
    assert 18 <= s.itl_ms.p50 < 60


def test_errors_are_counted():
    with StandIn(ttft_s=0.0, itl_s=0.001, fail_every=2) as srv:
        s = b.run_level(srv.url, 2, ["p"] * 6, 3)
    assert s.errors == 3 and s.completed == 3
    assert s.error_samples and s.error_samples[0].startswith("HTTP 500")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = b.stream_generate(f"http://127.0.0.1:{port}", b.generate_payload("a", 2), timeout=5)
    assert not r.ok and "ConnectionRefused" in r.error


def _cli(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "v4flash_pd", *args], capture_output=True, text=True,
                          timeout=120, env=e)


def test_cli_json_report():
    with StandIn(ttft_s=0.01, itl_s=0.005) as srv:
        p = _cli("bench", "--url", srv.url, "--concurrency", "1,3", "--requests", "3", "--input-len", "5",
                 "--output-len", "6", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "v4flash-pd.bench/1"
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 3]
    assert all(lv["output_tokens"] == 18 and lv["errors"] == 0 for lv in doc["levels"])
    assert "c=1" in p.stderr and "3/3" in p.stderr  # the progress bar went to stderr


def test_cli_env_and_failure_exit():
    with StandIn(ttft_s=0.0, itl_s=0.001, fail_every=3) as srv:
        p = _cli("bench", "--concurrency", "2", "--warmup", "0",
                 env={"V4FLASH_BENCH_URL": srv.url, "V4FLASH_BENCH_REQUESTS": "6", "V4FLASH_BENCH_OUTPUT_LEN": "2"})
    assert p.returncode == 1
    assert "HTTP 500" in p.stdout and "request(s) failed" in p.stderr
    p = _cli("bench", "--concurrency", "0")
    assert p.returncode == 2 and "--concurrency" in p.stderr


def test_rehearsal_numbers_are_labelled_stand_in():
    """Throughput measured on the rehearsal's stand-in engine says so wherever it is printed (the table,
    --json); an engine that is not a rehearsal gets no label."""
    from ops_engine import engine

    args = ("--concurrency", "2", "--requests", "2", "--input-len", "4", "--output-len", "3")
    with engine() as url:
        text = _cli("bench", "--url", url, *args)
        js = _cli("bench", "--url", url, *args, "--json")
    assert text.returncode == 0 and js.returncode == 0, text.stderr + js.stderr
    head = text.stdout.splitlines()[0]
    assert head.startswith("bench ") and "[stand-in: rehearsal engines, no model, no GPU]" in head, text.stdout
    assert "out tok/s" in text.stdout and "stand-in" in text.stdout.splitlines()[-1], text.stdout
    doc = json.loads(js.stdout)
    assert doc["standin"] is True and all(lv["standin"] for lv in doc["levels"])
    with StandIn(ttft_s=0.0, itl_s=0.001) as srv:
        real = _cli("bench", "--url", srv.url, *args)
        real_js = _cli("bench", "--url", srv.url, *args, "--json")
    assert real.returncode == 0 and "stand-in" not in real.stdout, real.stdout
    assert json.loads(real_js.stdout)["standin"] is False
