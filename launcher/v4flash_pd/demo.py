"""`make demo`: the operator's first five minutes, in rehearsal, on any machine.

Runs the real CLI as an operator would: `up --rehearse --detach` (real router, real numactl,
stand-in engines), one request through the router, `status`, `logs`, `down`. Exits non-zero if
any step fails, so it doubles as a smoke test of a fresh checkout. Extra arguments go to `up`
(`make demo DEMO_ARGS='--set router.port=8001'`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from v4flash_pd.httpclient import request

HINT_SET = re.compile(r"--set [A-Za-z0-9_.]+=\S+")


def cli() -> str:
    """The CLI as this shell reaches it: the console script next to this interpreter (`make demo`'s
    .venv-demo/bin/v4flash-pd is on nobody's PATH), relative to the working directory when under it."""
    script = Path(sys.executable).parent / "v4flash-pd"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m v4flash_pd"
    rel = os.path.relpath(script)
    return shlex.quote(str(script) if rel.startswith("..") else rel)


def step(title: str, argv: list[str], capture_errors: bool = False) -> subprocess.CompletedProcess[str]:
    print(f"\n$ {cli()} {' '.join(argv)}    # {title}", flush=True)
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", *argv], text=True, timeout=300,
                         stderr=subprocess.PIPE if capture_errors else None)
    if capture_errors and res.stderr:
        sys.stderr.write(res.stderr)
    if res.returncode != 0:
        print(f"demo: `v4flash-pd {' '.join(argv)}` failed (exit {res.returncode})", file=sys.stderr)
        if capture_errors:  # the fix names a --set: say how it reaches `up` from make
            fixes = HINT_SET.findall(res.stderr or "")
            example = fixes[0].rstrip(",;)") if fixes else "--set router.port=8001"
            print(f"demo: options reach `up` through make's DEMO_ARGS, e.g. make demo DEMO_ARGS='{example}'",
                  file=sys.stderr)
        sys.exit(res.returncode)
    return res


def probe_url() -> str:
    """Where the run just started can be reached from this box (the plan's own answer: any port, any
    config), from the run dir `up` wrote."""
    from v4flash_pd.rundir import RunDir

    return str(RunDir.find(None).read_json("plan.json")["probe_url"])


def curl_line(url: str, body: dict[str, Any]) -> str:
    return f"curl -s {url} -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"


def main() -> None:
    os.environ.setdefault("V4FLASH_REHEARSAL_LOAD_SECONDS", "3")
    os.environ.setdefault("V4FLASH_PROGRESS_INTERVAL", "1")
    extra = sys.argv[1:]
    step("start prefill + decode stand-ins and the real sglang-router; return at READY",
         ["up", "--rehearse", "--detach", *extra], capture_errors=True)
    try:
        url = probe_url() + "/generate"
        from v4flash_pd.arith import make_problems

        problem = make_problems(1, seed=7)[0]
        body = {"text": problem.question,
                "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
        print(f"\n$ {curl_line(url, body)}    # one request through the router", flush=True)
        rep = request(url, body, timeout=60)
        if rep.status != 200:
            raise SystemExit(f"demo: the request through the router failed: "
                             f"{f'HTTP {rep.status}' if rep.status else rep.kind} {rep.body or rep.error}")
        reply = rep.json()
        print(json.dumps({"text": reply.get("text"), "meta_info": reply.get("meta_info")}, indent=2))
        print(f"(expected answer: {problem.answer}; the stand-in solves the generated arithmetic the eval gate asks)")
        step("what is running, healthy, and where the logs are", ["status"])
        step("the decode worker's last lines", ["logs", "decode", "-n", "5"])
    finally:
        step("graceful stop: router, decode, prefill", ["down"])
    me = cli()
    print("\ndemo OK: this is what `docker run ... v4flash-pd up` does on the GPU box, with SGLang instead of stand-ins."
          "\nThe OpenAI API is under /v1 as well: README, \"Send a request\"."
          f"\nTo keep a rehearsal running and try it yourself: {me} up --rehearse --detach, then {me} status, "
          f"{me} logs decode, and {me} down to stop it.")


if __name__ == "__main__":
    main()
