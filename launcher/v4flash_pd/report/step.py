"""`bench --step` for the report: one decode step (and prefill chunk) op by op on one GPU, upstream vs ours.

Run in the workers' interpreter and environment on the first GPU of a decode worker (the step
bench models a TP4 decode GPU), like the self-check. A rehearsal has no GPU: it records the bench's
plan of ops (`--dry-run`), marked as a stand-in, so the section exists with nothing measured.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Callable, Mapping

from v4flash_pd.errors import UserError
from v4flash_pd.plan import Plan, ProcessSpec
from v4flash_pd.selfcheck.jobs import interpreter_of

STEP_MODULE = "v4flash_bench.step"
TIMEOUT = 3600.0


def step_args(text: str) -> list[str]:
    try:
        args = shlex.split(text)
    except ValueError as exc:
        raise UserError(f"--step-args {text!r}: {exc}",
                        "quote it as one shell word, e.g. --step-args '--batches 1,16'") from None
    mine = [a for a in args if a.split("=", 1)[0] in ("--json", "--md", "--from-json", "--dry-run")]
    if mine:
        raise UserError(f"--step-args {text!r}: {mine[0].split('=', 1)[0]} is the report's to choose",
                        "pass only what to measure, e.g. --step-args '--batches 1,16 --contexts 128K'")
    return args


def _gpu_of(plan: Plan) -> tuple[ProcessSpec, int] | None:
    workers = sorted(plan.workers(), key=lambda w: (w.role != "decode", w.role != "server", w.name))
    for w in workers:
        if w.gpus:
            return w, w.gpus[0]
    return None


def run_step(out: Path, plan: Plan, extra: list[str], env: Mapping[str, str] | None = None,
             echo: Callable[[str], None] = print) -> dict[str, Any]:
    d = out / "step"
    d.mkdir(parents=True, exist_ok=True)
    found = _gpu_of(plan)
    if found is None:
        return {"status": "skipped", "why": "this plan starts no worker here"}
    spec, gpu = found
    child_env = dict(os.environ if env is None else env)
    child_env.update(dict(spec.env))
    child_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    argv = [interpreter_of(spec), "-m", STEP_MODULE]
    standin = plan.rehearse
    argv += ["--dry-run"] if standin else ["--json", str(d / "step.json"), "--md", str(d / "step.md")]
    argv += [] if standin else extra
    echo(f"step bench on GPU {gpu} ({spec.name}){' [rehearsal: --dry-run, nothing timed]' if standin else ''} ...")
    with open(d / "step.log", "w", encoding="utf-8") as log:
        log.write(f"# {' '.join(argv)}\n")
        log.flush()
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env, timeout=TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        except OSError as exc:
            log.write(f"cannot start {argv[0]}: {exc}\n")
            rc = 127
    res: dict[str, Any] = {"status": "ok" if rc == 0 else "failed", "rc": rc, "gpu": gpu, "worker": spec.name,
                           "standin": standin, "argv": argv, "log": "step/step.log", "compositions": []}
    if standin:
        res["why"] = "rehearsal: no GPU, the bench's plan of ops only (--dry-run)"
    elif rc != 0:
        tail = (d / "step.log").read_text(errors="replace").strip().splitlines()[-3:]
        res["why"] = " | ".join(tail)
    try:
        data = json.loads((d / "step.json").read_text())
        res["meta"] = data.get("meta", {})
        res["compositions"] = [{k: c.get(k) for k in ("spec", "upstream_ms", "patched_ms", "upstream_tok_s",
                                                      "patched_tok_s")} for c in data.get("compositions", [])]
    except (OSError, ValueError, AttributeError):
        pass
    return res
