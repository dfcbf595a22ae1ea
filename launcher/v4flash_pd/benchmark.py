"""Throughput and latency benchmark against the router (`v4flash-pd bench`).

Why SGLang's native `/generate` with `stream: true` rather than `/v1/completions`: every SSE event
carries `meta_info.completion_tokens`, the server's own count of generated tokens, so the client
needs no tokenizer (the launcher must not depend on transformers) and the count stays exact when
one event carries several tokens; `sampling_params.ignore_eos` pins the output length so runs are
comparable. The router forwards `/generate` to the PD pair and streams decode's SSE back.

The core is pure (SSE parsing, per-request timings, percentiles, per-level summaries) and is fed
timestamps by a thin stdlib HTTP client (http.client + one thread per in-flight request), so the
arithmetic can be tested on a stand-in engine with known timing.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence, TextIO

from v4flash_pd.rehearsal import STANDIN_LABEL, is_standin_reply
from v4flash_pd.table import Progress, format_table

DEFAULT_URL = "http://127.0.0.1:8000"
DONE = object()  # sentinel for `data: [DONE]`

# Plain words: one word is (about) one token for real tokenizers and exactly one for the stand-in.
_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be "
    "has had one their its new after who they have been also first two time year more when other "
    "into most only over city some would during made people many these world three state such"
).split()


# ------------------------------------------------------------------------------------------ pure


def parse_sse_line(line: bytes | str) -> dict[str, Any] | object | None:
    """One SSE line -> the JSON event, `DONE`, or None (blank lines, comments, other fields)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def spec_verify_ct(event: dict[str, Any]) -> int | None:
    """Verify steps of a finished request, where the server decodes speculatively (SGLang writes
    `meta_info.spec_verify_ct` on a request's last event only, and only with speculation on)."""
    meta = event.get("meta_info")
    verify = meta.get("spec_verify_ct") if isinstance(meta, dict) else None
    return verify if isinstance(verify, int) and verify > 0 else None


def completion_tokens(event: dict[str, Any]) -> int | None:
    """Cumulative generated-token count of one `/generate` event (None if it carries none)."""
    meta = event.get("meta_info")
    tokens = meta.get("completion_tokens") if isinstance(meta, dict) else None
    return tokens if isinstance(tokens, int) else None


@dataclass(frozen=True)
class RequestResult:
    """One request's outcome; times in seconds, relative to when the request was sent."""

    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    itls_s: tuple[float, ...] = ()
    latency_s: float = 0.0
    error: str = ""
    spec_verify_ct: int | None = None  # verify steps, where the server decodes speculatively
    standin: bool = False  # the rehearsal's stand-in engine answered (meta_info "rehearsal": true)


def timings_from_events(start: float, events: Sequence[tuple[float, int]], end: float) -> RequestResult:
    """Per-request TTFT and inter-token latencies from (arrival time, cumulative tokens) pairs.

    TTFT is the arrival of the first event with at least one token. An event that brings k new
    tokens after a gap dt contributes k ITL samples of dt/k, so ITL percentiles are per token
    (a server that batches several tokens per event is not credited with a 0 ms latency).
    """
    ttft = None
    itls: list[float] = []
    prev_t, prev_n = start, 0
    for t, n in events:
        if n <= prev_n:
            continue
        if ttft is None:
            ttft = t - start
        else:
            k = n - prev_n
            itls.extend([(t - prev_t) / k] * k)
        prev_t, prev_n = t, n
    if ttft is None:
        return RequestResult(ok=False, latency_s=end - start, error="no tokens received")
    return RequestResult(ok=True, output_tokens=prev_n, ttft_s=ttft, itls_s=tuple(itls),
                         latency_s=end - start)


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default 'linear' method)."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    rank = (len(xs) - 1) * (p / 100.0)
    lo, hi = math.floor(rank), math.ceil(rank)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (rank - lo))


@dataclass(frozen=True)
class Dist:
    """p50/p90/p99 (and mean) of a latency distribution, in milliseconds."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Dist:
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms) if ms else None
        return cls(percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), mean)


@dataclass(frozen=True)
class LevelStats:
    """What one concurrency level measured."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    req_s: float
    ttft_ms: Dist
    itl_ms: Dist
    latency_ms: Dist
    error_samples: tuple[str, ...] = field(default_factory=tuple)
    # The served accept length: tokens per verify step over the level's speculative requests (SGLang's
    # per-request spec_accept_length = completion_tokens / spec_verify_ct, pooled); None without speculation.
    accept_length: float | None = None
    standin: bool = False  # every number above came from the rehearsal's stand-in engines


def summarize(concurrency: int, results: Sequence[RequestResult], duration_s: float) -> LevelStats:
    """Aggregate one level: throughput over the level's wall time, distributions over requests."""
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    samples: list[str] = []
    for r in bad:
        if r.error not in samples:
            samples.append(r.error)
    spec = [r for r in ok if r.spec_verify_ct]
    verifies = sum(r.spec_verify_ct or 0 for r in spec)
    return LevelStats(
        concurrency=concurrency,
        requests=len(results),
        completed=len(ok),
        errors=len(bad),
        duration_s=duration_s,
        output_tokens=tokens,
        output_tok_s=tokens / dur,
        req_s=len(ok) / dur,
        ttft_ms=Dist.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=Dist.of_seconds([x for r in ok for x in r.itls_s]),
        latency_ms=Dist.of_seconds([r.latency_s for r in ok]),
        error_samples=tuple(samples[:3]),
        accept_length=sum(r.output_tokens for r in spec) / verifies if verifies else None,
        standin=any(r.standin for r in ok),
    )


def make_prompt(input_len: int, rng: random.Random) -> str:
    """A prompt of `input_len` plain words, different per request so no prefix cache flatters us."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, input_len)))


def generate_payload(prompt: str, output_len: int) -> dict[str, Any]:
    return {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }


def parse_concurrency(spec: str) -> tuple[int, ...]:
    """'1,16,64' -> (1, 16, 64); rejects zero, negatives and junk with a ValueError."""
    levels = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        n = int(part)
        if n < 1:
            raise ValueError(f"concurrency must be >= 1, got {n}")
        levels.append(n)
    if not levels:
        raise ValueError("no concurrency levels given")
    return tuple(levels)


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_table(levels: Iterable[LevelStats]) -> str:
    levels = list(levels)
    spec = any(s.accept_length is not None for s in levels)  # the column only where the server speculates
    header = ("conc", "reqs", "err", "out tok/s", "req/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms") + \
        (("accept len",) if spec else ())
    rows = [header]
    for s in levels:
        rows.append((
            str(s.concurrency), str(s.requests), str(s.errors), _fmt(s.output_tok_s), _fmt(s.req_s, 2),
            "/".join(_fmt(v) for v in (s.ttft_ms.p50, s.ttft_ms.p90, s.ttft_ms.p99)),
            "/".join(_fmt(v) for v in (s.itl_ms.p50, s.itl_ms.p90, s.itl_ms.p99)),
        ) + ((_fmt(s.accept_length, 2),) if spec else ()))
    out = "\n".join(format_table(rows[0], rows[1:], right=range(len(header))))
    for s in levels:
        for e in s.error_samples:
            out += f"\n  c={s.concurrency} error: {e}"
    if any(s.standin for s in levels):
        out += f"\n{STANDIN_LABEL} these times are the launcher's path to a stand-in, not a GPU box's"
    return out


def report_dict(meta: dict[str, Any], levels: Sequence[LevelStats]) -> dict[str, Any]:
    """The JSON document `--json` prints: stable keys, meant to be diffed across runs."""
    return {"schema": "v4flash-pd.bench/1", **meta, "levels": [asdict(s) for s in levels]}


# ------------------------------------------------------------------------------------- effects


def _split_url(url: str) -> tuple[str, str, int, str]:
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    return u.scheme, u.hostname, port, u.path.rstrip("/")


def stream_generate(url: str, payload: dict[str, Any], timeout: float = 600.0,
                    clock: Callable[[], float] = time.perf_counter,
                    headers: Mapping[str, str] | None = None) -> RequestResult:
    """POST one streaming `/generate` and time every SSE event as it arrives."""
    scheme, host, port, base = _split_url(url)
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    body = json.dumps(payload).encode()
    start = clock()
    events: list[tuple[float, int]] = []
    verify: int | None = None
    standin = False
    conn = conn_cls(host, port, timeout=timeout)
    try:
        conn.request("POST", base + "/generate", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read(300).decode("utf-8", "replace").strip()
            return RequestResult(ok=False, latency_s=clock() - start, error=f"HTTP {resp.status}: {text}")
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            now = clock()
            ev = parse_sse_line(line)
            if ev is None:
                continue
            if ev is DONE:
                done = True
                break
            if not isinstance(ev, dict):
                continue
            if "error" in ev:
                err = ev["error"]
                msg = err.get("message", err) if isinstance(err, dict) else err
                return RequestResult(ok=False, latency_s=now - start, error=f"stream error: {msg}")
            n = completion_tokens(ev)
            if n is not None:
                events.append((now, n))
            verify = spec_verify_ct(ev) or verify
            standin = standin or is_standin_reply(ev.get("meta_info"))
        end = clock()
    except (OSError, http.client.HTTPException) as exc:
        return RequestResult(ok=False, latency_s=clock() - start, error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    result = timings_from_events(start, events, end)
    if result.ok and not done:
        return RequestResult(ok=False, latency_s=end - start, error="stream ended without [DONE]")
    return replace(result, spec_verify_ct=verify, standin=standin)


def run_level(url: str, concurrency: int, prompts: Sequence[str], output_len: int,
              timeout: float = 600.0, progress: Progress | None = None,
              headers: Mapping[str, str] | None = None) -> LevelStats:
    """Send every prompt with at most `concurrency` in flight; throughput is over the level's wall time."""

    def one(prompt: str) -> RequestResult:
        r = stream_generate(url, generate_payload(prompt, output_len), timeout=timeout, headers=headers)
        if progress is not None:
            progress.tick(r.ok)
        return r

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        results = list(pool.map(one, prompts))
    finally:  # interrupted (the report stopping): drop the queued requests rather than send them all first
        pool.shutdown(wait=False, cancel_futures=True)
    duration = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    return summarize(concurrency, results, duration)


@dataclass(frozen=True)
class BenchSpec:
    url: str = DEFAULT_URL
    concurrency: tuple[int, ...] = (1, 16, 64)
    requests: int | None = None  # per level; None -> max(4 * concurrency, 8)
    input_len: int = 256
    output_len: int = 128
    warmup: int = 1
    seed: int = 0
    timeout_s: float = 600.0
    headers: tuple[tuple[str, str], ...] = ()  # e.g. the router's Authorization header


def requests_for(spec: BenchSpec, concurrency: int) -> int:
    return spec.requests if spec.requests else max(4 * concurrency, 8)


@dataclass(frozen=True)
class BenchReport:
    meta: dict[str, Any]
    levels: tuple[LevelStats, ...]

    @property
    def standin(self) -> bool:
        return any(s.standin for s in self.levels)

    def to_dict(self) -> dict[str, Any]:
        return report_dict({**self.meta, "standin": self.standin}, self.levels)


def run_bench(spec: BenchSpec, progress_stream: TextIO | None = None) -> BenchReport:
    """Warm up, then run every concurrency level in order."""
    _split_url(spec.url)
    rng = random.Random(spec.seed)
    for _ in range(spec.warmup):
        r = stream_generate(spec.url, generate_payload(make_prompt(spec.input_len, rng), min(8, spec.output_len)),
                            timeout=spec.timeout_s, headers=dict(spec.headers))
        if not r.ok:
            raise ConnectionError(f"warm-up request to {spec.url}/generate failed: {r.error}")
    levels = []
    for c in spec.concurrency:
        n = requests_for(spec, c)
        prompts = [make_prompt(spec.input_len, rng) for _ in range(n)]
        prog = Progress(n, f"c={c:<4}", stream=progress_stream)
        levels.append(run_level(spec.url, c, prompts, spec.output_len, spec.timeout_s, prog, dict(spec.headers)))
    meta = {
        "url": spec.url, "endpoint": "/generate", "input_len": spec.input_len, "output_len": spec.output_len,
        "seed": spec.seed, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return BenchReport(meta, tuple(levels))
