"""The report's tarball is written safely (issue 29): a symlinked --out packs the real files, a planted
temporary-file link is never written through, an older tarball is never replaced without --force, links
and special files inside the report never carry anything outside it into the archive, and a full disk
(a real tmpfs) or a write the OS refuses (a real file-size limit) ends in one `error:` + `fix:`."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import fakebox
import pytest

from v4flash_pd.report.archive import pack

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture()
def box(tmp_path: Path) -> dict:
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs")})
    cfg = fakebox.write_pd_config(tmp_path, fakebox.free_ports(7))
    return {"tmp": tmp_path, "env": env, "cfg": cfg, "topology": fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)}


def argv(box: dict, out: str | Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "v4flash_pd", "report", "--rehearse", "--config", str(box["cfg"]), "--topology",
            str(box["topology"]), "--skip", "selfcheck,step,e2e", "--out", str(out), *extra]


def report(box: dict, out: str | Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv(box, out, *extra), capture_output=True, text=True, env=kw.pop("env", box["env"]),
                          cwd=box["tmp"], timeout=150, **kw)


def members(tar: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(tar) as t:
        return {m.name: m for m in t.getmembers()}


def clean_paragraph(res: subprocess.CompletedProcess) -> None:
    assert res.stderr.startswith("error: ") and "\n  fix: " in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "please send us" not in res.stdout + res.stderr


def test_a_symlinked_out_packs_the_real_files(box):
    real = box["tmp"] / "real"
    real.mkdir()
    (box["tmp"] / "rep").symlink_to(real)
    res = report(box, "rep")
    assert res.returncode == 0, res.stderr[-2000:]
    tar = box["tmp"] / "real.tar.gz"
    got = members(tar)
    assert "real/report.json" in got and "real/fingerprint/facts.json" in got
    assert all(m.isfile() or m.isdir() for m in got.values()), [m.name for m in got.values() if m.issym()]
    assert f"report written: {tar}" in res.stdout


def test_a_planted_temporary_link_is_never_written_through(box):
    victim = box["tmp"] / "victim.txt"
    victim.write_text("precious\n")
    (box["tmp"] / ".rep.tar.gz.tmp").symlink_to(victim)
    res = report(box, "rep")
    assert res.returncode == 0, res.stderr[-2000:]
    assert victim.read_text() == "precious\n"
    tar = box["tmp"] / "rep.tar.gz"
    assert not tar.is_symlink() and tar.is_file() and "rep/report.json" in members(tar)
    assert (box["tmp"] / ".rep.tar.gz.tmp").is_symlink()  # left as it was
    assert not [p for p in box["tmp"].iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


@pytest.mark.parametrize("old", ["file", "link"])
def test_an_older_tarball_is_not_replaced_without_force(box, old):
    tar = box["tmp"] / "rep.tar.gz"
    keep = box["tmp"] / "keep.tar.gz"
    keep.write_bytes(b"the older report\n")
    if old == "file":
        tar.write_bytes(b"the older report\n")
    else:
        tar.symlink_to(keep)
    res = report(box, "rep")
    assert res.returncode == 2, res.stdout + res.stderr
    clean_paragraph(res)
    assert "already exists" in res.stderr and "--force" in res.stderr
    assert not (box["tmp"] / "rep").exists(), "refused before anything ran"
    assert keep.read_bytes() == b"the older report\n"
    res = report(box, "rep", "--force")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not tar.is_symlink() and "rep/report.json" in members(tar)
    assert keep.read_bytes() == b"the older report\n", "a link at the name is replaced, not written through"


def test_links_and_special_files_inside_the_report_bring_nothing_from_outside(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the report's\n")
    d = tmp_path / "rep"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "a.log").write_text("inside\n")
    (d / "to-inside").symlink_to("sub/a.log")
    (d / "to-outside").symlink_to(outside)
    (d / "dangling").symlink_to(tmp_path / "nothing")
    (d / "dirlink").symlink_to(tmp_path)
    os.mkfifo(d / "fifo")
    packed = pack(d)
    got = members(packed.path)
    assert got["rep/to-inside"].isfile() and got["rep/sub/a.log"].isfile()
    with tarfile.open(packed.path) as t:
        assert t.extractfile("rep/to-inside").read() == b"inside\n"
    assert not {"rep/to-outside", "rep/dangling", "rep/dirlink", "rep/fifo"} & set(got)
    assert sorted(x.split(" ")[0] for x in packed.left_out) == ["dangling", "dirlink", "fifo", "to-outside"]
    assert all(m.isfile() or m.isdir() for m in got.values())


def _noisy_smi(tmp: Path) -> Path:
    """An nvidia-smi whose `-q` and `topo` answers to the report's facts are 256 KiB of random text each (that
    gzip cannot shrink much): four of them go into the report, so its tarball is larger than any single
    file of it. `doctor` (which quotes what it reads) gets a refusal."""
    path = tmp / "bin" / "nvidia-smi"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport base64, os, sys\n"
                    "parent = open(f'/proc/{os.getppid()}/cmdline', 'rb').read()\n"
                    "if sys.argv[1:2] not in (['-q'], ['topo']) or b'doctor' in parent:\n    sys.exit('unsupported')\n"
                    "sys.stdout.write(base64.b64encode(os.urandom(196608)).decode() + '\\n')\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("size, where", [("1536k", "the report's tarball"), ("256k", "the report in")])
def test_a_full_disk_is_one_clean_error(box, size, where):
    """A real tmpfs in a private mount namespace: 1.5 MiB holds the directory but not its tarball;
    256 KiB fills up while the box's facts are written."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no unprivileged mount namespace here (unshare -rm) to mount a small tmpfs in")
    env = dict(box["env"], V4FLASH_NVIDIA_SMI=str(_noisy_smi(box["tmp"])))
    mnt = box["tmp"] / "small"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size={size} tmpfs {mnt} || exit 99; "
              f"\"$@\"; rc=$?; echo; echo LEFT: $(ls -A {mnt}); exit $rc")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv(box, mnt / "rep")], capture_output=True,
                         text=True, env=env, cwd=box["tmp"], timeout=150)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    clean_paragraph(res)
    assert f"error: cannot write {where}" in res.stderr, res.stderr
    assert "No space left on device" in res.stderr and "free space" in res.stderr
    assert res.stdout.rstrip().splitlines()[-1] == "LEFT: rep", "no tarball and no temporary file left behind"


def test_a_write_the_os_refuses_while_packing_is_one_clean_error(box):
    """A real file-size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    env = dict(box["env"], V4FLASH_NVIDIA_SMI=str(_noisy_smi(box["tmp"])))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (400 * 1024, resource.RLIM_INFINITY))

    res = report(box, "rep", env=env, preexec_fn=limit)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    clean_paragraph(res)
    assert "cannot write the report's tarball" in res.stderr and "File too large" in res.stderr
    assert (box["tmp"] / "rep" / "report.json").is_file()
    assert sorted(p.name for p in box["tmp"].iterdir() if "rep" in p.name) == ["rep"]
