"""Generated arithmetic word problems for the accuracy gate (GSM8K-lite).

Why generated and not a data set: the gate must run offline, on any box, with a known answer for
every question, and the rehearsal engine must be able to answer the same questions (right, or
deliberately wrong) so the gate's pass and fail paths are both testable without a GPU.

Every template is a multi-step problem whose answer is a non-negative integer. `solve` recognises
exactly these templates (anywhere in a longer prompt, e.g. after few-shot examples: the last
recognised question wins), which is what the rehearsal engine uses to answer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

__all__ = [
    "Problem",
    "Solution",
    "make_problems",
    "explain",
    "solve",
    "extract_final_number",
    "prompt_for",
    "TEMPLATE_NAMES",
]

_NAMES = ("Mia", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aiko", "Nadia", "Lucas", "Zara")


@dataclass(frozen=True)
class Problem:
    """One question with its exact integer answer; `template` names the generator used."""

    question: str
    answer: int
    template: str


@dataclass(frozen=True)
class Solution:
    """A worked answer: short reasoning steps and the final integer."""

    steps: tuple[str, ...]
    answer: int

    def render(self) -> str:
        """The chain a model would write, ending in the phrase the gate's extractor relies on."""
        return " ".join(self.steps + (f"The answer is {self.answer}.",))


@dataclass(frozen=True)
class _Template:
    name: str
    make: Callable[[random.Random, str], tuple[str, int]]
    pattern: re.Pattern[str]
    work: Callable[[re.Match[str]], Solution | None]


# -- templates: (generator, recogniser, worked solution) -------------------------------------------


def _make_packs(rng: random.Random, who: str) -> tuple[str, int]:
    packs, per = rng.randint(3, 9), rng.randint(6, 15)
    given = rng.randint(2, min(20, packs * per - 1))
    q = (f"{who} buys {packs} packs of pencils. Each pack has {per} pencils. "
         f"{who} gives away {given} pencils. How many pencils does {who} have left?")
    return q, packs * per - given


def _work_packs(m: re.Match[str]) -> Solution:
    packs, per, given = int(m["a"]), int(m["b"]), int(m["c"])
    total = packs * per
    return Solution((f"{packs} packs of {per} pencils is {packs} * {per} = {total} pencils.",
                     f"After giving away {given}, {total} - {given} = {total - given}."),
                    total - given)


def _make_savings(rng: random.Random, who: str) -> tuple[str, int]:
    weekly, weeks = rng.randint(5, 30), rng.randint(3, 12)
    spent = rng.randint(1, min(40, weekly * weeks - 1))
    q = (f"{who} saves {weekly} dollars each week for {weeks} weeks, then spends {spent} dollars "
         f"on a book. How many dollars does {who} have now?")
    return q, weekly * weeks - spent


def _work_savings(m: re.Match[str]) -> Solution:
    weekly, weeks, spent = int(m["a"]), int(m["b"]), int(m["c"])
    saved = weekly * weeks
    return Solution((f"Saved {weekly} * {weeks} = {saved} dollars.",
                     f"After the book, {saved} - {spent} = {saved - spent}."), saved - spent)


def _make_sharing(rng: random.Random, who: str) -> tuple[str, int]:
    friends, per_tray = rng.randint(2, 6), rng.randint(4, 12)
    # Choose trays so the cookies split evenly: trays * per_tray divisible by friends.
    trays = friends * rng.randint(1, 4)
    q = (f"{who} bakes {trays} trays of {per_tray} cookies and shares them equally among "
         f"{friends} friends. How many cookies does each friend get?")
    return q, trays * per_tray // friends


def _work_sharing(m: re.Match[str]) -> Solution | None:
    trays, per_tray, friends = int(m["a"]), int(m["b"]), int(m["c"])
    total = trays * per_tray
    if friends == 0 or total % friends:
        return None
    return Solution((f"{trays} trays of {per_tray} is {trays} * {per_tray} = {total} cookies.",
                     f"Shared among {friends}: {total} / {friends} = {total // friends}."),
                    total // friends)


def _make_trip(rng: random.Random, who: str) -> tuple[str, int]:
    v1, t1, v2, t2 = rng.randint(30, 90), rng.randint(1, 5), rng.randint(20, 80), rng.randint(1, 4)
    q = (f"{who} drives at {v1} km per hour for {t1} hours and then at {v2} km per hour for "
         f"{t2} hours. How many kilometres does {who} drive in total?")
    return q, v1 * t1 + v2 * t2


def _work_trip(m: re.Match[str]) -> Solution:
    v1, t1, v2, t2 = int(m["a"]), int(m["b"]), int(m["c"]), int(m["d"])
    d1, d2 = v1 * t1, v2 * t2
    return Solution((f"First part: {v1} * {t1} = {d1} km.", f"Second part: {v2} * {t2} = {d2} km.",
                     f"Total: {d1} + {d2} = {d1 + d2}."), d1 + d2)


def _make_ages(rng: random.Random, who: str) -> tuple[str, int]:
    k, young, years = rng.randint(2, 5), rng.randint(3, 12), rng.randint(1, 10)
    q = (f"{who} is {k} times as old as a brother who is {young} years old. In {years} years, "
         f"what will be the sum of their ages?")
    return q, k * young + young + 2 * years


def _work_ages(m: re.Match[str]) -> Solution:
    k, young, years = int(m["a"]), int(m["b"]), int(m["c"])
    old = k * young
    now = old + young
    return Solution((f"Now: {k} * {young} = {old}, so the sum is {old} + {young} = {now}.",
                     f"In {years} years both are older: {now} + 2 * {years} = {now + 2 * years}."),
                    now + 2 * years)


def _make_garden(rng: random.Random, who: str) -> tuple[str, int]:
    rows, per, died, new = (rng.randint(4, 12), rng.randint(5, 20), rng.randint(1, 15),
                            rng.randint(1, 30))
    q = (f"A garden has {rows} rows of {per} tomato plants. {died} plants die and {who} plants "
         f"{new} new ones. How many plants are in the garden now?")
    return q, rows * per - died + new


def _work_garden(m: re.Match[str]) -> Solution:
    rows, per, died, new = int(m["a"]), int(m["b"]), int(m["c"]), int(m["d"])
    total = rows * per
    return Solution((f"{rows} rows of {per} is {rows} * {per} = {total} plants.",
                     f"{total} - {died} = {total - died}, plus {new} is {total - died + new}."),
                    total - died + new)


_W = r"[A-Z][a-z]+"
_TEMPLATES: tuple[_Template, ...] = (
    _Template("packs", _make_packs, re.compile(
        rf"{_W} buys (?P<a>\d+) packs of pencils\. Each pack has (?P<b>\d+) pencils\. "
        rf"{_W} gives away (?P<c>\d+) pencils\."), _work_packs),
    _Template("savings", _make_savings, re.compile(
        rf"{_W} saves (?P<a>\d+) dollars each week for (?P<b>\d+) weeks, then spends (?P<c>\d+) "
        r"dollars on a book\."), _work_savings),
    _Template("sharing", _make_sharing, re.compile(
        rf"{_W} bakes (?P<a>\d+) trays of (?P<b>\d+) cookies and shares them equally among "
        r"(?P<c>\d+) friends\."), _work_sharing),
    _Template("trip", _make_trip, re.compile(
        rf"{_W} drives at (?P<a>\d+) km per hour for (?P<b>\d+) hours and then at (?P<c>\d+) km "
        r"per hour for (?P<d>\d+) hours\."), _work_trip),
    _Template("ages", _make_ages, re.compile(
        rf"{_W} is (?P<a>\d+) times as old as a brother who is (?P<b>\d+) years old\. In "
        r"(?P<c>\d+) years, what will be the sum of their ages\?"), _work_ages),
    _Template("garden", _make_garden, re.compile(
        r"A garden has (?P<a>\d+) rows of (?P<b>\d+) tomato plants\. (?P<c>\d+) plants die and "
        rf"{_W} plants (?P<d>\d+) new ones\."), _work_garden),
)

TEMPLATE_NAMES: tuple[str, ...] = tuple(t.name for t in _TEMPLATES)


def make_problems(n: int, seed: int = 0) -> list[Problem]:
    """`n` problems, the same list for the same (n, seed); templates rotate so all are covered."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    out: list[Problem] = []
    for i in range(n):
        tpl = _TEMPLATES[i % len(_TEMPLATES)]
        question, answer = tpl.make(rng, rng.choice(_NAMES))
        out.append(Problem(question=question, answer=answer, template=tpl.name))
    return out


def explain(text: str) -> Solution | None:
    """Worked solution of the last question in `text` that one of our templates generated."""
    best: tuple[int, _Template, re.Match[str]] | None = None
    for tpl in _TEMPLATES:
        for m in tpl.pattern.finditer(text):
            if best is None or m.start() > best[0]:
                best = (m.start(), tpl, m)
    if best is None:
        return None
    return best[1].work(best[2])


def solve(question: str) -> int | None:
    """The answer to the last recognised question in `question`, or None if none is ours."""
    sol = explain(question)
    return None if sol is None else sol.answer


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_final_number(text: str) -> int | None:
    """The last number in a model reply, as an int (commas allowed; 12.0 counts, 12.5 does not).

    The last number, because chains of thought mention intermediate values first and the
    prompt asks for "The answer is N." at the end.
    """
    for raw in reversed(_NUMBER.findall(text)):
        cleaned = raw.replace(",", "")
        if cleaned in ("", "-"):
            continue
        try:
            value = Decimal(cleaned)
        except InvalidOperation:
            continue
        if value != value.to_integral_value():
            return None
        return int(value)
    return None


def prompt_for(problem: Problem) -> str:
    """A plain prompt for one problem; asks for the closing phrase `extract_final_number` reads."""
    return (f"Question: {problem.question}\n"
            "Think step by step, then finish with 'The answer is N.' where N is an integer.\n"
            "Answer:")
