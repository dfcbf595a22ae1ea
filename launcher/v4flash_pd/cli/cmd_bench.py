"""`v4flash-pd bench`: streaming throughput/latency per concurrency level through the router."""

from __future__ import annotations

import json

import click

from v4flash_pd.errors import RuntimeFailure, UserError


@click.command("bench")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="V4FLASH_BENCH_URL",
              help="Router (or single engine) base URL; requests go to <url>/generate.")
@click.option("--concurrency", default="1,16,64", show_default=True, envvar="V4FLASH_BENCH_CONCURRENCY",
              help="Comma-separated in-flight request counts, measured one after another.")
@click.option("--requests", "n_requests", type=int, default=None, envvar="V4FLASH_BENCH_REQUESTS",
              help="Requests per level [default: max(4 x concurrency, 8)].")
@click.option("--input-len", type=click.IntRange(min=1), default=256, show_default=True,
              envvar="V4FLASH_BENCH_INPUT_LEN", help="Prompt length in words (~tokens).")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              envvar="V4FLASH_BENCH_OUTPUT_LEN", help="Generated tokens per request (ignore_eos).")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, envvar="V4FLASH_BENCH_WARMUP",
              help="Unmeasured requests sent first (pays one-time costs such as the UCX connect).")
@click.option("--seed", type=int, default=0, show_default=True, envvar="V4FLASH_BENCH_SEED",
              help="Seed for the generated prompts.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              envvar="V4FLASH_BENCH_TIMEOUT", help="Per-request timeout in seconds.")
@click.option("--json", "as_json", is_flag=True, envvar="V4FLASH_BENCH_JSON",
              help="Print the machine-readable report (for comparing runs) instead of the table.")
def command(url: str, concurrency: str, n_requests: int | None, input_len: int, output_len: int,
            warmup: int, seed: int, timeout_s: float, as_json: bool) -> None:
    """Measure output tok/s, req/s, TTFT and ITL p50/p90/p99 per concurrency level.

    Exits 1 if any request failed (the table is printed first).
    """
    from v4flash_pd import benchmark

    try:
        levels = benchmark.parse_concurrency(concurrency)
    except ValueError as exc:
        raise UserError(f"--concurrency {concurrency!r}: {exc}", "give positive integers, e.g. 1,16,64")
    if n_requests is not None and n_requests < 1:
        raise UserError(f"--requests must be >= 1, got {n_requests}")
    spec = benchmark.BenchSpec(url=url, concurrency=levels, requests=n_requests, input_len=input_len,
                               output_len=output_len, warmup=warmup, seed=seed, timeout_s=timeout_s)
    try:
        report = benchmark.run_bench(spec)
    except ValueError as exc:
        raise UserError(str(exc), "pass --url http://HOST:PORT")
    except ConnectionError as exc:
        raise RuntimeFailure(str(exc), "is the router up? check `v4flash-pd status` and the router log")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(f"bench {url}/generate  input={input_len} output={output_len} words/tokens")
        click.echo(benchmark.render_table(report.levels))
    if any(s.errors for s in report.levels):
        raise RuntimeFailure(f"{sum(s.errors for s in report.levels)} request(s) failed during the benchmark",
                             "see the errors above and the router/worker logs (`v4flash-pd logs`)")
