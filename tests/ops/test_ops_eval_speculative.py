"""eval with speculative decoding on as well as off: the result says which, with the served accept
length, and `--baseline` turns a speculation bug (right answers without it, wrong ones with it) into
a failed gate even where the absolute accuracy threshold would still pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ops_engine import engine

from v4flash_pd import evalgate

MTP3 = ("speculative.num_steps=3",)
Q = ("--questions", "20", "--seed", "4")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("V4FLASH_")}
    return subprocess.run([sys.executable, "-m", "v4flash_pd", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def _baseline(tmp_path: Path) -> Path:
    with engine() as url:
        off = _cli("eval", "--url", url, "--json", *Q)
    assert off.returncode == 0, off.stderr
    doc = json.loads(off.stdout)
    assert doc["speculative"] is False and doc["accept_length"] is None and doc["accuracy"] == 1.0
    assert (doc["seed"], doc["total"], doc["shots"]) == (4, 20, 2)
    path = tmp_path / "off.json"
    path.write_text(off.stdout)
    return path


def test_speculation_on_is_reported_and_matches_the_baseline(tmp_path: Path) -> None:
    base = _baseline(tmp_path)
    with engine(sets=MTP3, accept_length="2.5") as url:
        on = _cli("eval", "--url", url, "--baseline", str(base), *Q)
        doc = json.loads(_cli("eval", "--url", url, "--json", "--baseline", str(base), *Q).stdout)
    assert on.returncode == 0, on.stdout + on.stderr
    assert "speculative decoding on (served accept length" in on.stdout
    assert f"baseline {base} (speculative decoding off): accuracy 1.000, change 0.000 (within" in on.stdout
    # SGLang's per-request accept length is completion_tokens / verifies, and the first token is the
    # prefill's, not a verify's: near the stand-in's 2.5 tokens per verify, not exactly it
    assert doc["speculative"] is True and 2.2 < doc["accept_length"] < 2.8
    assert doc["baseline"]["accuracy"] == 1.0 and doc["passed"]


def test_a_speculation_bug_fails_against_the_baseline(tmp_path: Path) -> None:
    base = _baseline(tmp_path)
    with engine(sets=MTP3, spec_corrupt="0.3") as url:
        plain = _cli("eval", "--url", url, "--min-accuracy", "0.5", *Q)
        res = _cli("eval", "--url", url, "--min-accuracy", "0.5", "--baseline", str(base), *Q)
        r = evalgate.run_eval(url, 20, 0.5, seed=4)
    assert 0.5 <= r.accuracy < 1.0 - 0.04 and r.speculative  # above the absolute gate, below the baseline
    assert plain.returncode == 0, plain.stdout  # without the A/B the bug passes the threshold
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MORE than the allowed 0.040" in res.stdout
    assert res.stderr.startswith("error: eval: accuracy") and "dropped" in res.stderr and "--mtp 0" in res.stderr


def test_baseline_must_ask_the_same_questions(tmp_path: Path) -> None:
    base = _baseline(tmp_path)
    res = _cli("eval", "--url", "http://127.0.0.1:9", "--baseline", str(base), "--questions", "10", "--seed", "4")
    assert res.returncode == 2 and "asked other questions" in res.stderr and "fix:" in res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = _cli("eval", "--url", "http://127.0.0.1:9", "--baseline", str(bad), *Q)
    assert res.returncode == 2 and "is not JSON" in res.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "v4flash-pd.bench/1"}))
    res = _cli("eval", "--url", "http://127.0.0.1:9", "--baseline", str(other), *Q)
    assert res.returncode == 2 and "not an `eval --json` result" in res.stderr
