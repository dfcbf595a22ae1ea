"""`v4flash-pd selfcheck`: run the kernel self-check `up` runs first, on its own (same options as `up`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from v4flash_pd.cli.common import json_option
from v4flash_pd.cli.options import Options, RunOptions, pass_options, resolve, run_options
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.rundir import runs_root
from v4flash_pd.selfcheck import result
from v4flash_pd.selfcheck.gate import patches_to_check, plan_gpus, run_check


@click.command("selfcheck", short_help="Check every kernel patch on this box's GPUs against fp64 and upstream "
                                       "(what `up` runs first).")
@run_options
@click.option("--out", "out_dir", type=click.Path(path_type=Path), envvar="V4FLASH_SELFCHECK_OUT",
              help="Directory for selfcheck.json and the per-GPU logs (default: a new selfcheck-<time> dir under the "
                   "runs root).")
@json_option("Print the result as JSON (schema v4flash-pd.selfcheck/1) instead of the table.")
@pass_options(run=True)
def command(opts: Options, how: RunOptions, out_dir: Path | None, as_json: bool) -> None:
    """On every GPU the plan uses, one process per GPU in parallel: each switched-on kernel patch against
    its fp64 reference and upstream's function, at small shapes and at the workers' production shapes
    (B=1, the largest captured batch, one prefill chunk), plus a CUDA-graph capture and replay.

    Takes `up`'s options, so it checks what that `up` would run. Exit 0 when every patch passed,
    1 when one failed (`up` would switch it off), 2 for bad options.
    """
    if how.no_selfcheck:
        raise UserError("--no-selfcheck skips the very thing `selfcheck` does", "drop --no-selfcheck")
    r = resolve(opts, "selfcheck")
    plan = r.plan
    if not plan.workers():
        raise UserError("this part of the cluster plan starts no worker, so there is no GPU to check",
                        "run it with --box K (a box with workers), or without --role router")
    if not patches_to_check(plan):
        raise UserError("every kernel patch is switched off in this plan: nothing to check",
                        "drop the `--<switch> off` flags (or patches.<name> = false) of the kernels to check")
    if not plan.rehearse:
        have = {g.index for g in r.topology.gpus}
        missing = [g for g in plan_gpus(plan) if g not in have]
        if missing:
            raise UserError(f"the plan uses GPUs {plan_gpus(plan)} but this box has {sorted(have) or 'none'} "
                            f"(topology {r.topology.source or 'probed'})",
                            "run it on the box the plan is for, or pick its GPUs (e.g. --set prefill.0.gpus=[0,1]); "
                            "`--rehearse` rehearses the check without a GPU")
    out = _out_dir(out_dir)
    echo = (lambda m: click.echo(m, err=True)) if as_json else click.echo
    summary = run_check(plan, out, echo)
    summary["decision"] = "checked"
    result.write(out, summary)
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        click.echo(result.render(summary))
        click.echo(f"result   {out / result.FILE}  (logs in {out / 'selfcheck'})")
    for line in result.warnings(summary, "`up` would switch it off for its run"):
        click.echo(line, err=True)
    bad = result.failed(summary)
    if bad:
        raise RuntimeFailure(f"kernel self-check failed for {', '.join(bad)}",
                             f"`up` switches failing patches off by itself (--strict-selfcheck refuses instead); "
                             f"please send us `v4flash-pd report` (the logs are in {out / 'selfcheck'})")
    sys.stdout.flush()


def _out_dir(given: Path | None) -> Path:
    out = given if given is not None else runs_root() / f"selfcheck-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write the self-check's directory {out}: {exc.strerror or exc}",
                        "pass a writable --out DIR (or set V4FLASH_RUNS_ROOT)") from None
    return out.absolute()
