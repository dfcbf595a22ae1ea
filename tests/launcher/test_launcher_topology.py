"""Topology probe through its real seams (V4FLASH_SYSFS_ROOT, V4FLASH_NVIDIA_SMI), from a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import fakebox
from fakebox import BOX_4GPU_1NODE, BOX_8GPU_2NODE, BOX_8GPU_SWAPPED, Box

from v4flash_pd import topology as topo

FIXTURES = Path(__file__).parent / "fixtures"


def topology_json(cli, env: dict[str, str]) -> dict:
    res = cli("topology", "--json", env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_probe_8gpu_2node_via_cli(tmp_path: Path, cli) -> None:
    env = fakebox.box_env(tmp_path, BOX_8GPU_2NODE)
    t = topology_json(cli, env)
    assert [g["index"] for g in t["gpus"]] == list(range(8))
    assert {g["index"]: g["numa_node"] for g in t["gpus"]} == {i: 0 if i < 4 else 1 for i in range(8)}
    # nvidia-smi's 00000000:9A:00.0 is normalised to sysfs' 0000:9a:00.0
    assert [g["bus_id"] for g in t["gpus"]] == list(fakebox.BUS_IDS_8)
    assert t["nodes"] == [{"id": 0, "cpus": "0-15,32-47"}, {"id": 1, "cpus": "16-31,48-63"}]
    assert t["driver_version"] == "580.95.05"
    g0 = t["gpus"][0]
    assert (g0["compute_cap"], g0["memory_mib"], g0["name"]) == ("12.0", fakebox.MEMORY_MIB, fakebox.GPU_NAME)
    assert t["notes"] == []
    # the probe ran the nvidia-smi it was told to, with the documented query
    calls = fakebox.read_argv_log(Path(env["V4FLASH_NVIDIA_SMI"]))
    assert calls == [["--query-gpu=index,name,pci.bus_id,compute_cap,memory.total,driver_version,uuid",
                      "--format=csv,noheader,nounits"]]


def test_probe_matches_the_static_fixtures(tmp_path: Path, cli) -> None:
    """The committed --topology fixtures describe exactly what the probe sees on those boxes."""
    for box in (BOX_8GPU_2NODE, BOX_4GPU_1NODE, BOX_8GPU_SWAPPED):
        t = topology_json(cli, fakebox.box_env(tmp_path / box.name, box))
        want = json.loads((FIXTURES / f"topology-{box.name}.json").read_text())
        for d in (t, want):
            d.pop("source")
        assert t == want, box.name


def test_unknown_numa_node_is_minus_one(tmp_path: Path, cli) -> None:
    box = Box("partial", ((fakebox.BUS_IDS_8[0], 0), (fakebox.BUS_IDS_8[1], None)), {0: "0-7"})
    t = topology_json(cli, fakebox.box_env(tmp_path, box))
    assert [g["numa_node"] for g in t["gpus"]] == [0, -1]
    human = cli("topology", env=fakebox.box_env(tmp_path / "h", box))
    assert human.returncode == 0
    rows = {line.split()[0]: line.split()[:3] for line in human.stdout.splitlines() if "0000:" in line}
    assert rows["0"] == ["0", "0000:17:00.0", "0"] and rows["1"] == ["1", "0000:3d:00.0", "?"]
    assert "GPU  BUS ID" in human.stdout and "NODE  CPUS" in human.stdout


def test_save_is_a_valid_topology_for_plan(tmp_path: Path, cli) -> None:
    saved = tmp_path / "box.json"
    res = cli("topology", "--save", str(saved), env=fakebox.box_env(tmp_path, BOX_8GPU_2NODE))
    assert res.returncode == 0, res.stderr
    assert f"saved to {saved}" in res.stderr
    loaded = topo.load(saved)
    assert [g.numa_node for g in loaded.gpus] == [0] * 4 + [1] * 4
    # a machine without the fake box (no nvidia-smi at all) plans the saved box from the file alone
    bare = fakebox.clean_env()
    bare["V4FLASH_NVIDIA_SMI"] = str(tmp_path / "absent-nvidia-smi")
    res = cli("plan", "--json", "--topology", str(saved), env=bare)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    binds = {p["name"]: p["binding"] for p in plan["processes"]}
    assert binds["prefill-0"]["node"] == 0 and binds["decode-0"]["node"] == 1
    assert not [w for w in plan["warnings"] if "GPU" in w["text"]]  # all 8 GPUs exist in the saved box


def test_missing_nvidia_smi_gives_no_gpus_and_a_note(tmp_path: Path, cli) -> None:
    empty_bin = tmp_path / "emptybin"
    empty_bin.mkdir()
    env = fakebox.clean_env()
    env["PATH"] = str(empty_bin)  # the CLI is started by absolute interpreter path
    env["V4FLASH_SYSFS_ROOT"] = str(fakebox.make_sysfs(tmp_path, BOX_8GPU_2NODE.gpus, BOX_8GPU_2NODE.nodes))
    t = topology_json(cli, env)
    assert t["gpus"] == []
    assert t["notes"] == ["nvidia-smi not found: no GPUs detected"]
    assert len(t["nodes"]) == 2  # sysfs is still read
    human = cli("topology", env=env)
    assert "no GPUs detected" in human.stdout and "note: nvidia-smi not found" in human.stdout


def test_broken_nvidia_smi_is_a_note_not_a_crash(tmp_path: Path, cli) -> None:
    env = fakebox.clean_env()
    env["V4FLASH_NVIDIA_SMI"] = str(tmp_path / "does-not-exist")
    t = topology_json(cli, env)
    assert t["gpus"] == [] and len(t["notes"]) == 1 and "could not run" in t["notes"][0]
    failing = fakebox._write_exec(tmp_path / "smi-fail", "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    env["V4FLASH_NVIDIA_SMI"] = str(failing)
    t = topology_json(cli, env)
    assert t["gpus"] == [] and t["notes"] == ["nvidia-smi failed (exit 9): NVIDIA-SMI has failed"]


def test_normalize_bus_id_forms() -> None:
    assert topo.normalize_bus_id("00000000:9A:00.0") == "0000:9a:00.0"
    assert topo.normalize_bus_id("0000:9a:00.0") == "0000:9a:00.0"
    assert topo.normalize_bus_id("9A:00.0") == "0000:9a:00.0"
    assert topo.normalize_bus_id("00000001:03:1F.7") == "0001:03:1f.7"


def test_null_numa_node_in_a_file_means_unknown(tmp_path: Path) -> None:
    data = {"gpus": [{"index": 0, "bus_id": "0000:17:00.0", "numa_node": None},
                     {"index": 1, "bus_id": "0000:3d:00.0"}], "nodes": [{"id": 0, "cpus": "0-7"}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert [g.numa_node for g in topo.load(path).gpus] == [topo.UNKNOWN_NODE, topo.UNKNOWN_NODE] == [-1, -1]


def test_malformed_and_missing_topology_files(tmp_path: Path, cli) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus": [{"name": "no index"}]}')
    res = cli("plan", "--topology", str(bad))
    assert res.returncode == 2 and "is malformed" in res.stderr and "Traceback" not in res.stderr
    res = cli("plan", "--topology", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "topology --save" in res.stderr
