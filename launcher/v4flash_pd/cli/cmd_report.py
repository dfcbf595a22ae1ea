"""`v4flash-pd report`: on a new box, run this first and send us the tarball it writes."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import click

from v4flash_pd import benchmark
from v4flash_pd.cli.forward import command_line
from v4flash_pd.cli.options import Options, RunOptions, pass_options, resolve, run_options
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.report import archive, interrupt
from v4flash_pd.report.run import SECTIONS, ReportSpec, make_report
from v4flash_pd.report.step import step_args as parse_step_args
from v4flash_pd.report.summary import markdown
from v4flash_pd.report.variants import all_variants, default_variants, pick
from v4flash_pd.routerauth import read_key
from v4flash_pd.selfcheck.gate import check_seams

_DEFAULTS = default_variants()
HELP = f"""Everything this box can tell us, in one directory and one .tar.gz: the fingerprint (GPUs, driver,
    PCIe topology with the P2P matrices, NUMA map, stack versions, doctor), the kernel self-check,
    `bench --step` (upstream vs ours per op on one GPU), and end to end through the router: `bench` at
    each concurrency and the accuracy gate with the patches on, with each patch off and with all off
    (one trio per configuration, started and stopped by the report). README.md starts with a summary
    table. No secret (the router key, secret-named environment values, in any spelling) is left in it:
    the report scrubs every file and refuses to call itself complete if its tarball still holds one.

    Takes `up`'s options (the report measures what that `up` runs). The GPUs and ports must be free.
    Expect one trio start per configuration: {len(_DEFAULTS)} by default ({", ".join(v.name for v in _DEFAULTS)});
    on a first start, hours. Ctrl-C, SIGTERM or SIGHUP stop the trio it is running before it exits.
    """


def _not_for_report(how: RunOptions) -> list[str]:
    """`up`'s options that make no sense for a report (it starts and stops its own runs, one per variant)."""
    return [flag for flag, given in (("--run-dir", how.run_dir is not None), ("--detach", how.detach),
                                     ("--eval", how.eval_gate), ("--strict-selfcheck", how.strict_selfcheck))
            if given]


@click.command("report", help=HELP, short_help="On a new box run this first and send us the tarball: facts, kernel "
                                               "self-check, step bench, end-to-end A/B per patch, accuracy gate.")
@run_options
@click.option("--out", "out_dir", type=click.Path(path_type=Path), envvar="V4FLASH_REPORT_OUT",
              help="Report directory (default ./v4flash-report-<host>-<time>); the tarball goes next to it.")
@click.option("--skip", default="", envvar="V4FLASH_REPORT_SKIP",
              help="Comma-separated sections to leave out: selfcheck, step, e2e.")
@click.option("--variants", default="all", show_default=True, envvar="V4FLASH_REPORT_VARIANTS",
              help="End-to-end configurations: all, or some of on, off, off-<patch> (e.g. on,off).")
@click.option("--concurrency", default="1,16,64", show_default=True, envvar="V4FLASH_REPORT_CONCURRENCY",
              help="Concurrent streams the end-to-end bench measures, one level after another.")
@click.option("--requests", "n_requests", type=int, default=None, envvar="V4FLASH_REPORT_REQUESTS",
              help="Requests per concurrency level [default: max(4 x concurrency, 8)].")
@click.option("--input-len", type=click.IntRange(min=1), default=256, show_default=True,
              envvar="V4FLASH_REPORT_INPUT_LEN", help="Prompt length in words (~tokens).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              envvar="V4FLASH_REPORT_OUTPUT_LEN", help="Generated tokens per request.")
@click.option("--step-args", default="", envvar="V4FLASH_REPORT_STEP_ARGS",
              help="Options for the step bench, e.g. \"--batches 1,16 --contexts 128K\".")
@click.option("--no-tar", is_flag=True, envvar="V4FLASH_REPORT_NO_TAR", help="Write the directory only.")
@click.option("--force", is_flag=True, envvar="V4FLASH_REPORT_FORCE",
              help="Replace an existing tarball of the same name (by default the report refuses to).")
@pass_options(run=True)
def command(opts: Options, how: RunOptions, out_dir: Path | None, skip: str, variants: str, concurrency: str,
            n_requests: int | None, input_len: int, output_len: int, step_args: str, no_tar: bool,
            force: bool) -> None:
    refused = _not_for_report(how)
    if refused:
        raise UserError(f"{refused[0]} does not apply to `report`: it starts and stops its own runs",
                        f"drop {' '.join(refused)}")
    sections = {s.strip() for s in skip.split(",") if s.strip()}
    if how.no_selfcheck:
        sections.add("selfcheck")
    bad = sorted(sections - set(SECTIONS))
    if bad:
        raise UserError(f"--skip: unknown section(s) {', '.join(bad)}", f"use some of: {', '.join(SECTIONS)}")
    try:
        levels = benchmark.parse_concurrency(concurrency)
    except ValueError as exc:
        raise UserError(f"--concurrency {concurrency!r}: {exc}", "give positive integers, e.g. 1,16,64") from None
    if n_requests is not None and n_requests < 1:
        raise UserError(f"--requests must be >= 1, got {n_requests}", "e.g. --requests 64")
    extra = parse_step_args(step_args)
    if "selfcheck" not in sections:
        check_seams(os.environ)
    # what `up` would start, refused for what `up` refuses (busy ports, no model, missing GPUs): every
    # variant is an `up` of this plan with other switches
    r = resolve(opts, "up")
    if "e2e" not in sections:
        pick(all_variants(r.plan.patches, [], r.plan.pending_patches), variants)  # names checked up front
    if r.plan.router_auth[0]:
        read_key(*r.plan.router_auth)  # a missing or malformed key is refused now, not after hours of facts
    out = _out_dir(out_dir, tar=not no_tar, force=force)
    # each variant's `up` gets these, then its own `--<switch> on|off` for every patch
    forward = command_line(opts, how, run_fields=("verify_model",),
                           leave_out={f"patches.{name}" for name, _ in r.plan.patches})
    spec = ReportSpec(out=out, skip=frozenset(sections), variants=variants, concurrency=levels,
                      requests=n_requests, input_len=input_len, output_len=output_len, step_args=tuple(extra),
                      forward=tuple(forward), questions=how.eval_questions, min_accuracy=how.eval_min_accuracy,
                      tar=not no_tar, force=force)
    restore = interrupt.install()
    try:
        rep = make_report(r.plan, r.topology, r.config.ready_timeout, spec, click.echo)
    except interrupt.Interrupted as exc:
        raise _interrupted(exc, out) from None
    except OSError as exc:  # the report directory's disk (full, gone read-only): every trio is stopped already
        raise RuntimeFailure(f"cannot write the report in {out}: {exc.strerror or exc}"
                             + (f" ({exc.filename})" if exc.filename else "") + "; the report is not complete",
                             f"free space there (df -h {out}) or run the report again with --out on a filesystem "
                             "with room") from None
    finally:
        restore()
    for item in rep.get("left_out") or []:
        click.echo(f"note: left out of the tarball: {item}", err=True)
    click.echo("")
    click.echo(markdown(rep).split("\n## End to end")[0].rstrip())
    click.echo("")
    where = rep.get("tarball") or str(out)
    if rep["failures"]:
        raise RuntimeFailure(f"the report is written ({where}) but {len(rep['failures'])} part(s) failed: "
                             + "; ".join(rep["failures"]),
                             f"send us {where} as it is: the failures are what we need to see")
    click.echo(f"report written: {where} -- please send us this file")


def _interrupted(exc: interrupt.Interrupted, out: Path) -> UserError:
    stopped = [name for name, left in exc.trios if not left]
    left = [f"[{name}]: {', '.join(procs)}" for name, procs in exc.trios if procs]
    what = ("it stopped the trio it had started" + (f" ({', '.join(stopped)})" if stopped else "")
            + ("; nothing of it is left running" if not left else "") if exc.trios else "no trio was running")
    if left:
        what += f"; STILL RUNNING: {'; '.join(left)}"
    return UserError(f"the report was interrupted by {exc.name}: {what}; the partial report in {out} is not complete "
                     "(no tarball)",
                     "stop what is listed as still running with `v4flash-pd down --run-dir DIR`, then run the "
                     "report again" if left else "run the report again when the box can be spared; do not send "
                     "the partial one", exit_code=exc.exit_code)


def _out_dir(given: Path | None, tar: bool, force: bool) -> Path:
    """The report directory, resolved (a link given as --out is followed: the report and its tarball are
    the real directory's), new or empty, writable; and no older tarball in the way of this one's."""
    out = given if given is not None else Path(f"v4flash-report-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}")
    out = Path(os.path.realpath(out.expanduser()))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty directory",
                        "pass a new --out DIR (a report never mixes with an older one)")
    if tar:
        archive.check_target(out, force)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("ok\n")
        (out / ".write-test").unlink()
    except OSError as exc:
        raise UserError(f"cannot write the report directory {out}: {exc.strerror or exc}",
                        "pass a writable --out DIR") from None
    return out
