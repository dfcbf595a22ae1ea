"""doctor's P2P family: peer access, ACS, IOMMU and PCIe switch of each worker's GPU group, on fixture boxes.

The checks read the box only through the doctor's seams (fake nvidia-smi, sysfs tree, /proc tree,
setpci on PATH); each finding comes with its fix, and a healthy box is all ok.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from ops_doctor_fixtures import make_model, make_numactl_ok
from ops_p2p_fixtures import ACS_OFF, ACS_RR_CR, P2PBox, box_env, make_setpci, read_log

from v4flash_pd.doctor import DoctorInput, WorkerExpect, system_probe
from v4flash_pd.doctor import p2p as P
from v4flash_pd.doctor.context import Expect
from v4flash_pd.topology import probe as probe_topology

PD_WORKERS = (WorkerExpect("prefill-0", "prefill", (0, 1, 2, 3), 0), WorkerExpect("decode-0", "decode", (4, 5, 6, 7), 1))


def _inp(tmp_path, box: P2PBox, workers=PD_WORKERS, setpci: int | None = None) -> DoctorInput:
    env = box_env(tmp_path, box)
    env["PATH"] = str(tmp_path / "bin")  # no real setpci / nvidia-smi from the test machine
    if setpci is not None:
        make_setpci(tmp_path / "bin", setpci)
    return DoctorInput(expect=Expect(workers=workers), topology=probe_topology(env), probe=system_probe(env))


def _rows(inp) -> dict:
    return {c.name: c for c in P.run(inp)}


def test_healthy_switched_box_is_all_ok(tmp_path):
    rows = _rows(_inp(tmp_path, P2PBox()))
    assert {n: c.status for n, c in rows.items()} == {"p2p-access": "ok", "p2p-acs": "ok", "p2p-iommu": "ok",
                                                      "p2p-switch": "ok"}
    assert "prefill-0 (GPUs 0,1,2,3)" in rows["p2p-access"].detail and "decode-0" in rows["p2p-access"].detail
    assert "12 bridge(s)" in rows["p2p-acs"].detail  # per socket: root port, switch upstream, 4 downstream ports
    assert "IOMMU off" in rows["p2p-iommu"].detail
    assert "`nvidia-smi topo -m`" in rows["p2p-switch"].detail
    calls = read_log(tmp_path / "bin" / "nvidia-smi")
    assert ["topo", "-p2p", "w"] in calls and ["topo", "-p2p", "r"] in calls and ["topo", "-m"] in calls


def test_acs_redirect_on_the_bridges_warns_with_the_fix(tmp_path):
    c = _rows(_inp(tmp_path, P2PBox(acs=ACS_RR_CR)))["p2p-acs"]
    assert c.status == "warn" and "ReqRedir+ CmpltRedir+" in c.detail
    assert "0000:11:00.0" in c.detail and "0000:91:03.0" in c.detail  # switch downstream ports, both sockets
    assert "ACS" in c.fix and "setpci" in c.fix and "BIOS" in c.fix


def test_acs_unreadable_without_root_is_a_skip_that_says_how(tmp_path):
    c = _rows(_inp(tmp_path, P2PBox(acs=None)))["p2p-acs"]
    assert c.status == "skip" and "root" in c.detail and "lspci" in c.detail


@pytest.mark.parametrize("value,status", [(ACS_RR_CR, "warn"), (ACS_OFF, "ok")])
def test_acs_through_setpci_when_sysfs_config_is_short(tmp_path, value, status):
    inp = _inp(tmp_path, P2PBox(acs=None), setpci=value)
    c = _rows(inp)["p2p-acs"]
    assert c.status == status, c
    calls = read_log(tmp_path / "bin" / "setpci")
    assert ["-s", "0000:00:01.0", "ECAP_ACS+6.w"] in calls


@pytest.mark.parametrize("iommu,cmdline,status,word", [
    ("DMA-FQ", "quiet", "warn", "translates"),
    ("DMA", "quiet", "warn", "translates"),
    ("identity", "quiet", "ok", "pass-through"),
    ("unknown-type", "quiet intel_iommu=on iommu=pt", "ok", "iommu=pt"),
    ("unknown-type", "quiet intel_iommu=on", "warn", "unknown"),
])
def test_iommu_modes(tmp_path, iommu, cmdline, status, word):
    c = _rows(_inp(tmp_path, P2PBox(iommu=iommu, cmdline=cmdline)))["p2p-iommu"]
    assert c.status == status and word in c.detail, c
    if status == "warn":
        assert "iommu=pt" in c.fix


def test_no_switch_without_force_p2p_warns_with_the_registry_options(tmp_path):
    c = _rows(_inp(tmp_path, P2PBox(switch=False)))["p2p-switch"]
    assert c.status == "warn" and "GPU0-GPU1 NODE" in c.detail and "RegistryDwords is empty" in c.detail
    assert P.FORCE_P2P in c.fix and "modprobe.d" in c.fix


def test_no_switch_with_force_p2p_set_is_ok(tmp_path):
    c = _rows(_inp(tmp_path, P2PBox(switch=False, dwords=P.FORCE_P2P)))["p2p-switch"]
    assert c.status == "ok" and "forces P2P" in c.detail


def test_no_switch_and_no_driver_params_says_it_could_not_read(tmp_path):
    c = _rows(_inp(tmp_path, P2PBox(switch=False, dwords=None)))["p2p-switch"]
    assert c.status == "warn" and "cannot read /proc/driver/nvidia/params" in c.detail


@pytest.mark.parametrize("switch,status", [(True, "ok"), (False, "warn")])
def test_switch_from_sysfs_paths_when_nvidia_smi_has_no_topology(tmp_path, switch, status):
    rows = _rows(_inp(tmp_path, P2PBox(switch=switch, topo=False)))
    assert rows["p2p-switch"].status == status and "sysfs PCI paths" in rows["p2p-switch"].detail
    if not switch:
        assert "GPUs 0,1,2,3 meet at the root complex" in rows["p2p-switch"].detail
    assert rows["p2p-access"].status == "skip" and "gave no matrix" in rows["p2p-access"].detail


def test_pairs_without_p2p_are_named(tmp_path):
    c = _rows(_inp(tmp_path, P2PBox(bad_pairs=((4, 5),))))["p2p-access"]
    assert c.status == "warn" and "decode-0 GPU4->GPU5 write NS" in c.detail and "GPU5->GPU4" in c.detail
    assert "falls back to NCCL" in c.fix


def test_single_gpu_workers_skip(tmp_path):
    workers = (WorkerExpect("prefill-0", "prefill", (0,), 0), WorkerExpect("decode-0", "decode", (4,), 1))
    rows = _rows(_inp(tmp_path, P2PBox(), workers=workers))
    assert all(c.status == "skip" for c in rows.values())


def test_plain_sysfs_dirs_give_skips_not_guesses(tmp_path):
    """The older fixture trees (and some containers) have no PCI links: ACS / switch cannot be told."""
    from ops_doctor_fixtures import make_nvidia_smi, make_sysfs

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {"V4FLASH_SYSFS_ROOT": str(make_sysfs(tmp_path / "sys")), "V4FLASH_NVIDIA_SMI": str(make_nvidia_smi(bin_dir)),
           "V4FLASH_PROC_ROOT": str(tmp_path / "noproc"), "PATH": str(bin_dir)}
    inp = DoctorInput(expect=Expect(workers=PD_WORKERS), topology=probe_topology(env), probe=system_probe(env))
    rows = _rows(inp)
    assert {n: c.status for n, c in rows.items()} == {"p2p-access": "skip", "p2p-acs": "skip", "p2p-iommu": "ok",
                                                      "p2p-switch": "skip"}


def test_parse_acs_walks_the_capability_list():
    from ops_p2p_fixtures import _config

    assert P.parse_acs_control(_config(ACS_RR_CR)) == ACS_RR_CR
    assert P.acs_redirects(ACS_RR_CR) == ["ReqRedir", "CmpltRedir"] and P.acs_redirects(0x5F & ~0x1C) == []
    no_acs = bytearray(_config(ACS_OFF))
    no_acs[0x100:0x104] = (0x0001 | (1 << 16)).to_bytes(4, "little")  # AER, end of list
    assert P.parse_acs_control(bytes(no_acs)) is None
    loop = bytearray(_config(ACS_OFF))
    loop[0x100:0x104] = (0x0001 | (1 << 16) | (0x100 << 20)).to_bytes(4, "little")  # points at itself
    assert P.parse_acs_control(bytes(loop)) is None


def test_registry_dwords():
    assert P.force_p2p_set(P.FORCE_P2P) and P.force_p2p_set("RMForceP2PType=1")
    assert not P.force_p2p_set("") and not P.force_p2p_set("EnableResizableBar=1")


def test_the_real_cli_runs_the_p2p_family(tmp_path):
    """Registered with the other families: `doctor --only p2p` through the real CLI and seams."""
    box = P2PBox(acs=ACS_RR_CR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("V4FLASH_")}
    env.update(box_env(tmp_path, box))
    env.update({"V4FLASH_NUMACTL": str(make_numactl_ok(tmp_path / "bin")), "HOME": str(tmp_path / "home"),
                "PATH": f"{tmp_path / 'bin'}:{env.get('PATH', '')}"})
    model = make_model(tmp_path / "models")
    p = subprocess.run([sys.executable, "-m", "v4flash_pd", "doctor", "--only", "p2p", "--json", "--model", str(model)],
                       capture_output=True, text=True, timeout=180, env=env)
    doc = json.loads(p.stdout)
    rows = {c["name"]: c for c in doc["checks"]}
    assert set(rows) == {"p2p-access", "p2p-acs", "p2p-iommu", "p2p-switch"}, p.stderr
    assert rows["p2p-acs"]["status"] == "warn" and doc["exit_code"] == p.returncode == 3


def test_fixture_box_default_is_the_reference_layout():
    assert replace(P2PBox(), switch=False).switch is False and P2PBox().acs == ACS_OFF
