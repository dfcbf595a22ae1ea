"""`v4flash-pd report`: on a new box, run this first and send us the tarball it writes."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import click

from v4flash_pd.cli.options import pass_params, resolve, run_options
from v4flash_pd.errors import RuntimeFailure, UserError

# `up`'s options that make no sense for a report (it starts and stops its own runs, one per variant).
_NOT_FOR_REPORT = {"run_dir": "--run-dir", "detach": "--detach", "eval_gate": "--eval",
                   "strict_selfcheck": "--strict-selfcheck"}


@click.command("report", short_help="On a new box run this first and send us the tarball: facts, kernel self-check, "
                                    "step bench, end-to-end A/B per patch, accuracy gate.")
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
@pass_params
def command(params: dict[str, Any]) -> None:
    """Everything this box can tell us, in one directory and one .tar.gz: the fingerprint (GPUs, driver,
    PCIe topology with the P2P matrices, NUMA map, stack versions, doctor), the kernel self-check,
    `bench --step` (upstream vs ours per op on one GPU), and end to end through the router: `bench` at
    each concurrency and the accuracy gate with the patches on, with each patch off and with all off
    (one trio per configuration, started and stopped by the report). README.md starts with a summary
    table. The router key never appears in it.

    Takes `up`'s options (the report measures what that `up` runs). The GPUs and ports must be free.
    Expect about one trio start per configuration (five by default): on a first start, hours.
    """
    from v4flash_pd import benchmark
    from v4flash_pd.report.forward import forwarded_args, option_names
    from v4flash_pd.report.run import SECTIONS, ReportSpec, make_report
    from v4flash_pd.report.step import step_args

    for name, flag in _NOT_FOR_REPORT.items():
        if params.get(name):
            raise UserError(f"{flag} does not apply to `report`: it starts and stops its own runs",
                            f"drop {flag}")
    skip = {s.strip() for s in params["skip"].split(",") if s.strip()}
    if params.get("no_selfcheck"):
        skip.add("selfcheck")
    bad = sorted(skip - set(SECTIONS))
    if bad:
        raise UserError(f"--skip: unknown section(s) {', '.join(bad)}", f"use some of: {', '.join(SECTIONS)}")
    try:
        concurrency = benchmark.parse_concurrency(params["concurrency"])
    except ValueError as exc:
        raise UserError(f"--concurrency {params['concurrency']!r}: {exc}", "give positive integers, e.g. 1,16,64") from None
    if params["n_requests"] is not None and params["n_requests"] < 1:
        raise UserError(f"--requests must be >= 1, got {params['n_requests']}", "e.g. --requests 64")
    extra = step_args(params["step_args"])
    if "selfcheck" not in skip:
        from v4flash_pd.selfcheck.gate import check_seams

        check_seams(os.environ)
    r = resolve(params, "up")  # what `up` would start, refused for what `up` refuses (busy ports, no model, GPUs)
    from v4flash_pd.report import variants

    if "e2e" not in skip:
        variants.pick(variants.all_variants(r.plan.patches, []), params["variants"])  # names checked up front
    out = _out_dir(params.get("out_dir"))
    names = option_names(run_options) - set(_NOT_FOR_REPORT) - {"no_selfcheck"} - {
        f"patch_{n}" for n, _ in r.plan.patches}
    spec = ReportSpec(out=out, skip=frozenset(skip), variants=params["variants"], concurrency=concurrency,
                      requests=params["n_requests"], input_len=params["input_len"], output_len=params["output_len"],
                      step_args=tuple(extra), forward=tuple(forwarded_args(click.get_current_context(), names)),
                      questions=params["eval_questions"], min_accuracy=params["eval_min_accuracy"],
                      tar=not params["no_tar"])
    rep = make_report(r, spec, click.echo)
    from v4flash_pd.report.summary import markdown

    click.echo("")
    click.echo(markdown(rep).split("\n## End to end")[0].rstrip())
    click.echo("")
    where = rep.get("tarball") or str(out)
    if rep["failures"]:
        raise RuntimeFailure(f"the report is written ({where}) but {len(rep['failures'])} part(s) failed: "
                             + "; ".join(rep["failures"]),
                             f"send us {where} as it is: the failures are what we need to see")
    click.echo(f"report written: {where} -- please send us this file")


def _out_dir(given: Path | None) -> Path:
    out = given if given is not None else Path(f"v4flash-report-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}")
    out = out.absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty directory",
                        "pass a new --out DIR (a report never mixes with an older one)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("ok\n")
        (out / ".write-test").unlink()
    except OSError as exc:
        raise UserError(f"cannot write the report directory {out}: {exc.strerror or exc}",
                        "pass a writable --out DIR") from None
    return out
