"""P2P readiness of each worker's GPU group (the TP group whose all-reduce goes over peer memory).

The IPC all-reduce (`v4flash_kernels.allreduce`) and NCCL's P2P transport need every GPU of a group to
write into its peers' memory directly. On PCIe boxes four things decide whether that works and how fast:
* peer access per pair, as the driver reports it (`nvidia-smi topo -p2p w|r`);
* ACS on the PCI bridges above the GPUs: Request/Completion Redirect or Upstream Forwarding send
  every peer write up to the root complex (slow, and on Blackwell boxes NCCL hangs after init);
* the IOMMU: translating the GPUs' DMA (type DMA / DMA-FQ) blocks or slows peer traffic; pass-through
  (`iommu=pt`, group type `identity`) or off is what P2P wants;
* a PCIe switch between the GPUs: without one (`nvidia-smi topo -m` PHB / NODE / SYS) the driver
  stages peer copies through host memory (~15x slower) unless its ForceP2P registry options are set
  (`/proc/driver/nvidia/params`, RegistryDwords).
Every fact is read through the doctor's seams: `V4FLASH_NVIDIA_SMI`, `V4FLASH_SYSFS_ROOT`, and
`V4FLASH_PROC_ROOT` (a /proc tree: `cmdline`, `driver/nvidia/params`), so tests describe any box.
A finding is a warning, never an error: without P2P the all-reduce falls back to NCCL by itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, ok, skip, warn
from v4flash_pd.topology import parse_matrix

FORCE_P2P = "ForceP2P=0x11;RMForceP2PType=1;RMPcieP2PType=2;GrdmaPciTopoCheckOverride=1"
FORCE_P2P_FIX = (f'without a PCIe switch set the driver\'s P2P options: echo \'options nvidia NVreg_RegistryDwords='
                 f'"{FORCE_P2P}"\' > /etc/modprobe.d/nvidia-p2p.conf, rebuild the initramfs '
                 "(update-initramfs -u / dracut -f), reboot, and check /proc/driver/nvidia/params")
ACS_FIX = ("disable ACS on the bridges above the GPUs: in the BIOS (PCIe 'ACS Control' / 'ACS Enable' off), or after "
           "each boot as root `setpci -s <bridge> ECAP_ACS+6.w=0000` for the bridges named")
IOMMU_FIX = ("boot with the IOMMU in pass-through: add `iommu=pt` (Intel: `intel_iommu=on iommu=pt`, AMD: "
             "`amd_iommu=on iommu=pt`) to the kernel command line, or disable VT-d / AMD-Vi in the BIOS")
P2P_FIX = ("peer access needs ACS off, the IOMMU off or in pass-through and, without a PCIe switch, the driver's "
           "ForceP2P options (the p2p-acs / p2p-iommu / p2p-switch rows say which); re-check with "
           "`nvidia-smi topo -p2p w`. Until then the all-reduce falls back to NCCL")

ACS_CAP_ID = 0x000D
ACS_REDIRECT_BITS = {2: "ReqRedir", 3: "CmpltRedir", 4: "UpstreamFwd"}  # ACS Control register bits
SWITCH_LINKS = ("PIX", "PXB")  # through PCIe switch(es) only
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


# ----------------------------------------------------------------------------- inputs


def groups(inp: DoctorInput) -> list[tuple[str, tuple[int, ...]]]:
    """(worker name, its GPUs) for every worker whose group has peers."""
    return [(w.name, tuple(w.gpus)) for w in inp.expect.workers if len(w.gpus) > 1]


def _pairs(gpus: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(a, b) for a in gpus for b in gpus if a != b]


def _smi(inp: DoctorInput) -> str | None:
    return inp.probe.env.get("V4FLASH_NVIDIA_SMI") or inp.probe.which("nvidia-smi")


def _matrix(inp: DoctorInput, *args: str) -> tuple[dict[str, Any], str]:
    """(parsed `nvidia-smi topo ...` matrix, why not) through the probe."""
    smi = _smi(inp)
    if not smi:
        return {}, "nvidia-smi not found"
    r = inp.probe.run([smi, "topo", *args], 60.0)
    m = parse_matrix(r.out) if r.rc == 0 else {}
    if not m.get("rows"):
        return {}, f"`nvidia-smi topo {' '.join(args)}` gave no matrix ({r.text.splitlines()[-1] if r.text else r.rc})"
    return m, ""


def _cell(m: dict[str, Any], a: int, b: int) -> str | None:
    cols = m.get("columns", [])
    row = m.get("rows", {}).get(f"GPU{a}")
    name = f"GPU{b}"
    if row is None or name not in cols or cols.index(name) >= len(row):
        return None
    return str(row[cols.index(name)])


def _sysfs(inp: DoctorInput) -> Path:
    return Path(inp.probe.env.get("V4FLASH_SYSFS_ROOT", "/sys"))


def _proc(inp: DoctorInput) -> Path:
    return Path(inp.probe.env.get("V4FLASH_PROC_ROOT", "/proc"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def bridges_above(sysfs: Path, bdf: str) -> list[str] | None:
    """The PCI bridges between the root complex and a device, top first (None: path unknown).

    /sys/bus/pci/devices/<bdf> links into /sys/devices/pciDDDD:BB/<root port>/.../<bdf>; every
    BDF-named directory on the way is a bridge (root port, switch ports).
    """
    link = sysfs / "bus" / "pci" / "devices" / bdf
    try:
        real = Path(os.path.realpath(link))
        devices = Path(os.path.realpath(sysfs / "devices"))
        rel = real.relative_to(devices)
    except (OSError, ValueError):
        return None
    parts = rel.parts
    if len(parts) < 2 or not parts[0].startswith("pci") or parts[-1] != bdf:
        return None
    return [p for p in parts[1:-1] if _BDF.match(p)]


def acs_control(inp: DoctorInput, bdf: str) -> int | None:
    """A bridge's ACS Control register (None: no ACS capability found or config space not readable)."""
    cfg = sysfs_config(_sysfs(inp), bdf)
    if cfg is not None:
        return parse_acs_control(cfg)
    setpci = inp.probe.which("setpci")
    if not setpci:
        return None
    r = inp.probe.run([setpci, "-s", bdf, "ECAP_ACS+6.w"], 30.0)
    try:
        return int(r.out.strip(), 16) if r.rc == 0 and r.out.strip() else None
    except ValueError:
        return None


def sysfs_config(sysfs: Path, bdf: str) -> bytes | None:
    """The config space when its extended part is readable (as root; others see only 64/256 bytes)."""
    try:
        data = (sysfs / "bus" / "pci" / "devices" / bdf / "config").read_bytes()
    except OSError:
        return None
    return data if len(data) > 0x100 else None


def parse_acs_control(cfg: bytes) -> int | None:
    """Walk the PCIe extended capability list (from 0x100) to ACS; return its Control register."""
    off, seen = 0x100, set()
    while 0x100 <= off <= len(cfg) - 8 and off not in seen:
        seen.add(off)
        header = int.from_bytes(cfg[off:off + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(cfg[off + 6:off + 8], "little")
        off = (header >> 20) & 0xFFC
    return None


def acs_redirects(ctl: int) -> list[str]:
    return [name for bit, name in ACS_REDIRECT_BITS.items() if ctl & (1 << bit)]


def driver_registry_dwords(inp: DoctorInput) -> str | None:
    """The nvidia module's RegistryDwords (None: the params file is not readable here)."""
    text = _read(_proc(inp) / "driver" / "nvidia" / "params")
    if text is None:
        return None
    m = re.search(r"^RegistryDwords:\s*\"?([^\"\n]*)\"?\s*$", text, re.M)
    return m.group(1).strip() if m else ""


def force_p2p_set(dwords: str) -> bool:
    keys = {kv.split("=", 1)[0].strip() for kv in dwords.split(";") if "=" in kv}
    return "ForceP2P" in keys or "RMForceP2PType" in keys


# ----------------------------------------------------------------------------- checks


def check_access(inp: DoctorInput) -> Check:
    gs = groups(inp)
    if not gs:
        return skip("p2p-access", "no worker has more than one GPU")
    bad, checked = [], 0
    for mode in ("w", "r"):
        m, why = _matrix(inp, "-p2p", mode)
        if not m:
            return skip("p2p-access", f"cannot read peer access: {why}")
        for name, gpus in gs:
            for a, b in _pairs(gpus):
                cell = _cell(m, a, b)
                checked += 1
                if cell != "OK":
                    bad.append(f"{name} GPU{a}->GPU{b} {'write' if mode == 'w' else 'read'} {cell or '?'}")
    desc = ", ".join(f"{n} (GPUs {','.join(map(str, g))})" for n, g in gs)
    if bad:
        return warn("p2p-access", f"no P2P for {len(bad)} of {checked} in-group GPU pairs: "
                                  + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else ""), P2P_FIX)
    return ok("p2p-access", f"P2P read and write OK within {desc}")


def check_acs(inp: DoctorInput) -> Check:
    gs = groups(inp)
    if not gs:
        return skip("p2p-acs", "no worker has more than one GPU")
    sysfs, topo = _sysfs(inp), inp.topology
    redirecting, unread, bridges = [], [], set()
    for _, gpus in gs:
        for g in gpus:
            gpu = topo.gpu(g)
            chain = bridges_above(sysfs, gpu.bus_id) if gpu and gpu.bus_id else None
            if chain is None:
                return skip("p2p-acs", f"the PCI path of GPU{g} is not known here ({sysfs}/bus/pci/devices/"
                                       f"{gpu.bus_id if gpu else '?'} is not a link into {sysfs}/devices)")
            bridges.update(chain)
    for br in sorted(bridges):
        ctl = acs_control(inp, br)
        if ctl is None:
            unread.append(br)
        elif acs_redirects(ctl):
            redirecting.append(f"{br} ({'+ '.join(acs_redirects(ctl))}+)")
    if redirecting:
        return warn("p2p-acs", f"ACS redirects peer traffic on {len(redirecting)} bridge(s) above the GPUs: "
                               + ", ".join(redirecting), ACS_FIX)
    if unread and len(unread) == len(bridges):
        return skip("p2p-acs", f"cannot read ACS of the {len(bridges)} bridge(s) above the GPUs (their extended "
                               "config space needs root): run `sudo v4flash-pd doctor --only p2p`, or "
                               "`sudo lspci -vvv | grep -i acsctl`")
    note = f"; not readable: {', '.join(unread)}" if unread else ""
    return ok("p2p-acs", f"no ACS redirect on the {len(bridges) - len(unread)} bridge(s) read above the GPUs{note}")


def check_iommu(inp: DoctorInput) -> Check:
    gs = groups(inp)
    if not gs:
        return skip("p2p-iommu", "no worker has more than one GPU")
    sysfs = _sysfs(inp)
    units_dir = sysfs / "class" / "iommu"
    units = sorted(p.name for p in units_dir.iterdir()) if units_dir.is_dir() else []
    if not units:
        return ok("p2p-iommu", f"IOMMU off (no units in {units_dir})")
    types: dict[str, list[int]] = {}
    for _, gpus in gs:
        for g in gpus:
            gpu = inp.topology.gpu(g)
            t = _read(sysfs / "bus" / "pci" / "devices" / gpu.bus_id / "iommu_group" / "type") if gpu else None
            types.setdefault((t or "?").strip(), []).append(g)
    translated = {t: g for t, g in types.items() if t.startswith("DMA")}
    if translated:
        what = "; ".join(f"GPUs {','.join(map(str, g))}: {t}" for t, g in sorted(translated.items()))
        return warn("p2p-iommu", f"the IOMMU ({', '.join(units)}) translates the GPUs' DMA ({what}): peer "
                                 "writes are slowed or blocked (NCCL hangs on Blackwell PCIe boxes)", IOMMU_FIX)
    if set(types) == {"identity"}:
        return ok("p2p-iommu", f"IOMMU on ({', '.join(units)}), GPUs in pass-through (group type identity)")
    cmdline = _read(_proc(inp) / "cmdline") or ""
    flags = cmdline.split()
    if "iommu=pt" in flags or any(f in flags for f in ("intel_iommu=off", "amd_iommu=off")):
        return ok("p2p-iommu", f"IOMMU units {', '.join(units)}; kernel command line has "
                               f"{' '.join(f for f in flags if 'iommu' in f)}")
    return warn("p2p-iommu", f"IOMMU on ({', '.join(units)}) and its mode for the GPUs is unknown "
                             f"(group types {sorted(types)}; no iommu=pt on the command line)", IOMMU_FIX)


def _lowest_common_bridge(chains: list[list[str]]) -> str | None:
    common = []
    for level in zip(*chains):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return common[-1] if common else None


def check_switch(inp: DoctorInput) -> Check:
    gs = groups(inp)
    if not gs:
        return skip("p2p-switch", "no worker has more than one GPU")
    m, why = _matrix(inp, "-m")
    no_switch: list[str] = []
    if m:
        for name, gpus in gs:
            links = {(a, b): _cell(m, a, b) for a, b in _pairs(gpus) if a < b}
            via_host = [f"GPU{a}-GPU{b} {c}" for (a, b), c in links.items()
                        if c is None or not (c in SWITCH_LINKS or c.startswith("NV"))]
            if via_host:
                no_switch.append(f"{name}: " + ", ".join(via_host))
        source = "`nvidia-smi topo -m`"
    else:
        sysfs = _sysfs(inp)
        for name, gpus in gs:
            chains = []
            for g in gpus:
                gpu = inp.topology.gpu(g)
                chain = bridges_above(sysfs, gpu.bus_id) if gpu and gpu.bus_id else None
                if chain is None:
                    return skip("p2p-switch", f"no topology matrix ({why}) and the PCI path of GPU{g} is unknown")
                chains.append(chain)
            # under one switch the deepest shared bridge is a switch port, below the root port
            lcb = _lowest_common_bridge(chains)
            if lcb is None or chains[0].index(lcb) == 0:
                no_switch.append(f"{name}: GPUs {','.join(map(str, gpus))} meet at "
                                 f"{'the root complex' if lcb is None else 'root port ' + lcb}")
        source = "sysfs PCI paths"
    if not no_switch:
        return ok("p2p-switch", f"each group's GPUs share a PCIe switch or NVLink ({source})")
    dwords = driver_registry_dwords(inp)
    where = "; ".join(no_switch)
    if dwords is not None and force_p2p_set(dwords):
        return ok("p2p-switch", f"no PCIe switch between {where} ({source}); the driver forces P2P "
                                f"(RegistryDwords {dwords})")
    known = ("RegistryDwords is empty" if dwords == "" else f"RegistryDwords {dwords}" if dwords
             else "cannot read /proc/driver/nvidia/params")
    return warn("p2p-switch", f"no PCIe switch between {where} ({source}) and the driver's ForceP2P options are "
                              f"not set ({known}): peer copies are staged through host memory (~15x slower)",
                FORCE_P2P_FIX)


def run(inp: DoctorInput) -> list[Check]:
    return [check_access(inp), check_acs(inp), check_iommu(inp), check_switch(inp)]
