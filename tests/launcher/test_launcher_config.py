"""Config layering: defaults < profile < TOML file < env < flags, role lists merged by index."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from v4flash_pd import topology as topo
from v4flash_pd.config.keys import DEFAULTS
from v4flash_pd.config.load import load_config
from v4flash_pd.errors import UserError
from v4flash_pd.host import Host
from v4flash_pd.plan import build_plan

NO_ENV: dict[str, str] = {}
T8 = Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json"
T8_HOST = Host.remote(topo.load(T8))


def write(tmp_path: Path, text: str, name: str = "v4.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def decode_cgbs(cfg) -> int | None:
    return cfg.role("decode")[0].cuda_graph_max_bs


# ------------------------------------------------------------------ precedence, one key per layer


def test_one_key_through_every_layer(tmp_path: Path) -> None:
    """decode[0].cuda_graph_max_bs: default None < profile 64 < file 16 < V4FLASH_SET 8 < --set 4."""
    assert DEFAULTS["decode"] == []  # the default layer has no decode worker at all
    assert decode_cgbs(load_config(env=NO_ENV)) == 64
    f = write(tmp_path, "[[decode]]\ncuda_graph_max_bs = 16\n")
    assert decode_cgbs(load_config(f, env=NO_ENV)) == 16
    env = {"V4FLASH_SET": "decode.0.cuda_graph_max_bs=8"}
    assert decode_cgbs(load_config(f, env=env)) == 8
    cfg = load_config(f, env=env, sets=("decode.0.cuda_graph_max_bs=4",))
    assert decode_cgbs(cfg) == 4
    assert cfg.sources == ("defaults", "profile:rtx6000-8x-pd", f"file:{f}", "env:V4FLASH_SET", "flags")


def test_file_merges_role_by_index_keeping_profile_fields(tmp_path: Path) -> None:
    f = write(tmp_path, "[[decode]]\ncuda_graph_max_bs = 16\n")
    d = load_config(f, env=NO_ENV).role("decode")[0]
    # everything else in decode[0] still comes from the profile
    assert (d.gpus, d.tp, d.numa_node, d.port, d.nccl_port) == ((4, 5, 6, 7), 4, 1, 30001, 30011)


def test_model_path_layers_through_cli(tmp_path: Path, topo_8x2: Path, plan_json) -> None:
    """Through the real CLI: file < V4FLASH_SET < V4FLASH_MODEL < --set model.path / --model."""
    f = write(tmp_path, 'model = { path = "/file/model" }\n')
    base = ["--topology", str(topo_8x2), "--config", str(f)]
    assert plan_json(*base)["model_path"] == "/file/model"
    env_set = {"V4FLASH_SET": "model.path=/envset/model"}
    assert plan_json(*base, extra_env=env_set)["model_path"] == "/envset/model"
    env_both = {**env_set, "V4FLASH_MODEL": "/envmodel/model"}
    assert plan_json(*base, extra_env=env_both)["model_path"] == "/envmodel/model"
    assert plan_json(*base, "--model", "/flag/model", extra_env=env_both)["model_path"] == "/flag/model"
    assert plan_json(*base, "--set", "model.path=/flagset/model", extra_env=env_both)["model_path"] == "/flagset/model"
    # the config file itself can come from the environment
    assert plan_json("--topology", str(topo_8x2), extra_env={"V4FLASH_CONFIG": str(f)})["model_path"] == "/file/model"


def test_profile_layers_through_cli(tmp_path: Path, topo_8x2: Path, plan_json) -> None:
    """profile: file's `profile =` < V4FLASH_PROFILE < --profile."""
    f = write(tmp_path, 'profile = "rtx6000-tp4"\n')
    t = ["--topology", str(topo_8x2)]
    assert plan_json(*t)["profile"] == "rtx6000-8x-pd"
    assert plan_json(*t, "--config", str(f))["profile"] == "rtx6000-tp4"
    assert plan_json(*t, "--config", str(f), extra_env={"V4FLASH_PROFILE": "rtx6000-8x-pd"})["profile"] == "rtx6000-8x-pd"
    got = plan_json(*t, "--profile", "rtx6000-tp4", extra_env={"V4FLASH_PROFILE": "rtx6000-8x-pd"})
    assert got["profile"] == "rtx6000-tp4" and got["mode"] == "aggregated"


def test_set_values_are_typed(tmp_path: Path) -> None:
    cfg = load_config(env=NO_ENV, sets=("router.port=9000", "decode.0.gpus=[4,5]", "decode.0.tp=2",
                                         "numa=off", "env.FOO=bar baz"))
    assert cfg.router is not None and cfg.router.port == 9000
    assert cfg.role("decode")[0].gpus == (4, 5) and cfg.numa == "off"
    assert dict(cfg.env)["FOO"] == "bar baz"


def test_set_value_that_looks_like_a_date_stays_text() -> None:
    """TOML would turn these into date/time objects that no key accepts; they mean the text."""
    cfg = load_config(env=NO_ENV, sets=("model.served_name=2026-11-29", "env.RUN_AT=07:30:00",
                                         "env.STAMP=2026-11-29T07:30:00Z"))
    assert cfg.served_name == "2026-11-29"
    assert dict(cfg.env)["RUN_AT"] == "07:30:00" and dict(cfg.env)["STAMP"] == "2026-11-29T07:30:00Z"


# ------------------------------------------------------------------ errors


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    f = write(tmp_path, "[[prefill]]\ngpu = [0]\n")
    with pytest.raises(UserError) as e:
        load_config(f, env=NO_ENV)
    assert "prefill.0." in e.value.message and "'gpu'" in e.value.message
    assert "gpus" in e.value.hint  # the valid keys are listed


def test_unknown_top_level_key_from_set() -> None:
    with pytest.raises(UserError, match="unknown config key 'routr'"):
        load_config(env=NO_ENV, sets=("routr.port=1",))


def test_bad_toml(tmp_path: Path) -> None:
    f = write(tmp_path, "[[prefill]\ngpus = [0\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(f, env=NO_ENV)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env=NO_ENV)


def test_invalid_transfer_backend() -> None:
    with pytest.raises(UserError) as e:
        load_config(env=NO_ENV, sets=("engine.transfer_backend=ucx",))
    assert "engine.transfer_backend" in e.value.message and "'ucx'" in e.value.message
    assert "nixl" in e.value.hint and "mooncake" in e.value.hint


def test_override_without_equals_and_bad_index() -> None:
    with pytest.raises(UserError, match="not KEY=VALUE"):
        load_config(env={"V4FLASH_SET": "router.port"})
    with pytest.raises(UserError, match="not a valid list index"):
        load_config(env=NO_ENV, sets=("decode.5.port=1",))


def test_unknown_profile() -> None:
    with pytest.raises(UserError) as e:
        load_config(profile="rtx9000", env=NO_ENV)
    assert "rtx9000" in e.value.message and "rtx6000-tp4" in e.value.hint


@pytest.mark.parametrize("item, needle", [
    ("router.port=70000", "not a valid port"),
    ("decode.0.tp=true", "must be a positive integer"),
    ("engine.mem_fraction_static=1.5", "outside (0, 1)"),
    ("numa=sometimes", "numa"),
    ("prefill.0.nccl_port=0", "not a valid port"),
])
def test_value_validation(item: str, needle: str) -> None:
    with pytest.raises(UserError) as e:
        load_config(env=NO_ENV, sets=(item,))
    assert needle in e.value.message


# ------------------------------------------------------------------ roles


# (a TP2 worker holds 86 GiB of weights per GPU: at the profile's 0.70 the memory check refuses it)
TWO_P = """
[[prefill]]
gpus = [0, 1]
tp = 2
mem_fraction_static = 0.94

[[prefill]]
gpus = [2, 3]
tp = 2
mem_fraction_static = 0.94
numa_node = 0
port = 30002
bootstrap_port = 8999
nccl_port = 30012
"""


def test_2p1d_is_a_config_change(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, TWO_P), env=NO_ENV)
    plan = build_plan(cfg, T8_HOST)
    prefills = [p for p in plan.processes if p.role == "prefill"]
    assert [p.name for p in prefills] == ["prefill-0", "prefill-1"]
    assert [dict(p.env)["CUDA_VISIBLE_DEVICES"] for p in prefills] == ["0,1", "2,3"]
    router = plan.router()
    assert router is not None
    argv = list(router.argv)
    pairs = [argv[i + 1:i + 3] for i, a in enumerate(argv) if a == "--prefill"]
    assert pairs == [["http://127.0.0.1:30000", "8998"], ["http://127.0.0.1:30002", "8999"]]
    assert argv.count("--decode") == 1
    assert plan.expected == (("prefill", 2), ("decode", 1))
    p1 = list(plan.get("prefill-1").argv)
    assert p1[p1.index("--disaggregation-bootstrap-port") + 1] == "8999"
    assert p1[p1.index("--tp-size") + 1] == "2"


def test_per_role_extra_args_and_env_stay_in_their_role(tmp_path: Path) -> None:
    f = write(tmp_path, """
[[prefill]]
extra_args = ["--chunked-prefill-size", "8192"]
env = { ONLY_PREFILL = "p" }

[[decode]]
extra_args = "--max-running-requests 64"
env = { ONLY_DECODE = "d" }

[router]
extra_args = ["--log-level", "debug"]
env = { ONLY_ROUTER = "r" }
""")
    plan = build_plan(load_config(f, env=NO_ENV), T8_HOST)
    p, d, r = plan.get("prefill-0"), plan.get("decode-0"), plan.get("router")
    assert p.argv[-2:] == ("--chunked-prefill-size", "8192") and "--max-running-requests" not in p.argv
    assert d.argv[-2:] == ("--max-running-requests", "64") and "--chunked-prefill-size" not in d.argv
    assert r.argv[-2:] == ("--log-level", "debug")
    assert "--log-level" not in p.argv + d.argv and "--chunked-prefill-size" not in r.argv
    envs = {x.name: dict(x.env) for x in (p, d, r)}
    assert envs["prefill-0"].get("ONLY_PREFILL") == "p" and "ONLY_DECODE" not in envs["prefill-0"]
    assert envs["decode-0"].get("ONLY_DECODE") == "d" and "ONLY_PREFILL" not in envs["decode-0"]
    assert envs["router"].get("ONLY_ROUTER") == "r"
    assert not {"ONLY_PREFILL", "ONLY_DECODE"} & set(envs["router"])
    # a per-role env layered on top keeps the shared offline env (union, not replace)
    assert envs["decode-0"]["HF_HUB_OFFLINE"] == "1"


def test_tp4_profile_is_one_aggregated_server() -> None:
    cfg = load_config(profile="rtx6000-tp4", env=NO_ENV)
    plan = build_plan(cfg, T8_HOST)
    assert [p.role for p in plan.processes] == ["server"]
    assert plan.router() is None and plan.expected == ()
    argv = plan.processes[0].argv
    assert not [a for a in argv if a.startswith("--disaggregation")]
    assert "--pd-disaggregation" not in argv
    assert argv[argv.index("--tp-size") + 1] == "4"
    assert argv[argv.index("--port") + 1] == "8000" and plan.url == "http://0.0.0.0:8000"
    env = dict(plan.processes[0].env)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and env["HF_HUB_OFFLINE"] == "1"
    assert "UCX_TLS" not in env  # no KV transfer, no UCX tuning


def test_tp4_rejects_pd_roles(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"\[\[decode\]\] workers but mode = 'aggregated'"):
        load_config(write(tmp_path, 'profile = "rtx6000-tp4"\n[[decode]]\ngpus = [4]\nport = 1\nnccl_port = 2\n'),
                    env=NO_ENV)



def test_file_env_table_adds_to_profile_env(tmp_path: Path) -> None:
    """An [env] table in a file adds variables; it does not drop the profile's offline/UCX env."""
    env = dict(load_config(write(tmp_path, '[env]\nEXTRA = "x"\nUCX_TLS = "tcp,self"\n'), env=NO_ENV).env)
    assert env["EXTRA"] == "x" and env["UCX_TLS"] == "tcp,self"
    assert env["HF_HUB_OFFLINE"] == "1" and env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "UCX"


def test_v4flash_set_keeps_toml_lists_and_quoted_spaces_whole() -> None:
    """V4FLASH_SET splits on whitespace, but not inside a TOML list or a quoted string."""
    env = {"V4FLASH_SET": 'prefill.0.extra_args=["--chunked-prefill-size", "8192"]  env.FOO="a b"\n numa="off"'}
    cfg = load_config(env=env)
    assert cfg.role("prefill")[0].extra_args == ("--chunked-prefill-size", "8192")
    assert dict(cfg.env)["FOO"] == "a b" and cfg.numa == "off"


def fake_nixl(tmp_path: Path) -> Path:
    """A site dir laid out like the nixl-cu13 wheel: nixl_cu13/ plus nixl_cu13.libs/ucx."""
    site = tmp_path / "site"
    (site / "nixl_cu13").mkdir(parents=True)
    (site / "nixl_cu13" / "__init__.py").write_text("")
    (site / "nixl_cu13.libs" / "ucx").mkdir(parents=True)
    return site


def test_ucx_module_dir_auto_resolves_to_nixl_bundled_ucx(tmp_path: Path, cli) -> None:
    """`plan` on this host resolves UCX_MODULE_DIR = "auto" from this host's nixl (the Host's fact)."""
    import os

    import fakebox

    site = fake_nixl(tmp_path)
    pp = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**fakebox.box_env(tmp_path, fakebox.BOX_8GPU_2NODE), "PYTHONPATH": pp}
    res = cli("plan", "--json", env=env)
    assert res.returncode == 0, res.stderr
    for p in json.loads(res.stdout)["processes"][:2]:
        assert dict(map(tuple, p["env"]))["UCX_MODULE_DIR"] == str(site / "nixl_cu13.libs" / "ucx")


def test_ucx_module_dir_resolves_when_nixl_is_already_imported(tmp_path: Path) -> None:
    """Regression: with nixl_cu13 already in sys.modules (e.g. doctor imported it) the dir was dropped."""
    import os
    import subprocess
    import sys

    site = fake_nixl(tmp_path)
    code = ("import nixl_cu13\nfrom v4flash_pd.host import ucx_module_dir\nprint(ucx_module_dir() or 'MISSING')")
    pp = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": pp})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(site / "nixl_cu13.libs" / "ucx")


def test_ucx_module_dir_auto_never_reaches_a_worker_literally() -> None:
    """Config keeps "auto" (it is pure); the plan resolves it from the Host or drops it."""
    from v4flash_pd.host import Host

    c = load_config(env=NO_ENV)
    assert dict(c.env)["UCX_MODULE_DIR"] == "auto"
    host = Host.remote(topo.load(T8))
    assert "UCX_MODULE_DIR" not in dict(build_plan(c, host).get("decode-0").env)
    found = build_plan(c, replace(host, ucx_module_dir="/x/nixl_cu13.libs/ucx")).get("decode-0")
    assert dict(found.env)["UCX_MODULE_DIR"] == "/x/nixl_cu13.libs/ucx"


def test_prefill_chunk_limit_is_exactly_the_sm120_threshold() -> None:
    """SGLang compares `q.shape[0] > 11673`: a chunk of 11673 is fine, 11674 would crash sm_120."""
    from v4flash_pd.config.values import MAX_PREFILL_CHUNK

    assert MAX_PREFILL_CHUNK == 11673
    assert load_config(env=NO_ENV, sets=("engine.chunked_prefill_size=11673",)).chunked_prefill_size == 11673
    for bad in ("11674", "-1", "0"):
        with pytest.raises(UserError, match="chunked_prefill_size"):
            load_config(env=NO_ENV, sets=(f"engine.chunked_prefill_size={bad}",))
    with pytest.raises(UserError, match="11674"):
        load_config(env=NO_ENV, sets=('engine.extra_args="--chunked-prefill-size=11674"',))
    assert load_config(env=NO_ENV).chunked_prefill_size == 8192  # the profiles say it explicitly
