"""Every bad input an adversarial operator tried: one `error:` + `fix:` paragraph, a non-zero exit,
no traceback, and nothing started (no run dir, no process). All through the real CLI.

Cases that need an unprivileged caller (a privileged port, a read-only run dir, an unreadable model
dir) run the CLI under `unshare --user`: the same uid, but without root's capabilities in the
initial namespace, which is what an operator's normal account has.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import fakebox
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
T8 = str(FIXTURES / "topology-8gpu-2node.json")
PARAGRAPH = re.compile(r"\Aerror: [^\n]+\n  fix: [^\n]+\n\Z")


def write(tmp: Path, name: str, data: str | bytes) -> str:
    p = tmp / name
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    return str(p)


def rehearse_up(tmp: Path, *extra: str) -> list[str]:
    """`up --rehearse` on free ports with a run dir under tmp (so nothing is left in the checkout)."""
    cfg = fakebox.write_pd_config(tmp, fakebox.free_ports(7))
    return ["up", "--rehearse", "--config", str(cfg), "--run-dir", str(tmp / "run"), *extra]


def ro_run_dir(tmp: Path) -> list[str]:
    run = tmp / "ro-run"  # a run dir that exists (say, made by an earlier `up`) and is read-only now
    (run / "patch").mkdir(parents=True)
    for d in (run / "patch", run):
        d.chmod(0o555)
    cfg = fakebox.write_pd_config(tmp, fakebox.free_ports(7))
    return ["up", "--rehearse", "--config", str(cfg), "--run-dir", str(run)]


def unreadable_model(tmp: Path) -> list[str]:
    m = tmp / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    m.chmod(0)
    return ["up", "--numa", "off", "--topology", T8, "--model", str(m), "--run-dir", str(tmp / "run")]


# (id, argv builder, words the paragraph must contain, run unprivileged)
CASES: list[tuple[str, Callable[[Path], list[str]], list[str], bool]] = [
    ("topology-empty-list", lambda t: ["plan", "--topology", write(t, "t.json", "[]")],
     ["topology", "malformed", "JSON object"], False),
    ("topology-not-utf8", lambda t: ["plan", "--topology", write(t, "t.json", b'{"gpus": [], "x": "\xff"}')],
     ["not UTF-8"], False),
    ("config-not-utf8", lambda t: ["plan", "--topology", T8, "--config", write(t, "c.toml", b'mode = "pd"\n# \xfe\xff\n')],
     ["config file", "not UTF-8"], False),
    ("topology-index-wrong-type", lambda t: ["plan", "--topology",
                                             write(t, "t.json", '{"gpus": [{"index": "zero"}], "nodes": []}')],
     ["gpus[0].index must be an integer"], False),
    ("topology-numa-node-not-integer", lambda t: ["plan", "--topology", write(t, "t.json", json.dumps(
        {"gpus": [{"index": i, "numa_node": 0.5} for i in range(8)], "nodes": []}))],
     ["numa_node must be an integer", "0.5"], False),
    ("topology-negative-memory", lambda t: ["plan", "--topology", write(t, "t.json", json.dumps(
        {"gpus": [{"index": i, "numa_node": i // 4, "memory_mib": -97887} for i in range(8)], "nodes": []}))],
     ["gpus[0].memory_mib must be >= 0", "-97887"], False),
    # a kernel switch in an env table would be overridden by the plan's own V4FLASH_<PATCH> without a word
    ("patch-switch-in-env",
     lambda t: ["plan", "--topology", T8, "--config", write(t, "c.toml", '[env]\nV4FLASH_MOE = "0"\n')],
     ["env sets V4FLASH_MOE", "kernel switch", "--moe off"], False),
    ("patch-switch-in-worker-env", lambda t: ["plan", "--topology", T8, "--set", 'decode.0.env.V4FLASH_INDEXER="0"'],
     ["decode.0.env sets V4FLASH_INDEXER", "--indexer off", "patches.indexer"], False),
    ("patch-switch-in-router-env", lambda t: ["plan", "--topology", T8, "--set", "router.env.V4FLASH_TOPK=1"],
     ["router.env sets V4FLASH_TOPK", "--topk"], False),
    ("roles-not-a-list", lambda t: ["plan", "--topology", T8, "--config", write(t, "c.toml", "prefill = 3\n")],
     ["prefill", "list of tables"], False),
    ("set-below-a-scalar", lambda t: ["plan", "--topology", T8, "--set", "router.port.x=1"],
     ["router.port is a single value"], False),
    ("extra-args-unterminated-quote", lambda t: ["plan", "--topology", T8, "--config",
                                                 write(t, "c.toml", "[router]\nextra_args = \"--log-level 'debug\"\n")],
     ["router.extra_args", "No closing quotation", "list"], False),
    ("ready-timeout-nan", lambda t: ["plan", "--topology", T8, "--set", "ready_timeout=nan"],
     ["ready_timeout", "finite"], False),
    ("grace-inf-on-up", lambda t: rehearse_up(t, "--grace", "inf"), ["grace_period", "finite"], False),
    ("ready-timeout-inf-on-up", lambda t: rehearse_up(t, "--ready-timeout", "inf"), ["ready_timeout", "finite"], False),
    ("unresolvable-host", lambda t: rehearse_up(t, "--set", "prefill.0.host=no-such-host.invalid"),
     ["no-such-host.invalid", "does not resolve"], False),
    ("missing-interpreter", lambda t: rehearse_up(t, "--set", f"python={t / 'no-python3'}"),
     ["no-python3", "not an executable", "--set python="], False),
    ("env-name-with-equals", lambda t: ["plan", "--topology", T8, "--config", write(t, "c.toml", '[env]\n"A=B" = "1"\n')],
     ["'A=B'", "not valid"], False),
    ("env-name-with-nul", lambda t: ["plan", "--topology", T8, "--config", write(t, "c.toml", '[env]\n"A\\u0000B" = "1"\n')],
     ["not valid", "NUL"], False),
    ("eval-questions-zero", lambda t: rehearse_up(t, "--eval", "--eval-questions", "0"), ["--eval-questions"], False),
    ("eval-min-accuracy-above-1", lambda t: rehearse_up(t, "--eval", "--eval-min-accuracy", "1.5"),
     ["--eval-min-accuracy"], False),
    ("negative-cuda-graph-bs", lambda t: ["plan", "--topology", T8, "--set", "decode.0.cuda_graph_max_bs=-1"],
     ["decode.0.cuda_graph_max_bs", ">= 1"], False),
    ("empty-host", lambda t: ["plan", "--topology", T8, "--set", 'router.host=""'],
     ["router.host is empty", "every interface"], False),
    ("localhost-vs-127", lambda t: ["plan", "--topology", T8, "--set", "prefill.0.host=localhost",
                                    "--set", "decode.0.port=30000"],
     ["port 30000 is used twice", "localhost and 127.0.0.1"], False),
    ("chunk-over-sm120-limit", lambda t: ["plan", "--topology", T8, "--set", "engine.chunked_prefill_size=16384"],
     ["16384", "11673", "--set engine.chunked_prefill_size=8192"], False),
    ("chunk-over-limit-in-extra-args", lambda t: ["plan", "--topology", T8, "--set",
                                                  'prefill.0.extra_args=["--chunked-prefill-size", "32768"]'],
     ["prefill.0.extra_args", "32768", "11673"], False),
    ("api-key-on-the-command-line", lambda t: ["plan", "--topology", T8, "--set",
                                               'router.extra_args=["--api-key", "s3cret"]'],
     ["--api-key", "router.api_key_file"], False),
    ("privileged-port", lambda t: rehearse_up(t, "--set", "router.port=80"),
     ["80 (router http", "permission denied", "ports >= 1024"], True),
    ("read-only-run-dir", ro_run_dir, ["not writable", "--run-dir"], True),
    ("unreadable-model-dir", unreadable_model, ["not readable", "permission denied"], True),
]


def unshare_ok() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--user", "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.parametrize("name, argv, words, unprivileged", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_paragraph_and_starts_nothing(name, argv, words, unprivileged, tmp_path: Path) -> None:
    if unprivileged:
        assert unshare_ok(), "these cases need `unshare --user` (util-linux) and unprivileged user namespaces"
    args = argv(tmp_path)
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    env["V4FLASH_RUNS_ROOT"] = str(tmp_path / "runs")
    cmd = (["unshare", "--user"] if unprivileged else []) + [sys.executable, "-m", "v4flash_pd", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode != 0 and res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    assert PARAGRAPH.match(res.stderr), f"not one error/fix paragraph:\n{res.stderr}"
    for w in words:
        assert w in res.stderr, (w, res.stderr)
    # nothing started: no READY, no process log in any run dir
    assert "READY" not in res.stdout
    logs = [p for p in tmp_path.rglob("*.log") if p.parent.name != "bin"]
    assert not logs, logs


def test_up_reports_every_preflight_failure_at_once(tmp_path: Path) -> None:
    """Two busy ports and an unresolvable host: one paragraph naming all three problems."""
    import socket

    p = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, p)
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    with socket.socket() as a, socket.socket() as b:
        for s, port in ((a, p[0]), (b, p[5])):
            s.bind(("127.0.0.1", port))
            s.listen(1)
        res = subprocess.run([sys.executable, "-m", "v4flash_pd", "up", "--rehearse", "--config", str(cfg),
                              "--run-dir", str(tmp_path / "run"), "--set", "decode.0.host=nowhere.invalid"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and PARAGRAPH.match(res.stderr), res.stderr
    assert "2 problems" in res.stderr and "nowhere.invalid" in res.stderr
    assert f"{p[0]} (prefill-0 http" in res.stderr and f"{p[5]} (router http" in res.stderr


def test_ipv6_hosts_are_bracketed_in_urls() -> None:
    from v4flash_pd import topology as topo
    from v4flash_pd.config.load import load_config
    from v4flash_pd.host import Host
    from v4flash_pd.plan import build_plan

    cfg = load_config(env={}, sets=("prefill.0.host=::1", "decode.0.host=[::1]", "router.host=::"))
    plan = build_plan(cfg, Host.remote(topo.load(T8)))
    router = list(plan.get("router").argv)
    assert router[router.index("--prefill") + 1] == "http://[::1]:30000"
    assert router[router.index("--decode") + 1] == "http://[::1]:30001"
    assert plan.get("prefill-0").health_url == "http://[::1]:30000/health"
    assert plan.url == "http://[::]:8000" and plan.probe_url == "http://[::1]:8000"
    # the engine gets the bare address, as its --host takes it
    d = list(plan.get("decode-0").argv)
    assert d[d.index("--host") + 1] == "::1"


def test_up_rehearse_without_the_router_installed_says_so(tmp_path: Path) -> None:
    """`pip install v4flash-pd` alone (launcher + click, no sglang-router): refused before anything starts."""
    import click

    site = tmp_path / "site"
    site.mkdir()
    (site / "click").symlink_to(Path(click.__file__).parent)
    repo = Path(__file__).resolve().parents[2]
    launcher, kernels = repo / "launcher", repo / "kernels"  # the wheel's two import packages
    base = Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([str(base), "-c", "import sglang_router"], capture_output=True, timeout=60)
    assert probe.returncode != 0, "the base interpreter must not have sglang_router for this test"
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    env["PYTHONPATH"] = os.pathsep.join(map(str, (site, launcher, kernels)))
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    res = subprocess.run([str(base), "-m", "v4flash_pd", "up", "--rehearse", "--config", str(cfg),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and PARAGRAPH.match(res.stderr), res.stderr
    assert "sglang-router is not installed" in res.stderr and "pip install sglang-router==0.3.2" in res.stderr
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("*.log"))


def test_a_real_up_without_the_serving_stack_is_refused_before_start(tmp_path: Path) -> None:
    """Issue 23: after a bare `pip install .` (no [serve] extra) a real `up` started workers that died at
    once with ModuleNotFoundError. This interpreter has the launcher but not sglang: refused up front."""
    probe = subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True, timeout=60)
    assert probe.returncode != 0, "this test needs an interpreter without sglang (the test venv has none)"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE, membind_ok=True)
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", "up", "--config", str(cfg), "--model", str(model),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and PARAGRAPH.match(res.stderr), (res.returncode, res.stdout, res.stderr)
    assert "serving stack is not installed" in res.stderr and "sglang==0.5.13.post1" in res.stderr
    assert "pip install '.[serve]'" in res.stderr
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("*.log"))


FIX_SET = re.compile(r"--set ([A-Za-z0-9_.]+=\S+?)[,;)]?(?:\s|$)")


@pytest.mark.parametrize("bad", ["prefill.0.tp=abc", "decode.0.port=abc", "decode.0.nccl_port=true",
                                 "decode.0.cuda_graph_max_bs=abc", "prefill.0.gpus=7", "router.port=[1]",
                                 "engine.context_length=abc", "ready_timeout=abc", "prefill.0.numa_node=x"])
def test_a_fix_gives_a_value_that_works_not_the_error_again(bad: str, tmp_path: Path) -> None:
    """Issue 23: 'fix: set prefill.0.tp to a positive integer' only repeated the error. The fix now names
    a concrete --set, and that --set, applied instead, makes the same command succeed."""
    env = fakebox.clean_env()
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", "plan", "--topology", T8, "--set", bad],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2 and PARAGRAPH.match(res.stderr), res.stderr
    fix = res.stderr.split("\n  fix: ", 1)[1]
    suggested = FIX_SET.findall(fix)
    assert suggested and suggested[0].split("=", 1)[0] == bad.split("=", 1)[0], fix
    good = subprocess.run([sys.executable, "-m", "v4flash_pd", "plan", "--topology", T8, "--set", suggested[0]],
                          capture_output=True, text=True, env=env, timeout=60)
    assert good.returncode == 0, (suggested[0], good.stderr)


def test_a_numa_node_this_host_lacks_is_not_told_to_install_numactl(tmp_path: Path) -> None:
    """numactl is installed and works; node 1 just does not exist here (as on a one-socket machine): the
    fix must not say 'install numactl'."""
    shim = tmp_path / "bin" / "numactl"
    shim.parent.mkdir()
    shim.write_text(f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
if any(a.endswith("=1") for a in args[:args.index("--")]):
    sys.stderr.write("<1> is invalid\\n")
    sys.exit(1)
cmd = args[args.index("--") + 1:]
os.execvp(cmd[0], cmd)
""")
    shim.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE)
    env["V4FLASH_NUMACTL"] = str(shim)
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", "up", "--config", str(cfg), "--model", str(model),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and PARAGRAPH.match(res.stderr), res.stderr
    assert "decode-0 must be bound to NUMA node 1" in res.stderr, res.stderr
    assert "install numactl" not in res.stderr, res.stderr
    assert "--set decode.0.numa_node=0" in res.stderr and "--set numa=off" in res.stderr, res.stderr


def test_bundle_without_its_extra_names_an_install_that_works(tmp_path: Path) -> None:
    """Issue 23: the fix said `pip install 'v4flash-pd[bundle]'`, a package index the project is not on."""
    import click

    site = tmp_path / "site"
    site.mkdir()
    (site / "click").symlink_to(Path(click.__file__).parent)
    launcher = Path(__file__).resolve().parents[2] / "launcher"
    base = Path(sys.base_prefix) / "bin" / "python3"
    env = fakebox.clean_env()
    env["PYTHONPATH"] = f"{site}{os.pathsep}{launcher}"
    # -S: no site-packages, so neither docker nor zstandard (the [bundle] extra) can be found
    res = subprocess.run([str(base), "-S", "-m", "v4flash_pd", "bundle", "create", "--out", str(tmp_path / "b"),
                          "--no-image"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2 and PARAGRAPH.match(res.stderr), res.stderr
    assert "zstandard" in res.stderr
    assert "v4flash-pd[bundle]" not in res.stderr, res.stderr
    assert "pip install '.[bundle]'" in res.stderr and "pip install docker zstandard" in res.stderr
