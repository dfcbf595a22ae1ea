"""A launch: what `up` resolved before the first process starts, and the one function that runs it.

`up` runs it in the foreground; `up --detach` hands it, as JSON on stdin, to a background launcher
(`python -m v4flash_pd.launch RUN_DIR`) that runs exactly that plan: the child never parses the
command line or probes the host again, so what was checked in the foreground is what starts.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from v4flash_pd import docformat
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.evalgate import render, run_eval
from v4flash_pd.plan import Plan
from v4flash_pd.routerauth import auth_headers
from v4flash_pd.rundir import RunDir
from v4flash_pd.supervisor import Supervisor


@dataclass(frozen=True)
class Launch:
    plan: Plan
    config: dict[str, Any]  # the resolved Config, as config.json records it
    fingerprint: dict[str, Any]  # what ran, as fingerprint.json records it
    grace: float
    ready_timeout: float
    smoke_prompt: str
    hang_timeout: float
    eval_questions: int = 0  # the accuracy gate before READY: 0 = none
    eval_min_accuracy: float = 0.8

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        return docformat.stamp(docformat.LAUNCH, d)

    @classmethod
    def from_dict(cls, d: Any) -> Launch:
        if docformat.marker_of(d) != docformat.LAUNCH:
            raise ValueError(f"not a {docformat.LAUNCH} document (format {docformat.marker_of(d)!r})")
        fields = {k: v for k, v in d.items() if k not in ("format", "plan")}
        return cls(plan=Plan.from_dict(d["plan"]), **fields)


def eval_gate(questions: int, min_accuracy: float) -> Callable[[Supervisor], None]:
    """The accuracy gate the supervisor runs between the smoke request and READY."""
    def gate(sup: Supervisor) -> None:
        sup.say(f"accuracy gate: {questions} generated arithmetic problems through {sup.plan.probe_url}")
        res = run_eval(sup.plan.probe_url, questions, min_accuracy, headers=auth_headers(sup.plan.router_auth))
        sup.rundir.write_json("eval.json", res.to_dict())
        sup.say(render(res))
        if not res.passed:
            raise RuntimeFailure(
                f"accuracy gate failed: {res.correct}/{res.total} correct ({res.accuracy:.0%} < {min_accuracy:.0%})",
                "answers are wrong while the servers look healthy: suspect KV transfer (NIXL/UCX env, "
                "sglang#23773-class bugs); compare with `--profile rtx6000-tp4` (no PD)",
            )
    return gate


def run_launch(launch: Launch, rundir: RunDir, echo: Callable[[str], None]) -> None:
    """Take the run dir (a second `up` on it is refused), record what runs, and run it start to stop."""
    rundir.lock()  # held until this process exits (`up` took it already: then it is ours)
    for name, doc in (("config.json", launch.config), ("plan.json", launch.plan.to_dict()),
                      ("fingerprint.json", launch.fingerprint)):
        try:  # nothing has started yet: a full or failing disk is refused here, before any process
            rundir.write_json(name, doc)
        except OSError as exc:
            raise UserError(f"cannot write {rundir.file(name)}: {exc.strerror or exc}; nothing was started",
                            f"free space in {rundir.path} (df -h {rundir.path}) or pass a --run-dir on another "
                            "filesystem") from None
    Supervisor(launch.plan, rundir, echo=echo, grace=launch.grace, ready_timeout=launch.ready_timeout,
               smoke_prompt=launch.smoke_prompt, hang_timeout=launch.hang_timeout,
               after_ready=eval_gate(launch.eval_questions, launch.eval_min_accuracy) if launch.eval_questions
               else None).run()


USAGE = "python -m v4flash_pd.launch RUN_DIR [--lock-fd FD] (the launch as JSON on stdin)"


def main(argv: list[str] | None = None) -> None:
    """The background launcher of `up --detach`: `python -m v4flash_pd.launch RUN_DIR --lock-fd FD`, the
    launch on stdin; FD is the run dir's lock, which the detaching `up` took before its self-check."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) not in (1, 3) or (len(args) == 3 and (args[1] != "--lock-fd" or not args[2].isdigit())):
            raise UserError(f"usage: {USAGE}",
                            "start runs with `v4flash-pd up --detach`; this entry point is its background half")
        if len(args) == 3:
            RunDir(Path(args[0])).adopt_lock(int(args[2]))
        try:
            launch = Launch.from_dict(json.loads(sys.stdin.read()))
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"the launch handed to the background launcher is unreadable: {exc!r}",
                            "start it with `v4flash-pd up --detach` of this same version") from None
        run_launch(launch, RunDir(Path(args[0])), echo=lambda m: print(m, flush=True))
    except UserError as exc:
        print(exc.render(), file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
