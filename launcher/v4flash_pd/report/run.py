"""Make the report: every section in turn, each one's failure recorded, then summary, scrub, tarball,
and a last scan of the tarball that refuses to call the report complete if any secret is in it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from v4flash_pd.errors import RuntimeFailure
from v4flash_pd.plan import Plan
from v4flash_pd.report import archive, facts, scrub, summary, variants
from v4flash_pd.report.interrupt import Interrupted, interrupted, shielded
from v4flash_pd.report.redact import Redactor, redact_env
from v4flash_pd.report.step import run_step
from v4flash_pd.routerauth import auth_headers
from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.driver import Interrupted as SelfcheckInterrupted
from v4flash_pd.selfcheck.gate import patches_to_check, run_check
from v4flash_pd.topology import Topology

SCHEMA = "v4flash-pd.report/1"
SECTIONS = ("selfcheck", "step", "e2e")


@dataclass(frozen=True)
class ReportSpec:
    out: Path
    skip: frozenset[str]
    variants: str
    concurrency: tuple[int, ...]
    requests: int | None
    input_len: int
    output_len: int
    step_args: tuple[str, ...]
    forward: tuple[str, ...]  # `up`'s options as given to `report`, less the kernel switches (each variant sets them)
    questions: int
    min_accuracy: float
    tar: bool = True
    force: bool = False  # replace an older tarball of the same name


def make_report(plan: Plan, topology: Topology, ready_timeout: float, spec: ReportSpec,
                echo: Callable[[str], None], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`plan`: what `up` would start on this box (`topology`), resolved as `up` resolves it (the report
    refuses what `up` refuses); `ready_timeout`: how long that `up` waits for READY."""
    env = dict(os.environ if env is None else env)
    out = spec.out
    out.mkdir(parents=True, exist_ok=True)
    secrets = scrub.known_secrets(plan.router_auth, [kv for p in plan.processes for kv in p.env], env)
    rep: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "host": socket.gethostname(), "standin": plan.rehearse, "profile": plan.profile,
                           "concurrency": list(spec.concurrency), "skipped": sorted(spec.skip), "failures": []}
    try:
        _sections(plan, topology, ready_timeout, spec, echo, env, rep, secrets)
    except Interrupted as exc:
        rep["interrupted"] = exc.name
        with shielded():  # what is there is partial, but secret-free all the same
            _write(out, rep)
            scrub.scrub_tree(out, secrets)
        raise
    if spec.tar:
        rep["tarball"] = str(archive.target(out))
    _write(out, rep)
    scrubbed = scrub.scrub_tree(out, secrets)
    rep["scrubbed"] = sorted({*scrubbed, *(f for v in rep.get("e2e") or [] for f in v.get("scrubbed") or [])})
    if rep["scrubbed"]:
        _write(out, rep)
        scrub.scrub_tree(out, secrets)
    _refuse_if_found(scrub.scan_tree(out, secrets), str(out), None)
    if spec.tar:
        packed = archive.pack(out, spec.force)
        rep["left_out"] = list(packed.left_out)
        _refuse_if_found(scrub.scan_tarball(packed.path, secrets), str(packed.path), packed.path)
    return rep


def _refuse_if_found(found: list[str], where: str, tarball: Path | None) -> None:
    """The last word on secrets: anything found after the scrub means the report is not fit to send."""
    if not found:
        return
    if tarball is not None:
        tarball.unlink(missing_ok=True)
    shown = ", ".join(found[:10]) + (f" (and {len(found) - 10} more)" if len(found) > 10 else "")
    raise RuntimeFailure(f"a secret is still in the report after the scrub, in {where}: {shown}; "
                         + ("the tarball was deleted" if tarball is not None else "no tarball was written"),
                         "do not send the report; remove or redact those files by hand and tell us which kind of "
                         "file held the secret, so the scrub learns it")


def _sections(plan: Plan, topology: Topology, ready_timeout: float, spec: ReportSpec, echo: Callable[[str], None],
              env: dict[str, str], rep: dict[str, Any], secrets: Redactor) -> None:
    out = spec.out
    echo(f"report -> {out}")
    echo("facts: fingerprint, GPUs, PCIe/P2P topology, NUMA map, stack versions ...")
    rep["facts"] = facts.collect(out, topology, env)
    (out / "fingerprint" / "plan.json").write_text(json.dumps(redact_env(plan.to_dict()), indent=2) + "\n")
    _doctor(out, [*spec.forward, *variants.switch_args(plan.patches)], env)

    failed: list[str] = []
    if "selfcheck" in spec.skip:
        rep["selfcheck"] = {"skipped": "--skip selfcheck"}
    else:
        if patches_to_check(plan) and plan.workers():
            try:
                sc = run_check(plan, out, echo, env)
            except SelfcheckInterrupted as exc:  # SIGTERM/SIGHUP: its own handlers had them (its children are gone)
                raise interrupted(str(exc)) from None
            sc["decision"] = "checked"
            result.write(out, sc)
            failed = result.failed(sc)
            rep["selfcheck"] = result.brief(sc)
            if failed:
                rep["failures"].append(f"kernel self-check failed for {', '.join(failed)}")
        else:
            rep["selfcheck"] = {"skipped": "no kernel patch is switched on (or no worker on this box)"}

    if "step" in spec.skip:
        rep["step"] = {"status": "skipped", "why": "--skip step"}
    else:
        rep["step"] = run_step(out, plan, list(spec.step_args), env, echo)
        if rep["step"]["status"] == "failed":
            rep["failures"].append(f"step bench failed: {rep['step'].get('why')}")

    rep["e2e"] = []
    if "e2e" in spec.skip:
        rep["e2e_skipped"] = "--skip e2e"
        return
    # an `auto` switch is on in the variants only where this report's self-check passed it, as in `up`
    vouched = plan.pending_patches if "selfcheck" not in spec.skip else ()
    chosen = variants.pick(variants.all_variants(plan.patches, failed, vouched), spec.variants)
    shared = variants.E2E(
        out=out, forward=spec.forward, concurrency=spec.concurrency, requests=spec.requests,
        input_len=spec.input_len, output_len=spec.output_len, questions=spec.questions,
        min_accuracy=spec.min_accuracy, headers=auth_headers(plan.router_auth, env),
        up_timeout=ready_timeout + 300.0, selfchecked="selfcheck" not in spec.skip,
        standin=plan.rehearse, env=env, echo=echo, redactor=secrets)
    for v in chosen:
        res = variants.run_variant(v, shared)
        rep["e2e"].append(res)
        if res["status"] != "ok":
            rep["failures"].append(f"end to end [{v.name}]: {res.get('error')}")


def _write(out: Path, rep: dict[str, Any]) -> None:
    (out / "report.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    (out / "README.md").write_text(summary.markdown(rep))


def _doctor(out: Path, args: list[str], env: Mapping[str, str]) -> None:
    """`doctor --json` of the plan `up` would start (`args`: up's options, kernel switches included)."""
    argv = [sys.executable, "-m", "v4flash_pd", "doctor", "--json", *args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=dict(env), timeout=600)
        text = p.stdout if p.stdout.strip() else json.dumps({"error": p.stderr.strip()[-2000:], "rc": p.returncode})
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = json.dumps({"error": str(exc)})
    (out / "fingerprint" / "doctor.json").write_text(text.rstrip() + "\n")
