"""Fixture boxes for the doctor's P2P checks: a PCI hierarchy in a fake sysfs, a fake /proc, an nvidia-smi
that also answers `topo -m` / `topo -p2p r|w`, and a `setpci`.

The same seams the other doctor fixtures use (`V4FLASH_SYSFS_ROOT`, `V4FLASH_NVIDIA_SMI`), plus
`V4FLASH_PROC_ROOT`. The sysfs tree is laid out like the kernel's: `bus/pci/devices/<bdf>` is a link
into `devices/pci<domain>:<bus>/<root port>/.../<bdf>`, bridges carry a `config` file whose extended
capability list (from 0x100) holds ACS, and GPUs link `iommu_group` to `kernel/iommu_groups/N`.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

GPUS = 8
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
ACS_RR_CR = 0x000C  # ReqRedir + CmpltRedir (+ SrcValid off)
ACS_OFF = 0x0000


@dataclass(frozen=True)
class P2PBox:
    """switch: GPUs 0-3 and 4-7 each behind one PCIe switch (else every GPU on its own root port).
    acs: the ACS Control value of every bridge (None: config space not readable, as for non-root).
    iommu: None (off) or the GPUs' iommu group type ("identity", "DMA-FQ", ...).
    p2p: the `topo -p2p` cell for in-socket pairs; dwords: the driver's RegistryDwords (None: no file)."""

    switch: bool = True
    acs: int | None = ACS_OFF
    iommu: str | None = None
    cmdline: str = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet"
    p2p: str = "OK"
    dwords: str | None = ""
    topo: bool = True  # nvidia-smi answers `topo`
    bad_pairs: tuple = field(default_factory=tuple)  # (a, b) pairs whose p2p cell is "NS"


def gpu_bdf(i: int) -> str:
    return f"0000:{0x17 + 0x20 * i:02x}:00.0"


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _config(acs: int | None) -> bytes:
    """4 KB config space: a non-ACS capability (AER, 0x0001) at 0x100 linking to ACS (0x000D) at 0x148."""
    if acs is None:
        return bytes(64)  # what a non-root reader gets
    cfg = bytearray(4096)
    cfg[0x100:0x104] = (0x0001 | (1 << 16) | (0x148 << 20)).to_bytes(4, "little")
    cfg[0x148:0x14C] = (0x000D | (1 << 16) | (0 << 20)).to_bytes(4, "little")
    cfg[0x14C:0x14E] = (0x005F).to_bytes(2, "little")  # capability register
    cfg[0x14E:0x150] = acs.to_bytes(2, "little")  # control register
    return bytes(cfg)


def _dev(sysfs: Path, chain: list[str], domain_bus: str) -> Path:
    d = sysfs / "devices" / f"pci{domain_bus}"
    for bdf in chain:
        d = d / bdf
    d.mkdir(parents=True, exist_ok=True)
    return d


def make_sysfs(root: Path, box: P2PBox) -> Path:
    """A sysfs with the 8-GPU box's PCI tree; returns the root for V4FLASH_SYSFS_ROOT."""
    sysfs = root / "sysfs"
    for n, cpus in ((0, "0-15,32-47"), (1, "16-31,48-63")):
        d = sysfs / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    (sysfs / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    bridges: dict[str, Path] = {}
    for i in range(GPUS):
        sock = i // 4
        domain_bus = f"0000:{0x00 if sock == 0 else 0x80:02x}"
        if box.switch:  # root port -> switch upstream -> switch downstream -> GPU
            rp = f"0000:{0x00 if sock == 0 else 0x80:02x}:01.0"
            up = f"0000:{0x10 + 0x80 * sock:02x}:00.0"
            down = f"0000:{0x11 + 0x80 * sock:02x}:{i % 4:02x}.0"
            chain = [rp, up, down]
        else:  # one root port per GPU
            chain = [f"0000:{0x00 if sock == 0 else 0x80:02x}:{1 + i % 4:02x}.0"]
        gdir = _dev(sysfs, chain + [gpu_bdf(i)], domain_bus)
        (gdir / "numa_node").write_text(f"{sock}\n")
        (gdir / "vendor").write_text("0x10de\n")
        for depth, b in enumerate(chain):
            bridges[b] = _dev(sysfs, chain[: depth + 1], domain_bus)
        link = sysfs / "bus" / "pci" / "devices" / gpu_bdf(i)
        os.symlink(os.path.relpath(gdir, link.parent), link)
        if box.iommu is not None:
            g = sysfs / "kernel" / "iommu_groups" / str(i)
            g.mkdir(parents=True, exist_ok=True)
            (g / "type").write_text(box.iommu + "\n")
            os.symlink(os.path.relpath(g, gdir), gdir / "iommu_group")
    for b, d in bridges.items():
        (d / "config").write_bytes(_config(box.acs))
        link = sysfs / "bus" / "pci" / "devices" / b
        if not link.exists():
            os.symlink(os.path.relpath(d, link.parent), link)
    if box.iommu is not None:
        (sysfs / "class" / "iommu" / "dmar0").mkdir(parents=True, exist_ok=True)
    return sysfs


def make_proc(root: Path, box: P2PBox) -> Path:
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "cmdline").write_text(box.cmdline + "\n")
    if box.dwords is not None:
        d = proc / "driver" / "nvidia"
        d.mkdir(parents=True, exist_ok=True)
        (d / "params").write_text(f'ResmanDebugLevel: 4294967295\nRegistryDwords: "{box.dwords}"\n'
                                  'EnablePCIeGen3: 0\n')
    return proc


def link_kind(box: P2PBox, a: int, b: int) -> str:
    if a == b:
        return "X"
    if a // 4 != b // 4:
        return "SYS"
    return "PIX" if box.switch else "NODE"


def _topo_m(box: P2PBox) -> str:
    head = "\t" + "\t".join(f"GPU{i}" for i in range(GPUS)) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    rows = "".join(f"GPU{a}\t" + "\t".join(f" {link_kind(box, a, b)} " if a == b else link_kind(box, a, b)
                                           for b in range(GPUS))
                   + f"\t{'0-15,32-47' if a < 4 else '16-31,48-63'}\t{a // 4}\t\tN/A\n" for a in range(GPUS))
    return head + rows + "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect\n"


def _topo_p2p(box: P2PBox) -> str:
    head = " \t" + "\t".join(f"GPU{i}" for i in range(GPUS)) + "\t\n"
    bad = {tuple(p) for p in box.bad_pairs} | {(b, a) for a, b in box.bad_pairs}
    rows = ""
    for a in range(GPUS):
        cells = []
        for b in range(GPUS):
            cells.append("X" if a == b else "NS" if (a, b) in bad else (box.p2p if a // 4 == b // 4 else "CNS"))
        rows += f" GPU{a}\t" + "\t".join(cells) + "\t\n"
    return head + rows + "\nLegend:\n\n  X    = Self\n  OK   = Status Ok\n  NS   = Not supported\n"


def make_nvidia_smi(d: Path, box: P2PBox) -> Path:
    """Answers --query-gpu, and (box.topo) `topo -m` / `topo -p2p r|w`; logs its argv as JSON lines."""
    rows = "\n".join(f"{i}, {RTX}, 0000{gpu_bdf(i).upper()}, 12.0, 97887, 580.95.05, GPU-{i:08d}"
                     for i in range(GPUS))
    answers = {"m": _topo_m(box), "r": _topo_p2p(box), "w": _topo_p2p(box)} if box.topo else {}
    log = d / "nvidia-smi.log"
    return _exe(d / "nvidia-smi", f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
answers = {answers!r}
if any(a.startswith("--query-gpu=") for a in args):
    print({rows!r}); sys.exit(0)
if args[:1] == ["topo"] and answers:
    key = args[1].lstrip("-") if args[1:2] == ["-m"] else (args[2] if len(args) > 2 else "")
    if key in answers:
        sys.stdout.write(answers[key]); sys.exit(0)
print("unsupported fake call", file=sys.stderr); sys.exit(2)
""")


def make_setpci(d: Path, value: int) -> Path:
    """A `setpci` that answers `-s BDF ECAP_ACS+6.w` with `value` (as root would) and logs its argv."""
    log = d / "setpci.log"
    return _exe(d / "setpci", f"""#!{sys.executable}
import json, sys
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if len(sys.argv) == 4 and sys.argv[1] == "-s" and sys.argv[3] == "ECAP_ACS+6.w":
    print("{value:04x}"); sys.exit(0)
sys.exit(1)
""")


def box_env(tmp: Path, box: P2PBox) -> dict[str, str]:
    """V4FLASH_SYSFS_ROOT / V4FLASH_PROC_ROOT / V4FLASH_NVIDIA_SMI for `box` (bin dir: tmp/bin)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    return {"V4FLASH_SYSFS_ROOT": str(make_sysfs(tmp, box)), "V4FLASH_PROC_ROOT": str(make_proc(tmp, box)),
            "V4FLASH_NVIDIA_SMI": str(make_nvidia_smi(bin_dir, box))}


def read_log(script: Path) -> list[list[str]]:
    log = script.parent / f"{script.name}.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
