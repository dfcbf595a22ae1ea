"""`v4flash-pd eval`: the offline accuracy gate against a running router (or one engine)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from v4flash_pd import evalgate
from v4flash_pd.cli.common import json_option
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.routerauth import auth_headers


@click.command("eval")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="V4FLASH_EVAL_URL",
              help="Router (or single engine) base URL; questions go to <url>/generate.")
@click.option("--questions", type=int, default=50, show_default=True, envvar="V4FLASH_EVAL_QUESTIONS",
              help="How many generated arithmetic word problems to ask.")
@click.option("--min-accuracy", type=float, default=0.9, show_default=True, envvar="V4FLASH_EVAL_MIN_ACCURACY",
              help="Fail (exit 1) below this fraction of exact final-number matches.")
@click.option("--seed", type=int, default=0, show_default=True, envvar="V4FLASH_EVAL_SEED",
              help="Seed of the generated questions (same seed, same questions).")
@click.option("--shots", type=click.IntRange(min=0, max=8), default=2, show_default=True,
              envvar="V4FLASH_EVAL_SHOTS", help="Worked examples prepended to every question.")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              envvar="V4FLASH_EVAL_CONCURRENCY", help="Questions in flight at once.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              envvar="V4FLASH_EVAL_MAX_TOKENS", help="max_new_tokens per answer.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              envvar="V4FLASH_EVAL_TIMEOUT", help="Per-request timeout in seconds.")
@click.option("--show-failures", type=click.IntRange(min=0), default=3, show_default=True,
              envvar="V4FLASH_EVAL_SHOW_FAILURES", help="How many failed questions to print.")
@json_option("Print the result as JSON (accuracy, threshold, failures).")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None, envvar="V4FLASH_EVAL_API_KEY_FILE",
              help="File holding the router's API key (a router started with router.api_key_file).")
@click.option("--api-key-env", metavar="NAME", default=None, envvar="V4FLASH_EVAL_API_KEY_ENV",
              help="Environment variable holding the router's API key.")
@click.option("--baseline", type=click.Path(dir_okay=False, path_type=Path), default=None, envvar="V4FLASH_EVAL_BASELINE",
              help="An earlier `eval --json` result on the same questions (e.g. with speculative decoding off): also "
                   "fail when accuracy dropped by more than --max-drop against it.")
@click.option("--max-drop", type=click.FloatRange(0.0, 1.0), default=0.04, show_default=True,
              envvar="V4FLASH_EVAL_MAX_DROP", help="Largest accuracy drop against --baseline that still passes.")
def command(url: str, questions: int, min_accuracy: float, seed: int, shots: int, concurrency: int,
            max_tokens: int, timeout_s: float, show_failures: int, as_json: bool, api_key_file: str | None,
            api_key_env: str | None, baseline: Path | None = None, max_drop: float = 0.04) -> None:
    """Ask generated arithmetic word problems; exit 1 if accuracy is below --min-accuracy.

    Catches the failure class where serving looks healthy but answers are wrong (e.g. a KV
    transfer that silently drops state between prefill and decode). Reports whether the server
    decodes speculatively (and its accept length); with --baseline, an accuracy drop against a run
    without speculative decoding fails the gate too.
    """
    source = ("file", api_key_file) if api_key_file else ("env", api_key_env) if api_key_env else ("", "")
    headers = auth_headers(source)
    base = None
    if baseline is not None:
        try:
            base = evalgate.load_baseline(baseline, questions=questions, seed=seed, shots=shots, max_drop=max_drop)
        except ValueError as exc:
            raise UserError(str(exc), "pass the `eval --json` output of a run with the same --questions/--seed/--shots "
                                      "(e.g. `v4flash-pd eval --json > off.json` on the stack without --mtp)") from None
    try:
        result = evalgate.run_eval(url, questions, min_accuracy, seed=seed, shots=shots, concurrency=concurrency,
                                   max_tokens=max_tokens, timeout=timeout_s, headers=headers, baseline=base)
    except ValueError as exc:
        raise UserError(str(exc), "check --url (http://HOST:PORT), --questions >= 1, 0 <= --min-accuracy <= 1") from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(evalgate.render(result, show=show_failures))
    if not result.passed:
        if result.errors == result.total:
            raise RuntimeFailure(f"eval: every request to {url}/generate failed ({result.graded[0].error})",
                                 "is the router up? check `v4flash-pd status` and the logs")
        if result.accuracy >= min_accuracy and base is not None:
            raise RuntimeFailure(
                f"eval: accuracy {result.accuracy:.3f} dropped {base.accuracy - result.accuracy:.3f} against the "
                f"baseline's {base.accuracy:.3f} (allowed {base.max_drop:.3f})",
                "with speculative decoding on, suspect the draft/verify path: compare `--mtp 0` on the same box, "
                "then the kernel patches under verify shapes (V4FLASH_SPARSE_DECODE=0 and the others) one at a time")
        raise RuntimeFailure(
            f"eval: accuracy {result.accuracy:.3f} is below the gate {min_accuracy:.3f}",
            "answers are wrong while the server responds: suspect the PD KV transfer (NIXL/UCX), "
            "the kernel patch (retry with V4FLASH_SPARSE_DECODE=0 to A/B it), or the model files "
            "(`v4flash-pd doctor`)")
