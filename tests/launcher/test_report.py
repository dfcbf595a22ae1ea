"""`v4flash-pd report` on a rehearsal: the whole directory (facts, self-check, step bench, the
end-to-end A/B of every patch configuration with bench and eval through its own trio, README summary,
tarball) with every stand-in number marked as such and no secret anywhere; its bad inputs; and
the parsing of nvidia-smi's topology matrices."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import fakebox
import pytest

from v4flash_kernels.hook.patches import SWITCHES
from v4flash_pd.report.facts import p2p_summary
from v4flash_pd.report.redact import Redactor, redact_env, secret_name
from v4flash_pd.report.scrub import scrub_tree
from v4flash_pd.topology import parse_matrix

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl not installed (CI installs it)")]

ROUTER_KEY = "rk-7f3a9c1e5b2d4f60a8e1"
HF_TOKEN = "hf_QmZ8wX2vN4pL6tR9sK1j"
P2P = (" \tGPU0\tGPU1\tGPU2\tGPU3\t\n"
       " GPU0\tX\tOK\tOK\tNS\t\n GPU1\tOK\tX\tOK\tNS\t\n GPU2\tOK\tOK\tX\tOK\t\n GPU3\tNS\tNS\tOK\tX\t\n\n"
       "Legend:\n\n  X    = Self\n  OK   = Status Ok\n  NS   = Not supported\n")
TOPO_M = ("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
          "GPU0\t X \tSYS\t0-15,32-47\t0\t\tN/A\nGPU1\tSYS\t X \t16-31,48-63\t1\t\tN/A\n\nLegend:\n  X    = Self\n")


@pytest.fixture()
def box(tmp_path: Path) -> dict:
    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    (tmp_path / "router.key").write_text(ROUTER_KEY + "\n")
    (tmp_path / "router.key").chmod(0o600)
    cfg.write_text(cfg.read_text() + f'api_key_file = "{tmp_path / "router.key"}"\n\n[env]\nHF_TOKEN = "{HF_TOKEN}"\n')
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.2",
                "V4FLASH_GRACE": "5"})
    return {"tmp": tmp_path, "env": env, "cfg": cfg, "ports": ports,
            "topology": fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)}


def report(box: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = dict(box["env"], **extra)
    return subprocess.run([sys.executable, "-m", "v4flash_pd", "report", "--rehearse", "--config", str(box["cfg"]),
                           "--topology", str(box["topology"]), "--requests", "8", "--output-len", "8",
                           "--eval-questions", "4", *args], capture_output=True, text=True, env=env, cwd=box["tmp"],
                          timeout=280)


def _all_text(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_rehearsal_report_is_complete_marked_and_secret_free(box):
    res = report(box, "--out", "rep")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = box["tmp"] / "rep"
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema"] == "v4flash-pd.report/1" and rep["standin"] and not rep["failures"]
    # facts: the machine's, raw and parsed
    for name in ("fingerprint.json", "topology.json", "facts.json", "plan.json", "doctor.json",
                 "nvidia-smi-topo-m.txt", "nvidia-smi-topo-p2p-r.txt", "nvidia-smi-topo-p2p-w.txt", "numactl-H.txt"):
        assert (out / "fingerprint" / name).is_file(), name
    assert json.loads((out / "fingerprint" / "doctor.json").read_text())["schema"] == "v4flash-pd.doctor/1"
    assert rep["facts"]["numa"]["gpus"] == {str(i): 0 if i < 4 else 1 for i in range(8)}
    # self-check (stand-in) and the step bench (plan only) are there, marked
    sc = json.loads((out / "selfcheck.json").read_text())
    assert sc["standin"] and len(sc["gpus"]) == 8 and rep["selfcheck"]["standin"]
    assert rep["step"]["standin"] and "--dry-run" in rep["step"]["argv"] and (out / "step" / "step.log").is_file()
    # end to end: every configuration, its own trio, bench at 1/16/64 and the gate
    names = [s.name for s in SWITCHES if s.default_on]  # an off-by-default switch has no "off-" variant
    assert [v["name"] for v in rep["e2e"]] == ["on", *(f"off-{n}" for n in names), "off"]
    for v in rep["e2e"]:
        assert v["status"] == "ok" and v["standin"], v
        assert [lv["concurrency"] for lv in v["bench"]["levels"]] == [1, 16, 64]
        assert v["eval"]["passed"] and v["eval"]["standin"]
        run = out / v["run_dir"]
        plan = json.loads((run / "plan.json").read_text())
        assert dict(map(tuple, plan["patches"])) == v["switches"], "the variant's trio ran its own switches"
        assert json.loads((run / "state.json").read_text())["status"] == "stopped"
    assert rep["e2e"][2]["switches"] == {s.name: s.name != "moe" and s.default_on for s in SWITCHES}
    # README: summary table first, every stand-in number marked
    md = (out / "README.md").read_text()
    assert md.index("> **REHEARSAL.**") < md.index("## Summary") < md.index("## End to end")
    assert "| end to end, c=1, output tok/s | patches on " in md and "*(stand-in)*" in md
    # speculative decoding is on by default: the accept length the bench measured, per level
    accept = next(ln for ln in md.splitlines() if ln.startswith("| MTP accept length"))
    assert "c=1: " in accept and "c=64: " in accept and "*(stand-in)*" in accept
    e2e_rows = [ln for ln in md.splitlines() if ln.startswith("| on |") or ln.startswith("| off")]
    assert len(e2e_rows) == len(names) + 2 and all(ln.count("*(stand-in)*") >= 5 for ln in e2e_rows)
    # the tarball has the same files, and nothing anywhere holds a secret
    tar = Path(rep["tarball"])
    assert tar == out.with_name("rep.tar.gz") and tar.is_file()
    with tarfile.open(tar) as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    files = _all_text(out)
    assert {f"rep/{k}" for k in files} == set(members)
    for name, data in list(files.items()) + list(members.items()):
        assert ROUTER_KEY.encode() not in data and HF_TOKEN.encode() not in data, name
    assert "<redacted>" in (out / "fingerprint" / "plan.json").read_text()
    assert "report written" in res.stdout and str(tar) in res.stdout


def test_a_failing_patch_is_off_in_every_variant_and_the_report_says_so(box):
    res = report(box, "--out", "rep", "--skip", "step", "--variants", "on,off-sparse_decode",
                 V4FLASH_SELFCHECK_INJECT="moe:wrong@6")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "error: the report is written" in res.stderr and "kernel self-check failed for moe" in res.stderr
    assert "fix: send us" in res.stderr
    rep = json.loads((box["tmp"] / "rep" / "report.json").read_text())
    assert [v["switches"]["moe"] for v in rep["e2e"]] == [False, False]
    assert rep["step"]["status"] == "skipped"
    assert "FAILED (moe)" in (box["tmp"] / "rep" / "README.md").read_text()


@pytest.mark.parametrize("args, words", [
    (["--skip", "nope"], "unknown section(s) nope"),
    (["--variants", "on,bogus"], "unknown variant(s) bogus"),
    (["--concurrency", "0"], "--concurrency"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--detach"], "--detach does not apply"),
    (["--strict-selfcheck"], "--strict-selfcheck does not apply"),
    (["--step-args", "--json x.json"], "--json is the report's to choose"),
    (["--step-args", "'unbalanced"], "--step-args"),
])
def test_bad_input(box, args, words):
    res = report(box, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and "fix: " in res.stderr and words in res.stderr
    assert "Traceback" not in res.stderr
    assert not list(box["tmp"].glob("v4flash-report-*")), "a refused report leaves no directory"


def test_an_existing_out_dir_or_busy_ports_are_refused(box):
    (box["tmp"] / "old").mkdir()
    (box["tmp"] / "old" / "x").write_text("x")
    res = report(box, "--out", "old")
    assert res.returncode == 2 and "already exists" in res.stderr and "fix: " in res.stderr
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", box["ports"][5]))
        s.listen()
        res = report(box, "--out", "new")
    assert res.returncode == 2 and "not available" in res.stderr and "fix: " in res.stderr
    assert not (box["tmp"] / "new").exists()


def test_p2p_and_topology_matrices_parse():
    m = parse_matrix(P2P)
    assert m["columns"] == ["GPU0", "GPU1", "GPU2", "GPU3"] and m["rows"]["GPU3"] == ["NS", "NS", "OK", "X"]
    assert p2p_summary(m) == "4 of 12 GPU pairs not OK (NS)"
    ok = P2P.replace("NS", "OK")
    assert p2p_summary(parse_matrix(ok)) == "all 12 GPU pairs OK"
    t = parse_matrix(TOPO_M)
    assert t["columns"][:2] == ["GPU0", "GPU1"] and t["rows"]["GPU1"][:2] == ["SYS", "X"]
    assert p2p_summary(parse_matrix("not available: nvidia-smi is not installed here\n")) == "unknown"


def test_secrets_are_found_by_name_and_value(tmp_path):
    assert secret_name("HF_TOKEN") and secret_name("OPENAI_API_KEY") and not secret_name("tokenizer_path")
    assert not secret_name("UCX_TLS") and not secret_name("HF_HUB_OFFLINE")
    data = {"env": [["HF_TOKEN", "abc123456"], ["UCX_TLS", "tcp"]], "tokenizer_path": "/m", "X": {"API_KEY": "zz"}}
    assert redact_env(data) == {"env": [["HF_TOKEN", "<redacted>"], ["UCX_TLS", "tcp"]], "tokenizer_path": "/m",
                                "X": {"API_KEY": "<redacted>"}}
    (tmp_path / "a.log").write_text(f"key={ROUTER_KEY}\n")
    (tmp_path / "b.log").write_text("clean\n")
    assert scrub_tree(tmp_path, Redactor([ROUTER_KEY])) == ["a.log"]
    assert (tmp_path / "a.log").read_text() == "key=<redacted>\n"


def test_help_states_the_trio_starts_a_default_report_makes(tmp_path):
    """`report --help` counts the configurations the code picks for the default plan (it said five where
    nine ran: issue 29)."""
    from v4flash_pd.report.variants import all_variants

    env = fakebox.clean_env()
    helptext = subprocess.run([sys.executable, "-m", "v4flash_pd", "report", "--help"], capture_output=True, text=True,
                              env=env, timeout=60)
    assert helptext.returncode == 0, helptext.stderr
    said = re.search(r"(\d+) by default \(([^)]*)\)", " ".join(helptext.stdout.split()).replace("- ", "-"))
    assert said, helptext.stdout
    plan = subprocess.run([sys.executable, "-m", "v4flash_pd", "plan", "--json", "--rehearse", "--topology",
                           str(fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE))], capture_output=True,
                          text=True, env=env, timeout=60)
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    picked = all_variants(tuple((n, on) for n, on in doc["patches"]), [], tuple(doc["pending_patches"]))
    assert int(said.group(1)) == len(picked) and said.group(2).split(", ") == [v.name for v in picked]
