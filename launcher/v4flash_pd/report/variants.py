"""The end-to-end A/B: one trio per patch configuration, measured through its router, then stopped.

A kernel switch is read by each worker at exec, so every configuration is its own `up` (detached,
into a run dir inside the report, with `--<patch> on|off` for every patch: through the plan),
then `bench` at the report's concurrencies and the accuracy gate through its router, then `down`.
Configurations: `on` (the patches `up` would run: failures of the self-check already off), one
`off-<patch>` per patch that is on, and `off` (SGLang's own sm_120 path everywhere). A variant
that fails to start is recorded with its launcher's output and the next one runs.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from v4flash_pd.config.keys import KEY, PATCH_SWITCHES
from v4flash_pd.config.values import AUTO
from v4flash_pd.errors import UserError
from v4flash_pd.report import trio
from v4flash_pd.report.interrupt import Interrupted, shielded
from v4flash_pd.report.redact import Redactor, redact_env
from v4flash_pd.report.scrub import scrub_tree

KEEP_LOG_LINES = 4000


def switch_args(switches: tuple[tuple[str, bool], ...]) -> list[str]:
    """`--<switch> on|off` for every (patch, on) pair: the options `up` and `doctor` read them from."""
    out: list[str] = []
    for name, on in switches:
        flag = KEY[f"patches.{name}"].flag
        assert flag is not None, f"patches.{name} has no option"
        out += [flag.name, "on" if on else "off"]
    return out


@dataclass(frozen=True)
class Variant:
    name: str  # on | off | off-<patch>
    switches: tuple[tuple[str, bool], ...]

    def args(self) -> list[str]:
        return switch_args(self.switches)

    def words(self) -> str:
        return ", ".join(f"{n} {'on' if on else 'off'}" for n, on in self.switches)


def all_variants(patches: tuple[tuple[str, bool], ...], failed: list[str],
                 pending: tuple[str, ...] = ()) -> list[Variant]:
    """`pending`: the plan's `auto` switches, on in a variant once the report's self-check passed them
    (as `up` would switch them on); every variant then names each switch explicitly."""
    base = tuple((n, (on or n in pending) and n not in failed) for n, on in patches)
    out = [Variant("on", base)]
    on_names = [n for n, on in base if on]
    for name in on_names:
        out.append(Variant(f"off-{name}", tuple((n, on and n != name) for n, on in base)))
    if len(on_names) > 1:
        out.append(Variant("off", tuple((n, False) for n, _ in base)))
    return out


def default_variants() -> list[Variant]:
    """The configurations a report runs with every patch at its default (what `--help` counts)."""
    defaults = {name: KEY[f"patches.{name}"].default for name, _ in PATCH_SWITCHES}
    return all_variants(tuple((n, d is True) for n, d in defaults.items()), [],
                        tuple(n for n, d in defaults.items() if d == AUTO))


def pick(variants: list[Variant], choice: str) -> list[Variant]:
    """`all`, or a comma list of names (`on`, `off`, `off-moe`, ...); UserError names an unknown one."""
    if choice.strip() in ("", "all"):
        return variants
    by_name = {v.name: v for v in variants}
    wanted = [c.strip() for c in choice.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in by_name]
    if unknown:
        raise UserError(f"--variants: unknown variant(s) {', '.join(unknown)}",
                        f"use all, or some of: {', '.join(by_name)}")
    return [by_name[c] for c in wanted]


@dataclass(frozen=True)
class E2E:
    """What every variant shares: how to start `v4flash-pd`, what to forward, what to measure."""

    out: Path
    forward: tuple[str, ...]
    concurrency: tuple[int, ...]
    requests: int | None
    input_len: int
    output_len: int
    questions: int
    min_accuracy: float
    headers: Mapping[str, str]
    up_timeout: float
    selfchecked: bool
    standin: bool
    env: Mapping[str, str] = field(default_factory=dict)
    echo: Callable[[str], None] = print
    warn: Callable[[str], None] = field(default=lambda m: print(m, file=sys.stderr, flush=True))
    redactor: Redactor = field(default_factory=lambda: Redactor(()))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "v4flash_pd", *args]


def run_variant(v: Variant, e: E2E) -> dict[str, Any]:
    """Start the variant's trio, measure it, stop it. Whatever ends this (a failure, a signal), the trio
    is stopped before it returns; an `Interrupted` goes on up with what was left of the trio attached."""
    d = e.out / "e2e" / v.name
    d.mkdir(parents=True, exist_ok=True)
    run_dir = d / "run"
    res: dict[str, Any] = {"name": v.name, "switches": dict(v.switches), "status": "failed", "standin": e.standin,
                           "run_dir": str(run_dir.relative_to(e.out)), "bench": None, "eval": None, "error": None}
    argv = _cli("up", *e.forward, *v.args(), "--detach", "--run-dir", str(run_dir),
                *(["--no-selfcheck"] if e.selfchecked else []))
    e.echo(f"end to end [{v.name}: {v.words()}]: starting the trio ...")
    t0 = time.monotonic()
    interrupted: Interrupted | None = None
    try:
        with open(d / "up.log", "w", encoding="utf-8") as log:
            log.write(f"# {shlex.join(argv)}\n")
            log.flush()
            try:  # its own session: a Ctrl-C at the terminal reaches the report, which stops the trio
                rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(e.env),
                                    timeout=e.up_timeout, start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        res["up_seconds"] = round(time.monotonic() - t0, 1)
        if rc != 0:
            tail = (d / "up.log").read_text(errors="replace").strip().splitlines()[-4:]
            res["error"] = f"`up` exited {rc}: " + " | ".join(tail)
            return res
        url = json.loads((run_dir / "plan.json").read_text()).get("probe_url")
        res["url"] = url
        res["bench"] = _bench(url, e, d)
        res["eval"] = _eval(url, e, d)
        bad = [k for k in ("bench", "eval") if (res[k] or {}).get("error")]
        res["status"] = "ok" if not bad else "failed"
        if bad:
            res["error"] = "; ".join(f"{k}: {res[k]['error']}" for k in bad)
        return res
    except Interrupted as exc:
        interrupted = exc
        res["error"] = f"interrupted by {exc.name}"
        e.warn(f"report: {exc.name} received; stopping the trio of [{v.name}] ({run_dir}) ...")
        raise
    finally:
        with shielded():
            left = trio.stop(run_dir, e.env, d / "down.log")
            res["left_running"] = left
            if left:
                e.warn(f"WARNING the trio of [{v.name}] is still running after the stop: {', '.join(left)}; stop it "
                       f"with `v4flash-pd down --run-dir {run_dir}`")
                res["status"] = "failed"
                res["error"] = "; ".join(x for x in (res["error"], f"still running after the stop: {', '.join(left)}")
                                         if x)
            if interrupted is not None:
                interrupted.trios.append((v.name, left))
                if not left:
                    e.warn(f"report: the trio of [{v.name}] is stopped; nothing of it is left running")
            if run_dir.is_dir():
                _tidy(run_dir)
            res["scrubbed"] = [str((d / f).relative_to(e.out)) for f in scrub_tree(d, e.redactor)]
        e.echo(f"end to end [{v.name}]: {res['status']}" + (f" ({res['error']})" if res["error"] else ""))


def _bench(url: str, e: E2E, d: Path) -> dict[str, Any]:
    from v4flash_pd import benchmark

    spec = benchmark.BenchSpec(url=url, concurrency=e.concurrency, requests=e.requests, input_len=e.input_len,
                               output_len=e.output_len, warmup=1, headers=tuple(e.headers.items()))
    try:
        rep = benchmark.run_bench(spec).to_dict()
    except (ConnectionError, ValueError) as exc:
        return {"error": str(exc)}
    rep["standin"] = e.standin
    (d / "bench.json").write_text(json.dumps(rep, indent=2) + "\n")
    errors = sum(level.get("errors", 0) for level in rep["levels"])
    if errors:
        rep["error"] = f"{errors} request(s) failed"
    return rep


def _eval(url: str, e: E2E, d: Path) -> dict[str, Any]:
    from v4flash_pd import evalgate

    try:
        r = evalgate.run_eval(url, e.questions, e.min_accuracy, headers=dict(e.headers))
    except ValueError as exc:
        return {"error": str(exc)}
    out = r.to_dict()
    out["standin"] = e.standin
    (d / "eval.json").write_text(json.dumps(out, indent=2) + "\n")
    if r.errors == r.total:
        out["error"] = "every request failed"
    return out


def _tidy(run_dir: Path) -> None:
    """Keep what explains the run (plan, state, events, patch status, log tails); redact env secrets."""
    for pattern in ("*.pid", ".lock", ".write-test"):
        for p in run_dir.glob(pattern):
            p.unlink(missing_ok=True)
    for name in ("plan.json", "config.json"):
        p = run_dir / name
        try:
            p.write_text(json.dumps(redact_env(json.loads(p.read_text())), indent=2) + "\n")
        except (OSError, ValueError):
            pass
    for log in run_dir.glob("*.log"):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        if len(lines) > KEEP_LOG_LINES:
            log.write_text(f"# v4flash-pd report: first {len(lines) - KEEP_LOG_LINES} lines dropped\n"
                           + "\n".join(lines[-KEEP_LOG_LINES:]) + "\n")
