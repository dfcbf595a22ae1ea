"""The CLI contract: errors are one `error: ... fix: ...` paragraph with exit 2; --debug shows the
traceback; `plan --json` is machine-readable; `--version` works. All through real subprocesses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import fakebox
import pytest

from v4flash_kernels.hook.patches import SWITCHES

FIXTURES = Path(__file__).parent / "fixtures"
T8 = str(FIXTURES / "topology-8gpu-2node.json")
PARAGRAPH = re.compile(r"\Aerror: [^\n]+\n  fix: [^\n]+\n\Z")


def bad_toml(tmp: Path) -> str:
    p = tmp / "bad.toml"
    p.write_text("[[prefill]\n")
    return str(p)


def unknown_key(tmp: Path) -> str:
    p = tmp / "unknown.toml"
    p.write_text("[router]\nprot = 9000\n")
    return str(p)


# (id, argv builder, words the message must contain)
ERRORS = [
    ("unknown-key-set", lambda t: ["plan", "--topology", T8, "--set", "engine.transfer_backnd=nixl"],
     ["unknown config key", "engine.", "transfer_backnd"]),
    ("unknown-key-file", lambda t: ["plan", "--topology", T8, "--config", unknown_key(t)], ["router.", "'prot'"]),
    ("bad-toml", lambda t: ["plan", "--topology", T8, "--config", bad_toml(t)], ["not valid TOML"]),
    ("missing-config", lambda t: ["plan", "--topology", T8, "--config", str(t / "none.toml")], ["does not exist"]),
    ("bad-backend", lambda t: ["plan", "--topology", T8, "--set", "engine.transfer_backend=ucx"],
     ["engine.transfer_backend", "'ucx'"]),
    ("bad-kv-dtype", lambda t: ["plan", "--topology", T8, "--set", "engine.kv_cache_dtype=fp8"], ["kv_cache_dtype"]),
    ("unknown-profile", lambda t: ["plan", "--topology", T8, "--profile", "rtx9000"], ["unknown profile 'rtx9000'"]),
    ("gpu-overlap", lambda t: ["plan", "--topology", T8, "--set", "decode.0.gpus=[0,4,5,6]"],
     ["GPU 0", "prefill-0", "decode-0"]),
    ("tp-divisible", lambda t: ["plan", "--topology", T8, "--set", "prefill.0.tp=3"], ["not divisible", "TP size 3"]),
    ("port-collision", lambda t: ["plan", "--topology", T8, "--set", "router.port=30000"], ["port 30000 is used twice"]),
    ("not-key-value", lambda t: ["plan", "--topology", T8, "--set", "router.port"], ["not KEY=VALUE"]),
    ("numa-contradiction", lambda t: ["plan", "--topology", str(FIXTURES / "topology-8gpu-swapped.json")],
     ["prefill-0", "NUMA node 0"]),
    ("missing-topology", lambda t: ["plan", "--topology", str(t / "nope.json")], ["topology file", "does not exist"]),
]


@pytest.mark.parametrize("name, argv, words", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_is_one_paragraph_exit_2(name, argv, words, tmp_path: Path, cli) -> None:
    res = cli(*argv(tmp_path))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert PARAGRAPH.match(res.stderr), f"not one error/fix paragraph:\n{res.stderr}"
    for w in words:
        assert w in res.stderr, (w, res.stderr)


def test_env_v4flash_set_error_names_its_source(cli) -> None:
    res = cli("plan", "--topology", T8, extra_env={"V4FLASH_SET": "router.port"})
    assert res.returncode == 2 and "V4FLASH_SET" in res.stderr and PARAGRAPH.match(res.stderr)


def test_debug_shows_the_traceback(cli) -> None:
    res = cli("--debug", "plan", "--topology", T8, "--set", "engine.transfer_backend=ucx")
    assert res.returncode == 1  # an uncaught exception, not the tidy exit 2
    assert "Traceback (most recent call last)" in res.stderr
    assert "v4flash_pd.errors.UserError" in res.stderr and "'ucx'" in res.stderr


def test_debug_env_var_shows_the_traceback(cli) -> None:
    res = cli("plan", "--topology", T8, "--set", "engine.transfer_backend=ucx", extra_env={"V4FLASH_DEBUG": "1"})
    assert "Traceback (most recent call last)" in res.stderr


def test_plan_json_shape(plan_json) -> None:
    plan = plan_json("--topology", T8)
    assert plan["format"] == "v4flash-pd/plan/2" and plan["mode"] == "pd"
    assert [p["name"] for p in plan["processes"]] == ["prefill-0", "decode-0", "router"]
    for p in plan["processes"]:
        assert isinstance(p["argv"], list) and p["argv"] and all(isinstance(a, str) for a in p["argv"])
        assert all(len(kv) == 2 for kv in p["env"])
    assert plan["config"]["profile"] == "rtx6000-8x-pd"
    assert isinstance(plan["warnings"], list)


def test_plan_human_output(cli) -> None:
    res = cli("plan", "--topology", T8)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert re.search(r"prefill-0\s+prefill\s+0,1,2,3\s+0 \(membind\)\s+127.0.0.1\s+"
                     r"http 30000, nccl 30010, bootstrap 8998", out)
    assert re.search(r"decode-0\s+decode\s+4,5,6,7\s+1 \(membind\)\s+127.0.0.1\s+http 30001, nccl 30011", out)
    assert "patches  sparse_decode on, moe on, indexer on" in out and "context 131072" in out
    assert "auth     NONE" in out and "WITHOUT authentication" in out
    assert "numactl --cpunodebind=1 --membind=1 --" in out and "commands:" in out


def test_plan_rehearse_swaps_only_the_engine_module(plan_json) -> None:
    real = plan_json("--topology", T8)
    # the same listen address (a rehearsal defaults its router to 127.0.0.1: test_send_a_request)
    reh = plan_json("--topology", T8, "--rehearse", "--set", "router.host=0.0.0.0")
    assert reh["rehearse"] is True
    for a, b in zip(real["processes"], reh["processes"]):
        if a["role"] == "router":
            assert a["argv"] == b["argv"]
            continue
        swapped = [x.replace("v4flash_pd.rehearsal.engine", "sglang.launch_server") for x in b["argv"]]
        assert engine_args(swapped) == engine_args(a["argv"])  # identical flags, ports, env
        assert dict(map(tuple, b["env"])) == {**dict(map(tuple, a["env"])), "V4FLASH_REHEARSAL": "1"}


def engine_args(argv: list[str]) -> list[str]:
    return argv[argv.index("-m"):]


def test_every_plan_option_has_an_env_var(tmp_path: Path, plan_json) -> None:
    spellings = ("off", "0", "false")  # every spelling of off a switch's variable accepts
    switches = {s.env: spellings[i % len(spellings)] for i, s in enumerate(SWITCHES)}
    env = {"V4FLASH_TOPOLOGY": T8, "V4FLASH_NUMA": "off", **switches, "V4FLASH_MODEL": str(tmp_path)}
    plan = plan_json(extra_env=env)
    p = plan["processes"][0]
    assert p["argv"][1:3] == ["-m", "sglang.launch_server"]  # numa off
    penv = dict(map(tuple, p["env"]))
    assert {k: penv[k] for k in switches} == dict.fromkeys(switches, "0")
    assert plan["patches"] == [[s.name, False] for s in SWITCHES]
    assert plan["model_path"] == str(tmp_path)
    # click resolved the env vars as option values: the layer below --set and the flags
    given = ("V4FLASH_MODEL", "V4FLASH_NUMA", *switches)  # in the order the options are declared
    assert plan["config"]["sources"][-1] == "env:" + ",".join(given)
    assert plan_json(extra_env={**env, "V4FLASH_JSON": "1"})["format"] == "v4flash-pd/plan/2"


def test_version() -> None:
    from v4flash_pd import __version__

    script = Path(sys.executable).parent / "v4flash-pd"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "v4flash_pd"]
    res = subprocess.run([*exe, "--version"], capture_output=True, text=True, timeout=30,
                         env=fakebox.clean_env())
    assert res.returncode == 0 and res.stdout.strip() == f"v4flash-pd, version {__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", __version__)


def test_command_line_round_trips_through_the_shell() -> None:
    """The `.command` form `plan` shows is exactly env + argv once a POSIX shell parses it."""
    import shlex

    from v4flash_pd import topology as topo
    from v4flash_pd.config.load import load_config
    from v4flash_pd.host import Host
    from v4flash_pd.plan import build_plan
    from v4flash_pd.render import command_line

    cfg = load_config(env={}, sets=("env.TRICKY='a b; $(echo no) \"q\"'", "model.path=/models/with space"))
    plan = build_plan(cfg, Host.remote(topo.load(T8)))
    for p in plan.processes:
        words = shlex.split(command_line(p))
        n = len(p.env)
        assert words[0] == "env" and words[1:1 + n] == [f"{k}={v}" for k, v in p.env]
        assert words[1 + n:] == list(p.argv)
    assert dict(plan.get("decode-0").env)["TRICKY"] == 'a b; $(echo no) "q"'


def test_kernels_extra_pins_the_stacks_torch_and_triton() -> None:
    """`pip install v4flash-pd[kernels]` must get the Triton the kernels were tuned and checked with."""
    import tomllib

    from v4flash_pd import stacklock

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["kernels"]
    pins = dict(r.split("==", 1) for r in extra)
    locked = {p.name: p.version for p in stacklock.load_lock(root / "stack.lock").packages if not p.marker}
    assert pins == {"torch": locked["torch"], "triton": locked["triton"]}, (pins, locked.get("triton"))


def test_command_list_help_is_not_truncated(cli) -> None:
    res = cli("--help")
    assert res.returncode == 0
    commands = res.stdout.split("Commands:", 1)[1]
    assert "..." not in commands, commands
    assert "below --min-accuracy" in " ".join(commands.split())  # eval's summary, whole
