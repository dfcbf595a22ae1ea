"""`make demo`: the operator's first five minutes, in rehearsal, on any machine.

Runs the real CLI as an operator would: `up --rehearse --detach` (real router, real numactl,
stand-in engines), one request through the router, `status`, `logs`, `down`. Exits non-zero if
any step fails, so it doubles as a smoke test of a fresh checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from v4flash_pd.httpclient import request


def step(title: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    print(f"\n$ v4flash-pd {' '.join(argv)}    # {title}", flush=True)
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", *argv], text=True, timeout=300)
    if res.returncode != 0:
        print(f"demo: `v4flash-pd {' '.join(argv)}` failed (exit {res.returncode})", file=sys.stderr)
        sys.exit(res.returncode)
    return res


def main() -> None:
    os.environ.setdefault("V4FLASH_REHEARSAL_LOAD_SECONDS", "3")
    os.environ.setdefault("V4FLASH_PROGRESS_INTERVAL", "1")
    extra = sys.argv[1:]
    step("start prefill + decode stand-ins and the real sglang-router; return at READY",
         ["up", "--rehearse", "--detach", *extra])
    try:
        url = "http://127.0.0.1:8000/generate"
        for a in extra:
            if a.startswith("router.port="):
                url = f"http://127.0.0.1:{a.split('=', 1)[1]}/generate"
        from v4flash_pd.arith import make_problems

        problem = make_problems(1, seed=7)[0]
        body = {"text": problem.question,
                "sampling_params": {"max_new_tokens": 48, "temperature": 0}}
        print(f"\n$ curl -s {url} -d '{json.dumps(body)}'    # one request through the router", flush=True)
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
    print("\ndemo OK: this is what `docker run ... v4flash-pd up` does on the GPU box, with SGLang instead of stand-ins.")


if __name__ == "__main__":
    main()
