"""`v4flash-pd bench`: streaming throughput/latency per concurrency level through the router."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

import click

from v4flash_pd import benchmark
from v4flash_pd.cli.common import json_option
from v4flash_pd.errors import RuntimeFailure, UserError
from v4flash_pd.rehearsal import STANDIN_LABEL
from v4flash_pd.routerauth import auth_headers


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
@json_option("Print the machine-readable report (for comparing runs) instead of the table.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None, envvar="V4FLASH_BENCH_API_KEY_FILE",
              help="File holding the router's API key (a router started with router.api_key_file).")
@click.option("--api-key-env", metavar="NAME", default=None, envvar="V4FLASH_BENCH_API_KEY_ENV",
              help="Environment variable holding the router's API key.")
@click.option("--step", is_flag=True,
              help="Instead of HTTP: time one decode step / prefill chunk op by op on this machine's GPU "
                   "(python -m v4flash_bench.step), upstream sm_120 path vs our kernels.")
@click.option("--step-args", default="", help="Options passed on to the step bench, e.g. \"--batches 1,16 --json s.json\".")
@click.option("--allreduce", is_flag=True,
              help="Instead of HTTP: check and time the IPC all-reduce against NCCL on this box's GPUs, one process "
                   "per GPU, 2..N ranks (python -m v4flash_bench.allreduce); run it with the workers stopped.")
@click.option("--allreduce-args", default="",
              help="Options passed on to the all-reduce bench, e.g. \"--worlds 4 --sizes 16384,65536 --json ar.json\".")
def command(url: str, concurrency: str, n_requests: int | None, input_len: int, output_len: int,
            warmup: int, seed: int, timeout_s: float, as_json: bool, api_key_file: str | None = None,
            api_key_env: str | None = None, step: bool = False, step_args: str = "", allreduce: bool = False,
            allreduce_args: str = "") -> None:
    """Measure output tok/s, req/s, TTFT and ITL p50/p90/p99 per concurrency level.

    Exits 1 if any request failed (the table is printed first).
    """
    if step:
        _run_step_bench(step_args)
        return
    if allreduce:
        _run_allreduce_bench(allreduce_args)
        return
    try:
        levels = benchmark.parse_concurrency(concurrency)
    except ValueError as exc:
        raise UserError(f"--concurrency {concurrency!r}: {exc}", "give positive integers, e.g. 1,16,64") from None
    if n_requests is not None and n_requests < 1:
        raise UserError(f"--requests must be >= 1, got {n_requests}")

    source = ("file", api_key_file) if api_key_file else ("env", api_key_env) if api_key_env else ("", "")
    spec = benchmark.BenchSpec(url=url, concurrency=levels, requests=n_requests, input_len=input_len,
                               output_len=output_len, warmup=warmup, seed=seed, timeout_s=timeout_s,
                               headers=tuple(auth_headers(source).items()))
    try:
        report = benchmark.run_bench(spec)
    except ValueError as exc:
        raise UserError(str(exc), "pass --url http://HOST:PORT") from None
    except ConnectionError as exc:
        raise RuntimeFailure(str(exc), "is the router up? check `v4flash-pd status` and the router log") from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(f"bench {url}/generate  input={input_len} output={output_len} words/tokens"
                   + (f"  {STANDIN_LABEL}" if report.standin else ""))
        click.echo(benchmark.render_table(report.levels))
    if any(s.errors for s in report.levels):
        raise RuntimeFailure(f"{sum(s.errors for s in report.levels)} request(s) failed during the benchmark",
                             "see the errors above and the router/worker logs (`v4flash-pd logs`)")


def _run_step_bench(step_args: str) -> None:
    """Run `python -m v4flash_bench.step` in this interpreter where an NVIDIA GPU is visible."""
    import importlib.util

    try:
        extra = shlex.split(step_args)
    except ValueError as exc:
        raise UserError(f"--step-args {step_args!r}: {exc}",
                        "quote it as one shell word, e.g. --step-args '--batches 1,16'") from None
    if importlib.util.find_spec("v4flash_bench") is None:
        raise UserError("the bench package v4flash_bench is not importable in this environment",
                        "run from the built environment (`make venv`, or the image), where the kernels and their "
                        "benches are installed")
    if "--dry-run" not in extra:
        smi = shutil.which("nvidia-smi")
        probe = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30) if smi else None
        if probe is None or probe.returncode != 0 or "GPU" not in probe.stdout:
            raise RuntimeFailure("no NVIDIA GPU is visible here (`nvidia-smi -L` lists none), and the step bench "
                                 "times kernels on a GPU",
                                 "run it on a GPU host (check the driver and CUDA_VISIBLE_DEVICES), or pass "
                                 "--step-args --dry-run to print the plan of ops only")
    rc = subprocess.call([sys.executable, "-m", "v4flash_bench.step", *extra])
    if rc == 2:
        raise UserError(f"the step bench refused --step-args {step_args!r} (its error is above)",
                        "fix the option it names; `python -m v4flash_bench.step --help` lists them")
    if rc != 0:
        raise RuntimeFailure(f"the step bench exited with status {rc}",
                             "read the FAILED lines above: an op disagreed with its reference or raised")


def _run_allreduce_bench(args_text: str) -> None:
    """Run `python -m v4flash_bench.allreduce` in this interpreter on this box's GPUs."""
    import importlib.util

    try:
        extra = shlex.split(args_text)
    except ValueError as exc:
        raise UserError(f"--allreduce-args {args_text!r}: {exc}",
                        "quote it as one shell word, e.g. --allreduce-args '--worlds 4'") from None
    if importlib.util.find_spec("v4flash_bench") is None:
        raise UserError("the bench package v4flash_bench is not importable in this environment",
                        "run from the built environment (`make venv`, or the image), where the kernels and their "
                        "benches are installed")
    smi = shutil.which("nvidia-smi")
    probe = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30) if smi else None
    gpus = probe.stdout.count("GPU ") if probe is not None and probe.returncode == 0 else 0
    if gpus < 2:
        raise RuntimeFailure(f"the all-reduce bench needs at least 2 NVIDIA GPUs; `nvidia-smi -L` lists {gpus}",
                             "run it on the GPU box (check the driver and CUDA_VISIBLE_DEVICES)")
    rc = subprocess.call([sys.executable, "-m", "v4flash_bench.allreduce", *extra])
    if rc == 2:
        raise UserError(f"the all-reduce bench refused --allreduce-args {args_text!r} (its error is above)",
                        "`python -m v4flash_bench.allreduce --help` lists its options")
    if rc != 0:
        raise RuntimeFailure(f"the all-reduce bench exited with status {rc}",
                             "a size disagreed with NCCL or a rank failed: see the table above; "
                             "`v4flash-pd doctor --only p2p` checks peer access, ACS, IOMMU and the PCIe topology")
