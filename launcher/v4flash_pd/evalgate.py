"""The offline accuracy gate (`v4flash-pd eval`, and `up --eval` before READY).

Why a gate at all: a silent KV-transfer bug (sglang PR #23773: the DSv4 state buffer not sent by
NIXL) dropped GSM8K to ~0.1 while throughput looked healthy, so "it answers" is not "it is right".
Why generated questions: no data set download on an air-gapped box, and every answer is known
exactly (`v4flash_pd.arith`).

Requests go to SGLang's native `/generate` (what the router forwards in PD mode) with a few-shot
prompt built from worked examples, greedy sampling, and a stop at the next "Question:"; the reply
is scored by exact match of its final number.

Speculative decoding: a reply's `meta_info.spec_verify_ct` says the server verified drafts, so the
result records whether speculation was on and its accept length. With `baseline` (an earlier
result on the same questions, e.g. with speculation off) the gate also fails when accuracy dropped
by more than `max_drop`: greedy EAGLE verification is lossless in exact arithmetic, so a broken
draft/verify path shows as a drop against the same server without it.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from v4flash_pd import arith
from v4flash_pd.httpclient import request
from v4flash_pd.rehearsal import STANDIN_LABEL, is_standin_reply

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_QUESTIONS = 50
DEFAULT_MIN_ACCURACY = 0.9
# Few-shot examples come from a seed no gate run uses by default, so they never equal a question.
_SHOT_SEED = 987_654_321


@dataclass(frozen=True)
class Graded:
    """One question's outcome (reply is trimmed to keep reports small)."""

    question: str
    expected: int
    got: int | None
    correct: bool
    reply: str
    error: str = ""
    completion_tokens: int = 0
    spec_verify_ct: int = 0  # verify steps, where the server decoded speculatively
    standin: bool = False  # the rehearsal's stand-in engine answered (meta_info "rehearsal": true)


@dataclass(frozen=True)
class Baseline:
    """An earlier result on the same questions the gate compares against (`eval --baseline FILE`)."""

    path: str
    accuracy: float
    speculative: bool
    max_drop: float

    def allows(self, accuracy: float) -> bool:
        return accuracy >= self.accuracy - self.max_drop - 1e-12


@dataclass(frozen=True)
class EvalResult:
    url: str
    total: int
    correct: int
    errors: int
    accuracy: float
    min_accuracy: float
    passed: bool
    duration_s: float
    graded: tuple[Graded, ...]
    seed: int = 0
    shots: int = 2
    speculative: bool = False  # the replies carried speculative-decoding metrics
    accept_length: float | None = None  # tokens per verify step over those replies
    baseline: Baseline | None = None
    standin: bool = False  # the rehearsal's stand-in engines answered: a PASS says nothing of a model

    @property
    def failures(self) -> tuple[Graded, ...]:
        return tuple(g for g in self.graded if not g.correct)

    def to_dict(self, max_failures: int = 10) -> dict[str, Any]:
        d = asdict(self)
        d.pop("graded")
        d["schema"] = "v4flash-pd.eval/1"
        d["failures"] = [asdict(g) for g in self.failures[:max_failures]]
        return d


# ------------------------------------------------------------------------------------------ pure


def few_shot_prefix(shots: int) -> str:
    """`shots` worked examples in the same format the question uses."""
    parts = []
    for p in arith.make_problems(shots, seed=_SHOT_SEED):
        sol = arith.explain(p.question)
        assert sol is not None and sol.answer == p.answer
        parts.append(f"{arith.prompt_for(p)} {sol.render()}\n\n")
    return "".join(parts)


def build_prompt(problem: arith.Problem, shots: int) -> str:
    return few_shot_prefix(shots) + arith.prompt_for(problem)


def generate_payload(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"text": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "stop": ["Question:"]}}


def grade(problem: arith.Problem, reply: str, error: str = "") -> Graded:
    got = None if error else arith.extract_final_number(reply)
    return Graded(question=problem.question, expected=problem.answer, got=got,
                  correct=(not error and got == problem.answer), reply=reply.strip()[-300:], error=error)


def score(url: str, graded: Sequence[Graded], min_accuracy: float, duration_s: float, *, seed: int = 0,
          shots: int = 2, baseline: Baseline | None = None) -> EvalResult:
    total = len(graded)
    correct = sum(g.correct for g in graded)
    acc = correct / total if total else 0.0
    spec = [g for g in graded if g.spec_verify_ct > 0]
    verifies = sum(g.spec_verify_ct for g in spec)
    passed = total > 0 and acc >= min_accuracy and (baseline is None or baseline.allows(acc))
    return EvalResult(url=url, total=total, correct=correct, errors=sum(bool(g.error) for g in graded),
                      accuracy=acc, min_accuracy=min_accuracy, passed=passed, duration_s=duration_s,
                      graded=tuple(graded), seed=seed, shots=shots, speculative=bool(spec),
                      accept_length=sum(g.completion_tokens for g in spec) / verifies if verifies else None,
                      baseline=baseline, standin=any(g.standin for g in graded))


def load_baseline(path: Path, *, questions: int, seed: int, shots: int, max_drop: float) -> Baseline:
    """An earlier `eval --json` result, refused (ValueError) unless it asked exactly these questions."""
    try:
        doc: Any = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the baseline {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"the baseline {path} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != "v4flash-pd.eval/1":
        raise ValueError(f"the baseline {path} is not an `eval --json` result (schema v4flash-pd.eval/1)")
    theirs = (doc.get("total"), doc.get("seed"), doc.get("shots"))
    if theirs != (questions, seed, shots):
        raise ValueError(f"the baseline {path} asked other questions (questions/seed/shots {theirs[0]}/{theirs[1]}/"
                         f"{theirs[2]}, this run {questions}/{seed}/{shots}), so the accuracies do not compare")
    acc = doc.get("accuracy")
    if isinstance(acc, bool) or not isinstance(acc, (int, float)):
        raise ValueError(f"the baseline {path} has no accuracy")
    return Baseline(str(path), float(acc), bool(doc.get("speculative", False)), max_drop)


def render(result: EvalResult, show: int = 3) -> str:
    verdict = "PASS" if result.passed else "FAIL"
    lines = [f"eval {verdict}: accuracy {result.accuracy:.3f} ({result.correct}/{result.total}), "
             f"threshold {result.min_accuracy:.3f}, errors {result.errors}, {result.duration_s:.1f}s"
             + (f"  {STANDIN_LABEL}" if result.standin else "")]
    lines.append("speculative decoding " + (f"on (served accept length {result.accept_length:.2f})"
                                             if result.speculative and result.accept_length else
                                             "off (the replies carry no verify counts)"))
    b = result.baseline
    if b is not None:
        side = "on" if b.speculative else "off"
        drop = b.accuracy - result.accuracy
        lines.append(f"baseline {b.path} (speculative decoding {side}): accuracy {b.accuracy:.3f}, "
                     f"{'drop' if drop > 0 else 'change'} {abs(drop):.3f} "
                     f"({'within' if b.allows(result.accuracy) else 'MORE than'} the allowed {b.max_drop:.3f})")
        if b.speculative == result.speculative:
            lines.append(f"  note: both runs have speculative decoding {side}; for the speculation A/B run one "
                         "without --mtp and one with it")
    for g in result.failures[:show]:
        lines.append(f"  - Q: {g.question}")
        if g.error:
            lines.append(f"    expected {g.expected}, request failed: {g.error}")
        else:
            lines.append(f"    expected {g.expected}, got {g.got}; reply: {g.reply[-160:]!r}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- effects


def _check_url(url: str) -> urllib.parse.SplitResult:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return u


def post_generate(url: str, payload: dict[str, Any], timeout: float,
                  headers: dict[str, str] | None = None) -> tuple[str, str]:
    """POST a non-streaming `/generate`; returns (text, error) with exactly one of them non-empty."""
    text, error, _ = post_generate_meta(url, payload, timeout, headers)
    return text, error


def post_generate_meta(url: str, payload: dict[str, Any], timeout: float,
                       headers: dict[str, str] | None = None) -> tuple[str, str, dict[str, Any]]:
    """`post_generate` plus the reply's meta_info ({} when absent)."""
    _check_url(url)
    rep = request(url.rstrip("/") + "/generate", payload, timeout=timeout, headers=headers)
    if rep.status != 200:
        return "", (f"HTTP {rep.status}: {rep.body[:200].strip()}" if rep.status
                    else f"no answer ({rep.kind}): {rep.error}"), {}
    try:
        body = rep.json()
    except ValueError as exc:
        return "", f"reply is not JSON ({exc}): {rep.body[:200]!r}", {}
    if isinstance(body, list):  # a batch answer; we send one prompt
        body = body[0] if body else {}
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str):
        return "", f"no 'text' in the reply: {rep.body[:200]!r}", {}
    meta = body.get("meta_info")
    return text, "", meta if isinstance(meta, dict) else {}


def _count(meta: dict[str, Any], key: str) -> int:
    v = meta.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def run_eval(url: str = DEFAULT_URL, questions: int = DEFAULT_QUESTIONS,
             min_accuracy: float = DEFAULT_MIN_ACCURACY, *, seed: int = 0, shots: int = 2,
             concurrency: int = 8, max_tokens: int = 512, timeout: float = 600.0,
             on_answer: Callable[[Graded], None] | None = None,
             headers: dict[str, str] | None = None, baseline: Baseline | None = None) -> EvalResult:
    """Ask `questions` generated problems, grade each by exact final-number match.

    Never raises for a bad server (failed requests grade as wrong, with the error kept), so
    `up --eval` can print the result and stop the trio itself. Raises ValueError for bad input.
    """
    if questions < 1:
        raise ValueError(f"questions must be >= 1, got {questions}")
    if not 0.0 <= min_accuracy <= 1.0:
        raise ValueError(f"min_accuracy must be within [0, 1], got {min_accuracy}")
    _check_url(url)
    problems = arith.make_problems(questions, seed=seed)

    def ask(p: arith.Problem) -> Graded:
        text, err, meta = post_generate_meta(url, generate_payload(build_prompt(p, shots), max_tokens), timeout,
                                             headers)
        g = replace(grade(p, text, err), completion_tokens=_count(meta, "completion_tokens"),
                    spec_verify_ct=_count(meta, "spec_verify_ct"), standin=is_standin_reply(meta))
        if on_answer is not None:
            on_answer(g)
        return g

    t0 = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        graded = list(pool.map(ask, problems))
    finally:  # interrupted (the report stopping): drop the queued questions rather than ask them all first
        pool.shutdown(wait=False, cancel_futures=True)
    return score(url, graded, min_accuracy, time.monotonic() - t0, seed=seed, shots=shots, baseline=baseline)
