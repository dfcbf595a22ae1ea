"""What a hostile run found after the cluster work (issue 23): values that reach a rendered script or
manifest, a router argv or a secret's hiding place, and the inputs that ended in a traceback. Each is
refused by the real CLI with one `error:` + `fix:` paragraph, exit 2, before anything is written or
started; where the defect was a wrong output, the output is checked instead."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import fakebox
import pytest
import yaml

FIXTURES = Path(__file__).parent / "fixtures"
T8 = str(FIXTURES / "topology-8gpu-2node.json")
PARAGRAPH = re.compile(r"\Aerror: [^\n]+\n  fix: [^\n]+\n\Z")
INJECTED = "reg/img:1\ntouch /tmp/v4flash-injected\n#"

Cli = Callable[..., subprocess.CompletedProcess]


def write(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def slurm(*args: str, out: str = "OUT") -> list[str]:
    return ["render", "slurm", "--boxes", "2", "--prefill", "1", "--decode", "1", "-o", out, *args]


def k8s(*args: str, out: str = "OUT") -> list[str]:
    return ["render", "k8s", "--prefill", "1", "--decode", "1", "-o", out, *args]


def cluster_plan(tmp: Path, profile: str) -> str:
    """A cluster plan as `render slurm` writes it, then its profile edited by hand."""
    out = tmp / "rendered" / "job.sbatch"
    res = subprocess.run([sys.executable, "-m", "v4flash_pd", "render", "slurm", "--boxes", "2", "-o", str(out)],
                         capture_output=True, text=True, env=fakebox.clean_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads((out.parent / "cluster-plan.json").read_text())
    doc["profile"] = profile
    return write(tmp, "edited-plan.json", json.dumps(doc))


# (id, argv builder (OUT = a render output, RUN = a run dir), words the paragraph must contain)
CASES: list[tuple[str, Callable[[Path], list[str]], list[str]]] = [
    # MED: a newline in --image wrote a command into the sbatch script's header comment
    ("slurm-image-with-newline", lambda t: slurm("--container", "pyxis", "--image", INJECTED),
     ["--image", "control character", "\\n"]),
    ("slurm-apptainer-image-with-cr", lambda t: slurm("--container", "apptainer", "--image", "/s/i.sif\r#"),
     ["--image", "\\r"]),
    ("slurm-config-value-with-newline", lambda t: slurm("--set", 'smoke_prompt="Hi\\nrm -rf /"'),
     ["smoke_prompt", "control character"]),
    ("slurm-env-value-with-escape", lambda t: slurm("--set", 'env.UCX_LOG_LEVEL="info\\u001b[2J"'),
     ["env.UCX_LOG_LEVEL", "\\x1b"]),
    ("k8s-image-with-newline", lambda t: k8s("--image", "reg/img:1\nkind: Secret"), ["--image", "\\n"]),
    ("k8s-model-with-newline", lambda t: k8s("--model", "/models/a\nb"), ["model.path", "\\n"]),
    # LOW (lax): #SBATCH values with shell or list syntax
    ("slurm-partition-with-semicolon", lambda t: slurm("--partition", "gpu;reboot"), ["--partition", "#SBATCH"]),
    ("slurm-account-with-pipe", lambda t: slurm("--account", "a|b"), ["--account"]),
    ("slurm-time-with-and", lambda t: slurm("--time", "1&&2"), ["--time"]),
    ("slurm-job-name-with-ampersand", lambda t: slurm("--job-name", "v4&x"), ["--job-name"]),
    # cluster.hosts reaches the router's argv, URLs and the plan carried in the script
    ("hosts-with-shell-injection", lambda t: ["plan", "--topology", T8, "--boxes", "2", "--hosts",
                                             "n1;touch${IFS}x,n2"], ["cluster.hosts[0]", "not a host name"]),
    ("hosts-with-backticks", lambda t: ["plan", "--topology", T8, "--boxes", "2", "--hosts", "`id`,n2"],
     ["cluster.hosts[0]", "not a host name"]),
    ("hosts-with-dollar", lambda t: slurm("--set", 'cluster.hosts=["n1", "$(id)"]'), ["cluster.hosts[1]"]),
    ("worker-host-with-semicolon", lambda t: ["plan", "--topology", T8, "--set", "prefill.0.host=a;b"],
     ["prefill.0.host", "not a host name"]),
    # LOW: an argparse prefix of --api-key put the key on the router's command line
    ("api-key-prefix", lambda t: ["plan", "--topology", T8, "--set", 'router.extra_args=["--api-ke", "s3cret"]'],
     ["--api-ke", "--api-key", "router.api_key_file"]),
    ("api-key-prefix-with-equals", lambda t: ["plan", "--topology", T8, "--set", 'router.extra_args=["--api=s3cret"]'],
     ["'--api'", "router.api_key_file"]),
    ("api-key-prefix-as-a-string", lambda t: ["plan", "--topology", T8, "--set",
                                              "router.extra_args='--log-level info --ap s3cret'"], ["--ap"]),
    # the key's hiding place must be one
    ("api-key-env-path", lambda t: ["plan", "--topology", T8, "--set", "router.api_key_env=PATH"],
     ["router.api_key_env = 'PATH'", "ROUTER_API_KEY"]),
    ("api-key-env-ld-preload", lambda t: ["plan", "--topology", T8, "--set", "router.api_key_env=LD_PRELOAD"],
     ["LD_PRELOAD"]),
    ("api-key-env-not-a-name", lambda t: ["plan", "--topology", T8, "--set", 'router.api_key_env="1KEY"'],
     ["not an environment variable name"]),
    ("k8s-relative-api-key-file", lambda t: k8s("--set", "router.api_key_file=keys/router.key"),
     ["router.api_key_file", "absolute", "mountPath"]),
    # a plan file whose profile is not one we have ran with the defaults
    ("cluster-plan-unknown-profile", lambda t: ["up", "--cluster-plan", cluster_plan(t, "nope"), "--box", "0",
                                                "--rehearse", "--run-dir", "RUN"], ["unknown profile 'nope'"]),
    # tracebacks: `render k8s` read the raw layers with int()
    # (without --prefill: that typed option would win over the --set and render 1 prefill pod)
    ("k8s-cluster-prefill-not-a-number", lambda t: ["render", "k8s", "-o", "OUT", "--set", "cluster.prefill=abc"],
     ["cluster.prefill"]),
    ("k8s-prefill-tp-not-a-number", lambda t: k8s("--set", "prefill.0.tp=abc"), ["prefill.0.tp"]),
    ("k8s-prefill-not-a-list", lambda t: k8s("--set", "prefill=5"), ["prefill", "list of tables"]),
    ("k8s-cluster-not-a-table", lambda t: k8s("--set", "cluster=5"), ["cluster", "a table"]),
]


@pytest.mark.parametrize("name, argv, words", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_one_paragraph_and_writes_nothing(name: str, argv: Callable[[Path], list[str]],
                                                          words: list[str], cli: Cli, tmp_path: Path) -> None:
    names = {"OUT": str(tmp_path / "out" / "rendered.file"), "RUN": str(tmp_path / "run")}
    args = [names.get(a, a) for a in argv(tmp_path)]
    res = cli(*args, extra_env={"V4FLASH_RUNS_ROOT": str(tmp_path / "runs")})
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    assert PARAGRAPH.match(res.stderr), f"not one error/fix paragraph:\n{res.stderr}"
    for w in words:
        assert w in res.stderr, (w, res.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_the_real_router_reads_an_abbreviated_api_key() -> None:
    """Why a prefix must be refused: sglang-router 0.3.2's parser expands it to --api-key."""
    from sglang_router.launch_router import parse_router_args

    for prefix in ("--ap", "--api", "--api-", "--api-k", "--api-ke"):
        assert parse_router_args([prefix, "s3cret"]).api_key == "s3cret", prefix


def test_sbatch_header_quotes_what_it_shows(cli: Cli, tmp_path: Path) -> None:
    """A value the header comment shows is one shell word there, quoted, on its own line."""
    out = tmp_path / "job.sbatch"
    res = cli(*slurm("--container", "pyxis", "--image", "docker://reg#v4flash-pd:0.1 ; x", out=str(out)))
    assert res.returncode == 0, res.stderr
    comment = next(line for line in out.read_text().splitlines() if line.startswith("# Container:"))
    assert "'docker://reg#v4flash-pd:0.1 ; x'" in comment
    assert subprocess.run(["bash", "-n", str(out)], capture_output=True, timeout=30).returncode == 0


def test_k8s_host_path_is_the_model_path_exactly(cli: Cli, tmp_path: Path) -> None:
    """A model path outside the BMP (an emoji) was written as a JSON surrogate pair, which YAML reads
    as two lone surrogates: hostPath named another directory."""
    model = "/models/\U0001F600x"
    out = tmp_path / "v4flash.yaml"
    res = cli(*k8s("--model", model, out=str(out)))
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(out.read_text(encoding="utf-8")) if d]
    paths = [v["hostPath"]["path"] for d in docs if d["kind"] == "LeaderWorkerSet"
             for v in d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["volumes"] if "hostPath" in v]
    assert paths == [model, model]
    mounts = [m["mountPath"] for d in docs if d["kind"] == "LeaderWorkerSet"
              for c in d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
              for m in c["volumeMounts"] if m["name"] == "model"]
    assert mounts == [model, model]
    plan = json.loads(docs[0]["data"]["cluster-plan.json"])
    assert plan["config"]["model"]["path"] == model


@pytest.mark.parametrize("procs", [[1234, 5678], "prefill-0"], ids=["list", "string"])
@pytest.mark.parametrize("command", ["status", "down"])
def test_status_and_down_read_a_corrupt_procs_entry_without_a_traceback(procs: object, command: str, cli: Cli,
                                                                         tmp_path: Path) -> None:
    """state.json whose `procs` is not a table (hand-edited, or written by something else): the .pid files
    are the fallback, and the problem is said, not raised."""
    run = tmp_path / "run"
    (run / "patch").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"status": "stopped", "procs": procs, "url": "http://127.0.0.1:1"}))
    (run / "plan.json").write_text(json.dumps({"processes": []}))
    res = cli(command, "--run-dir", str(run))
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "procs" in res.stdout and "not a table" in res.stdout, res.stdout


def test_plan_says_what_is_reachable_from_other_machines_and_what_guards_it(cli: Cli, tmp_path: Path) -> None:
    """Issue 23, security: `plan` names every listener beyond the box and whether anything guards it."""
    one = cli("plan", "--topology", T8)
    assert one.returncode == 0, one.stderr
    text = one.stdout.split("reachable from other machines:", 1)[1]
    assert "router http on 0.0.0.0:8000: NO authentication" in text
    assert "KV transfer on NIXL/UCX and SGLang's ZMQ side channel" in text
    assert "prefill-0 http" not in text  # the profile keeps workers on 127.0.0.1
    key = tmp_path / "k"
    key.write_text("s3cret\n")
    hosts = ["--boxes", "2", "--hosts", "10.0.0.1,10.0.0.2"]
    open_ = cli("plan", "--topology", T8, *hosts, "--json")
    keyed = cli("plan", "--topology", T8, *hosts, "--json", "--set", f"router.api_key_file={key}")
    assert open_.returncode == 0 and keyed.returncode == 0, open_.stderr + keyed.stderr
    box0 = json.loads(open_.stdout)["exposure"]["box 0"]
    assert "prefill-0 http on 10.0.0.1:30000: NO authentication" in box0
    assert "prefill-0 bootstrap on 10.0.0.1:8998: NO authentication" in box0
    keyed0 = json.loads(keyed.stdout)["exposure"]["box 0"]
    assert "prefill-0 http on 10.0.0.1:30000: API key (the router's)" in keyed0
    assert "prefill-0 bootstrap on 10.0.0.1:8998: NO authentication" in keyed0  # SGLang's has none
    assert "router http on 0.0.0.0:8000: API key" in json.loads(keyed.stdout)["exposure"]["router"]


def test_doctor_warns_about_unauthenticated_listeners_of_a_cluster_box(cli: Cli, tmp_path: Path) -> None:
    plan = tmp_path / "out" / "job.sbatch"
    assert cli("render", "slurm", "--boxes", "2", "-o", str(plan)).returncode == 0
    res = cli("doctor", "--json", "--cluster-plan", str(plan.parent / "cluster-plan.json"), "--box", "0",
              "--hosts", "127.0.0.1,127.0.0.1", "--set", "cluster.bind_host=0.0.0.0", "--rehearse", timeout=120)
    assert res.returncode in (3, 4), res.stdout + res.stderr
    row = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "exposure")
    assert row["status"] == "warn" and "prefill-0 bootstrap on 0.0.0.0:8998" in row["detail"], row
    assert "NetworkPolicy" in row["fix"]


@pytest.mark.parametrize("value", ["0.01", "3"])
def test_a_tiny_hang_timeout_is_warned_about(value: str, plan_json: Callable[..., dict]) -> None:
    """hang_timeout = 0.01 was accepted silently: every healthy SGLang worker would be declared hung."""
    warnings = plan_json("--topology", T8, "--set", f"hang_timeout={value}")["warnings"]
    assert any(w["code"] == "hang-timeout-short" and w["text"].startswith(f"hang_timeout = {float(value):g}s is short")
               and "--set hang_timeout=60" in w["text"] for w in warnings), warnings
    assert not any("hang_timeout" in w["text"] for w in plan_json("--topology", T8)["warnings"])
