"""Deterministic "generation": the same prompt and limits always give the same words.

Token model (what every count in a reply means): one token is one whitespace-separated word of
the text, so `completion_tokens` == len(text.split()) and prompt tokens are the words of the
prompt (or the length of `input_ids`). Every non-empty reply starts with the rehearsal mark, so
nobody mistakes a rehearsal reply for a model's. Prompts that `arith.solve` recognises get a short
worked answer ending in "The answer is N." (wrong on purpose at the configured corrupt rate).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

from v4flash_pd.arith import Solution, explain
from v4flash_pd.rehearsal import REHEARSAL_MARK

EOS_TOKEN_ID = 1  # what SGLang reports as finish_reason.matched when EOS ends a reply
_FILLER = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
           "juliett", "kilo", "lima", "mike", "november", "oscar", "papa")


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as both sides of PD see it; `digest` stands in for the KV cache."""

    text: str
    n_tokens: int
    digest: str


def _digest(kind: str, value: Any) -> str:
    blob = json.dumps({"kind": kind, "value": value}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def prompt_from_text(text: str) -> Prompt:
    return Prompt(text=text, n_tokens=len(text.split()), digest=_digest("text", text))


def prompt_from_ids(ids: Sequence[int]) -> Prompt:
    return Prompt(text="", n_tokens=len(ids), digest=_digest("ids", list(ids)))


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """A plain chat template: 'role: content' lines, text parts of multi-part contents joined."""
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content
                               if isinstance(p, dict) and p.get("type") == "text")
        lines.append(f"{m.get('role', 'user')}: {content or ''}")
    return "\n".join(lines) + "\nassistant:"


def prompt_from_messages(messages: Sequence[dict[str, Any]]) -> Prompt:
    text = render_chat(messages)
    return Prompt(text=text, n_tokens=len(text.split()), digest=_digest("chat", list(messages)))


@dataclass(frozen=True)
class Completion:
    """The words of a reply and why it ended: 'length' (budget hit) or 'stop' (EOS)."""

    words: tuple[str, ...]
    finish: str

    @property
    def n_tokens(self) -> int:
        return len(self.words)

    @property
    def text(self) -> str:
        return " ".join(self.words)

    def text_upto(self, k: int) -> str:
        """Cumulative text after k tokens (what SGLang's native stream sends each chunk)."""
        return " ".join(self.words[:k])

    def delta(self, i: int) -> str:
        """Token i as an OpenAI stream delta; the deltas concatenate to `text`."""
        return self.words[i] if i == 0 else " " + self.words[i]

    def truncated(self, k: int) -> Completion:
        if k >= len(self.words):
            return self
        return Completion(self.words[:k], "length")


def is_corrupted(digest: str, rate: float) -> bool:
    """Deterministic per prompt, so a rerun of the gate sees the same wrong answers."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    return int(digest[:8], 16) / 0x100000000 < rate


def natural_words(prompt: Prompt, corrupt_rate: float, natural_tokens: int) -> tuple[str, ...]:
    """The reply the stand-in 'wants' to give before any token budget applies."""
    sol = explain(prompt.text) if prompt.text else None
    if sol is not None:
        answer = sol.answer
        if is_corrupted(prompt.digest, corrupt_rate):
            answer += 1 + int(prompt.digest[8:10], 16) % 9
        return (REHEARSAL_MARK, *Solution(sol.steps, answer).render().split())
    head = (REHEARSAL_MARK, "stand-in", "reply,", "no", "model", "loaded;", "prompt",
            f"{prompt.digest[:8]}.")
    return head + filler(prompt.digest, max(0, natural_tokens - len(head)))


def filler(digest: str, n: int) -> tuple[str, ...]:
    start = int(digest[10:12], 16)
    return tuple(_FILLER[(start + i) % len(_FILLER)] for i in range(n))


def generate(prompt: Prompt, max_new_tokens: int | None, ignore_eos: bool = False,
             corrupt_rate: float = 0.0, natural_tokens: int = 24) -> Completion:
    """The full reply under SGLang's rules: stop at EOS unless ignore_eos, never pass the budget."""
    words = natural_words(prompt, corrupt_rate, natural_tokens)
    if max_new_tokens is None:
        return Completion(words, "stop")
    budget = max(0, int(max_new_tokens))
    if ignore_eos:
        if budget > len(words):
            words = words + filler(prompt.digest, budget - len(words))
        return Completion(words[:budget], "length")
    if budget < len(words):
        return Completion(words[:budget], "length")
    return Completion(words, "stop")
