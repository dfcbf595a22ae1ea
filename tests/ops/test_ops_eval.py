"""eval: the gate passes on the honest rehearsal engine and fails when it corrupts answers."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from ops_engine import engine

from v4flash_pd import arith, evalgate


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "v4flash_pd", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


def test_prompt_is_few_shot_and_the_question_comes_last():
    p = arith.make_problems(3, seed=11)[2]
    prompt = evalgate.build_prompt(p, shots=2)
    assert prompt.count("Question:") == 3 and prompt.rstrip().endswith("Answer:")
    assert len(re.findall(r"The answer is \d+\.", prompt)) == 2  # the worked shots, not our question
    assert arith.solve(prompt) == p.answer  # "last recognised question wins"
    assert p.question not in evalgate.few_shot_prefix(2)
    assert evalgate.build_prompt(p, 0) == arith.prompt_for(p)


def test_grading_and_scoring():
    p = arith.Problem("q?", 42, "packs")
    assert evalgate.grade(p, "6 * 7 = 42. The answer is 42.").correct
    assert not evalgate.grade(p, "The answer is 41.").correct
    assert not evalgate.grade(p, "The answer is 42.", error="HTTP 500").correct
    g = [evalgate.grade(p, "42")] * 9 + [evalgate.grade(p, "7")]
    r = evalgate.score("u", g, 0.9, 1.0)
    assert r.accuracy == pytest.approx(0.9) and r.passed and len(r.failures) == 1
    assert not evalgate.score("u", g, 0.95, 1.0).passed
    assert not evalgate.score("u", [], 0.0, 1.0).passed
    text = evalgate.render(evalgate.score("u", g, 0.95, 1.0))
    assert text.startswith("eval FAIL: accuracy 0.900 (9/10)") and "expected 42, got 7" in text


def test_passes_on_the_honest_engine():
    with engine() as url:
        r = evalgate.run_eval(url, questions=24, min_accuracy=1.0)
    assert r.passed and r.correct == 24 and r.errors == 0


def test_fails_on_the_corrupting_engine():
    with engine(corrupt="1") as url:
        r = evalgate.run_eval(url, questions=24, min_accuracy=0.5)
        p = _cli("eval", "--url", url, "--questions", "12")
    assert not r.passed and r.accuracy < 0.2 and r.errors == 0
    f = r.failures[0]
    assert f.got is not None and f.got != f.expected and "The answer is" in f.reply
    assert p.returncode == 1
    assert "eval FAIL" in p.stdout and "expected" in p.stdout and "below the gate" in p.stderr


def test_partial_corruption_is_measured():
    with engine(corrupt="0.5") as url:
        r = evalgate.run_eval(url, questions=60, min_accuracy=0.9, seed=3)
    assert not r.passed and 0.2 < r.accuracy < 0.8


def test_cli_json_and_env_options():
    with engine() as url:
        p = _cli("eval", "--json", env={"V4FLASH_EVAL_URL": url, "V4FLASH_EVAL_QUESTIONS": "7",
                                        "V4FLASH_EVAL_MIN_ACCURACY": "1.0"})
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == "v4flash-pd.eval/1" and doc["total"] == 7 and doc["accuracy"] == 1.0
    assert doc["passed"] and doc["failures"] == []


def test_dead_server_and_bad_input():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _cli("eval", "--url", f"http://127.0.0.1:{port}", "--questions", "3", "--timeout", "5")
    assert p.returncode == 1 and "every request" in p.stderr and "Connection" in p.stderr
    p = _cli("eval", "--questions", "0")
    assert p.returncode == 2 and "questions must be >= 1" in p.stderr
    p = _cli("eval", "--min-accuracy", "1.5")
    assert p.returncode == 2


def test_a_pass_on_the_rehearsal_engine_is_labelled_stand_in():
    with engine() as url:
        p = _cli("eval", "--url", url, "--questions", "3")
        js = _cli("eval", "--url", url, "--questions", "3", "--json")
    assert p.returncode == 0 and js.returncode == 0, p.stderr + js.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("eval PASS") and "[stand-in: rehearsal engines, no model, no GPU]" in first, p.stdout
    assert json.loads(js.stdout)["standin"] is True
    r = evalgate.score("http://x", [evalgate.grade(arith.make_problems(1)[0], "The answer is 0")], 0.0, 1.0)
    assert not r.standin and "stand-in" not in evalgate.render(r)
