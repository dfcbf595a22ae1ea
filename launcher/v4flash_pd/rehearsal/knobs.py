"""Environment knobs of the stand-in, read once at start into a frozen value.

Why env and not flags: the stand-in receives exactly the SGLang argv the plan built, so anything
rehearsal-specific has to travel out of band; the plan's per-role env is the natural channel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

PREFIX = "V4FLASH_REHEARSAL_"


class KnobError(ValueError):
    """A knob has a value the stand-in cannot use; the message names the variable."""


@dataclass(frozen=True)
class Knobs:
    bind_delay_s: float = 0.0          # HTTP port refuses connections this long (weight loading)
    load_seconds: float = 1.0          # then /health* answer 503 this long ("warmup")
    ttft_ms: float = 0.0               # time to first token (prefill compute in PD mode)
    itl_ms: float = 0.0                # per output token after the first
    corrupt_rate: float = 0.0          # share of arithmetic answers made wrong (0..1)
    crash_after_s: float | None = None  # exit non-zero after this long (supervisor tests)
    crash_exit_code: int = 3
    waiting_timeout_s: float = 5.0     # decode: how long to wait for prefill's bootstrap room
    bootstrap_timeout_s: float = 5.0   # prefill: how long to wait for decode to fetch the room
    natural_tokens: int = 24           # length of a non-arithmetic reply when EOS is not ignored
    stop_delay_s: float = 0.0          # after SIGTERM, keep running this long (a worker slow to stop)
    # With speculative decoding on: tokens emitted per verify (None: every draft accepted, num_steps + 1),
    # and the share of arithmetic answers made wrong only then (a speculation bug for the eval A/B).
    accept_length: float | None = None
    spec_corrupt_rate: float = 0.0


_FLOATS = {
    "LOAD_SECONDS": "load_seconds",
    "BIND_DELAY_S": "bind_delay_s",
    "TTFT_MS": "ttft_ms",
    "ITL_MS": "itl_ms",
    "WAITING_TIMEOUT_S": "waiting_timeout_s",
    "BOOTSTRAP_TIMEOUT_S": "bootstrap_timeout_s",
    "STOP_DELAY_S": "stop_delay_s",
}


def _float(env: Mapping[str, str], suffix: str) -> float | None:
    raw = env.get(PREFIX + suffix, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise KnobError(f"{PREFIX}{suffix}={raw!r} is not a number") from None
    if value < 0 or value != value:
        raise KnobError(f"{PREFIX}{suffix}={raw!r} must be >= 0")
    return value


def _rate(env: Mapping[str, str], suffix: str) -> float | None:
    """A share of answers: 0..1, or true/yes/on for always."""
    raw = env.get(PREFIX + suffix, "").strip().lower()
    if not raw:
        return None
    if raw in ("true", "yes", "on"):
        return 1.0
    try:
        rate = float(raw)
    except ValueError:
        raise KnobError(f"{PREFIX}{suffix}={raw!r}: use 1 (always), 0 (never) or a rate between 0 and 1") from None
    if not 0.0 <= rate <= 1.0:
        raise KnobError(f"{PREFIX}{suffix}={raw!r} must be between 0 and 1")
    return rate


def knobs_from_env(env: Mapping[str, str] | None = None) -> Knobs:
    """All knobs from `env` (default os.environ); unset or empty means the default."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for suffix, field in _FLOATS.items():
        v = _float(env, suffix)
        if v is not None:
            values[field] = v
    crash = _float(env, "CRASH_AFTER_S")
    if crash is not None:
        values["crash_after_s"] = crash
    code = env.get(PREFIX + "CRASH_EXIT_CODE", "").strip()
    if code:
        if not code.isdigit() or not 0 < int(code) < 256:
            raise KnobError(f"{PREFIX}CRASH_EXIT_CODE={code!r} must be an integer in 1..255")
        values["crash_exit_code"] = int(code)
    accept = _float(env, "ACCEPT_LENGTH")
    if accept is not None:
        if accept < 1:
            raise KnobError(f"{PREFIX}ACCEPT_LENGTH={accept:g} must be >= 1 (tokens per verify include the bonus token)")
        values["accept_length"] = accept
    for suffix, field in (("CORRUPT", "corrupt_rate"), ("SPEC_CORRUPT", "spec_corrupt_rate")):
        rate = _rate(env, suffix)
        if rate is not None:
            values[field] = rate
    natural = env.get(PREFIX + "NATURAL_TOKENS", "").strip()
    if natural:
        if not natural.isdigit() or int(natural) < 1:
            raise KnobError(f"{PREFIX}NATURAL_TOKENS={natural!r} must be a positive integer")
        values["natural_tokens"] = int(natural)
    return Knobs(**values)  # type: ignore[arg-type]
