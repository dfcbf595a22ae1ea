"""What a newcomer pastes (issue 23, newcomer friction): the README's "Send a request" commands, the
calls the OpenAI SDK makes, and the curl `make demo` prints, all against the real sglang-router in
front of `up --rehearse`. The `openai` package is not in the test environment, so the SDK's requests
are made over plain HTTP exactly as it sends them (Bearer header, JSON body, SSE for streams)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import fakebox
import pytest

pytestmark = pytest.mark.timeout(180)

PY = sys.executable
README = Path(__file__).resolve().parents[2] / "README.md"
MODEL = "DeepSeek-V4-Flash"


def _env(tmp: Path) -> dict[str, str]:
    env = fakebox.box_env(tmp, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    env.update({"V4FLASH_RUNS_ROOT": str(tmp / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.3",
                "V4FLASH_GRACE": "5"})
    return env


def _stop(env: dict[str, str], tmp: Path) -> None:
    """`down`, then SIGKILL by pid whatever the run dir still records (a failed test must not leak)."""
    subprocess.run([PY, "-m", "v4flash_pd", "down"], env=env, capture_output=True, timeout=90)
    state = tmp / "runs" / "latest" / "state.json"
    if state.exists():
        st = json.loads(state.read_text())
        for pid in [st.get("launcher_pid"), *st.get("pids", {}).values()]:
            if isinstance(pid, int) and pid > 1:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`up --rehearse --detach` on free ports (router on 127.0.0.1); yields the router's base URL."""
    tmp = tmp_path_factory.mktemp("send")
    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp, ports)
    env = _env(tmp)
    up = subprocess.run([PY, "-m", "v4flash_pd", "up", "--rehearse", "--detach", "--config", str(cfg)], env=env,
                        capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield f"http://127.0.0.1:{ports[5]}"
    finally:
        _stop(env, tmp)


def readme_block(heading: str, lang: str) -> str:
    section = README.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_readmes_curl_commands_work_as_written(router: str) -> None:
    cmds = _commands(readme_block("Send a request", "bash"))
    assert len(cmds) == 4 and all(c.startswith("curl ") for c in cmds), cmds
    out = []
    for c in cmds:
        res = subprocess.run(["bash", "-c", c.replace("http://127.0.0.1:8000", router)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, (c, res.stderr)
        out.append(res.stdout)
    models, chat, stream, generate = out
    assert json.loads(models)["data"][0]["id"] == MODEL
    reply = json.loads(chat)
    assert reply["model"] == MODEL and reply["choices"][0]["message"]["content"], reply
    events = [line[len("data: "):] for line in stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                                              for e in events[:-1] if json.loads(e)["choices"])
    assert json.loads(generate)["text"]


def _sdk(url: str, body: dict[str, Any] | None = None) -> urllib.request.Request:
    """A request as openai-python 1.x makes it: Bearer api_key (here "none"), JSON body."""
    headers = {"Authorization": "Bearer none", "Accept": "application/json"}
    data = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = json.dumps(body).encode()
    return urllib.request.Request(url, data, headers)


def test_the_openai_sdks_calls_work_through_the_router(router: str) -> None:
    base = router + "/v1"
    with urllib.request.urlopen(_sdk(base + "/models"), timeout=30) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL]
    msgs = [{"role": "user", "content": "What is 17 * 23?"}]
    with urllib.request.urlopen(_sdk(base + "/chat/completions", {"model": MODEL, "messages": msgs,
                                                                  "max_tokens": 64}), timeout=60) as r:
        reply = json.loads(r.read())
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    with urllib.request.urlopen(_sdk(base + "/chat/completions", {"model": MODEL, "messages": msgs,
                                                                  "stream": True}), timeout=60) as r:
        assert r.headers.get("Content-Type", "").startswith("text/event-stream")
        lines = r.read().decode().splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    with urllib.request.urlopen(_sdk(base + "/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                             "max_tokens": 8}), timeout=60) as r:
        assert json.loads(r.read())["choices"][0]["text"]


def test_the_curl_make_demo_prints_works_when_pasted(router: str, tmp_path: Path) -> None:
    """It returned HTTP 415 when pasted (no Content-Type); and the demo assumed the router on port 8000."""
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    env = _env(tmp_path)
    try:
        demo = subprocess.run([PY, "-m", "v4flash_pd.demo", "--config", str(cfg)], env=env, capture_output=True,
                              text=True, timeout=150)
        assert demo.returncode == 0, demo.stdout + demo.stderr
    finally:
        _stop(env, tmp_path)
    line = next(x for x in demo.stdout.splitlines() if x.startswith("$ curl "))
    cmd = re.sub(r"\s+# .*$", "", line[2:])
    cmd = re.sub(r"http://127\.0\.0\.1:\d+", router, cmd)  # pasted while a router runs (the demo's has stopped)
    res = subprocess.run(["bash", "-c", cmd + " -w '\\n%{http_code}'"], capture_output=True, text=True, timeout=60)
    body, code = res.stdout.rsplit("\n", 1)
    assert res.returncode == 0 and code == "200", res.stdout + res.stderr
    assert json.loads(body)["text"]


@pytest.mark.parametrize("args, want", [
    ((), "127.0.0.1"),                                       # rehearsal: this box only, by default
    (("--set", "router.host=0.0.0.0"), "0.0.0.0"),           # a flag that names the address wins
    (("--config", "FILE"), "0.0.0.0"),                        # so does a config file
])
def test_a_rehearsal_listens_on_loopback_unless_told_otherwise(args: tuple[str, ...], want: str,
                                                               tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[router]\nhost = "0.0.0.0"\n')
    argv = [a.replace("FILE", str(tmp_path / "c.toml")) for a in args]
    env = fakebox.clean_env()
    t8 = str(Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json")
    res = subprocess.run([PY, "-m", "v4flash_pd", "plan", "--json", "--rehearse", "--topology", t8, *argv],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    router = json.loads(res.stdout)["config"]["router"]
    assert router["host"] == want
    plain = subprocess.run([PY, "-m", "v4flash_pd", "plan", "--json", "--topology", t8], capture_output=True,
                           text=True, env=env, timeout=60)
    assert json.loads(plain.stdout)["config"]["router"]["host"] == "0.0.0.0"  # the GPU box's profile is untouched
    agg = subprocess.run([PY, "-m", "v4flash_pd", "plan", "--json", "--rehearse", "--profile", "rtx6000-tp4",
                          "--topology", t8], capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(agg.stdout)["config"]["workers"][0]["host"] == "127.0.0.1"


def test_status_prints_a_url_one_can_connect_to(tmp_path: Path) -> None:
    """READY printed http://127.0.0.1:PORT, status printed http://0.0.0.0:PORT for the same router."""
    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    env = _env(tmp_path)
    try:
        up = subprocess.run([PY, "-m", "v4flash_pd", "up", "--rehearse", "--detach", "--config", str(cfg), "--set",
                             "router.host=0.0.0.0"], env=env, capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        st = subprocess.run([PY, "-m", "v4flash_pd", "status"], env=env, capture_output=True, text=True, timeout=60)
        line = next(x for x in st.stdout.splitlines() if x.startswith("url "))
        assert line.split()[1] == f"http://127.0.0.1:{ports[5]}", st.stdout
        assert f"(listening on http://0.0.0.0:{ports[5]})" in line
    finally:
        _stop(env, tmp_path)


def test_the_demo_says_how_to_pass_the_fix_through_make(tmp_path: Path) -> None:
    """`make demo` could not take the `--set router.port=N` its own port error suggested."""
    import socket

    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    env = _env(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[5]))
        busy.listen(1)
        demo = subprocess.run([PY, "-m", "v4flash_pd.demo", "--config", str(cfg)], env=env, capture_output=True,
                              text=True, timeout=120)
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert "Traceback" not in demo.stderr
    assert f"make demo DEMO_ARGS='--set router.port={ports[5] + 1}'" in demo.stderr, demo.stderr
    make = subprocess.run(["make", "-n", "demo", "DEMO_ARGS=--set router.port=8001"], capture_output=True, text=True,
                          cwd=README.parent, timeout=60)
    assert "-m v4flash_pd.demo --set router.port=8001" in make.stdout, make.stdout


def test_up_detach_shows_progress_and_where_to_follow_it(tmp_path: Path) -> None:
    """`up --detach` was silent until READY (tens of minutes on a GPU box)."""
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    env = dict(_env(tmp_path), V4FLASH_REHEARSAL_LOAD_SECONDS="2", V4FLASH_PROGRESS_INTERVAL="0.5")
    try:
        up = subprocess.run([PY, "-m", "v4flash_pd", "up", "--rehearse", "--detach", "--config", str(cfg)], env=env,
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        lines = up.stdout.splitlines()
        assert any("v4flash-pd logs launcher -f --run-dir" in x for x in lines), up.stdout
        ready = next(i for i, x in enumerate(lines) if x.startswith("READY "))
        assert any("waiting for workers to load" in x for x in lines[:ready]), up.stdout
        assert sum(x.startswith("READY ") for x in lines) == 1 and ready == len(lines) - 1, up.stdout
    finally:
        _stop(env, tmp_path)


def test_the_demo_prints_commands_that_run_as_printed(tmp_path: Path) -> None:
    """The demo printed `$ v4flash-pd status`, but `make demo`'s CLI is .venv-demo/bin/v4flash-pd, on nobody's
    PATH: each command it shows names the CLI it ran, and the demo ends with how to keep a trio running."""
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    env = _env(tmp_path)
    try:
        demo = subprocess.run([PY, "-m", "v4flash_pd.demo", "--config", str(cfg)], env=env, capture_output=True,
                              text=True, timeout=150, cwd=README.parent)
        assert demo.returncode == 0, demo.stdout + demo.stderr
    finally:
        _stop(env, tmp_path)
    cli = os.path.relpath(Path(PY).parent / "v4flash-pd", README.parent)
    shown = [x[2:].split("    # ")[0] for x in demo.stdout.splitlines() if x.startswith("$ ") and "curl " not in x]
    assert [c.split()[1] for c in shown] == ["up", "status", "logs", "down"], shown
    assert all(c.split()[0] == cli for c in shown), (cli, shown)
    assert (README.parent / cli).is_file()
    status = subprocess.run([*shown[1].split(), "--help"], capture_output=True, text=True, cwd=README.parent,
                            timeout=60, env=env)
    assert status.returncode == 0 and "Usage:" in status.stdout, status.stderr
    tail = demo.stdout[demo.stdout.index("demo OK"):]
    assert f"{cli} up --rehearse --detach" in tail and f"{cli} status" in tail and f"{cli} down" in tail, tail
