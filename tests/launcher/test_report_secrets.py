"""No secret, in any spelling or length, in a report directory or its tarball (issue 29).

The repro of the issue: a rehearsal report with an `[env]` HF token holding a quote, an AWS secret
given by `--set` with an escaped quote, short secrets under names the old scrubber did not know
(OPENAI_APIKEY, GITHUB_PAT, a lower-case db_password) and a router key with quotes. Every secret's
distinctive core is searched for as raw bytes in every file, so a spelling the scrubber missed
(shell-quoted, TOML- or JSON-escaped, a repr) shows up as the core it still contains. Then the
refusal: a report whose tarball would still hold a secret is not called complete."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import fakebox
import pytest

from v4flash_pd.report.redact import REDACTED, Redactor, collect, secret_name, spellings
from v4flash_pd.report.scrub import scan_tarball, scan_tree, scrub_tree

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl not installed (CI installs it)")]

# (name, value, the core a leak of any spelling still contains)
HF = ("HF_TOKEN", "hf'PRIV8", b"PRIV8")
AWS = ("AWS_SECRET_ACCESS_KEY", 'aws"PRIV9', b"PRIV9")
SHORT = [("OPENAI_APIKEY", "Qz7", b"Qz7"), ("GITHUB_PAT", "Wv3", b"Wv3"), ("db_password", "pw\\Jk5", b"Jk5")]
ROUTER_KEY = "rk'\"K3yX\\v"
ROUTER_CORE = b"K3yX"
CORES = [HF[2], AWS[2], ROUTER_CORE, *(c for _, _, c in SHORT)]


def _toml(s: str) -> str:
    return json.dumps(s)  # a TOML basic string escapes `"` and `\` as JSON does


@pytest.fixture()
def box(tmp_path: Path) -> dict:
    ports = fakebox.free_ports(7)
    cfg = fakebox.write_pd_config(tmp_path, ports)
    key = tmp_path / "router.key"
    key.write_text(ROUTER_KEY + "\n")
    key.chmod(0o600)
    env_table = "".join(f"{n} = {_toml(v)}\n" for n, v, _ in [HF, *SHORT])
    cfg.write_text(cfg.read_text() + f'api_key_file = "{key}"\n\n[env]\n{env_table}')
    env = fakebox.clean_env()
    env.update({"V4FLASH_RUNS_ROOT": str(tmp_path / "runs"), "V4FLASH_REHEARSAL_LOAD_SECONDS": "0.2",
                "V4FLASH_GRACE": "5"})
    return {"tmp": tmp_path, "env": env, "cfg": cfg, "topology": fakebox.write_topology(tmp_path, fakebox.BOX_8GPU_2NODE)}


def report(box: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "v4flash_pd", "report", "--rehearse", "--config", str(box["cfg"]),
                           "--topology", str(box["topology"]), "--variants", "on", "--concurrency", "1",
                           "--requests", "2", "--output-len", "4", "--eval-questions", "2", "--skip", "step",
                           "--set", f"decode.0.env.{AWS[0]}={_toml(AWS[1])}", *args],
                          capture_output=True, text=True, env=box["env"], cwd=box["tmp"], timeout=280)


def _leaks(files: dict[str, bytes]) -> list[tuple[str, bytes]]:
    return [(name, core) for name, data in files.items() for core in CORES if core in data]


def test_no_secret_in_any_spelling_reaches_the_report_or_its_tarball(box):
    res = report(box, "--out", "rep")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = box["tmp"] / "rep"
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with tarfile.open(box["tmp"] / "rep.tar.gz") as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    assert {f"rep/{k}" for k in files} == set(members)
    assert not _leaks(files) and not _leaks(members), _leaks(files) + _leaks(members)
    assert not any(c in (res.stdout + res.stderr).encode() for c in CORES)
    # the files that held one say where the scrub worked (the shell-quoted env of the .command files,
    # the TOML-escaped --set word of up.log), and the variant's trio really ran those secrets
    rep = json.loads((out / "report.json").read_text())
    assert "e2e/on/up.log" in rep["scrubbed"] and any(f.endswith(".command") for f in rep["scrubbed"])
    assert rep["e2e"][0]["status"] == "ok"
    command = (out / "e2e" / "on" / "run" / "decode-0.command").read_text()
    for name, _, _ in [HF, AWS, *SHORT]:
        assert f"{name}={REDACTED}" in command or f"{name}='{REDACTED}'" in command, name
    assert "please send us this file" in res.stdout


def test_a_report_whose_tarball_would_hold_a_secret_is_refused(box):
    """The directory's own name carries a secret (it becomes every member's path): the last scan of the
    archive finds it, deletes the tarball and says so; no `please send us`."""
    res = report(box, "--out", "rep-PRIV8", "--set", "env.HF_TOKEN=PRIV8", "--skip", "step,e2e")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.startswith("error: a secret is still in the report") and "\n  fix: " in res.stderr
    assert "do not send" in res.stderr and "Traceback" not in res.stderr
    assert "please send us" not in res.stdout + res.stderr
    assert not (box["tmp"] / "rep-PRIV8.tar.gz").exists()


@pytest.mark.parametrize("secret", ["hf'PRIV8", 'aws"PRIV9', "b\\s\\l", "t\tab", "üñí©ødé", "a b$c`d", "Qz7"])
def test_every_spelling_we_write_is_found_and_replaced(secret, tmp_path):
    writers = {
        "raw": secret, "shlex": shlex.quote(secret), "shlex-in-word": shlex.quote(f"X={secret}"),
        "shlex-join": shlex.join(["--set", f"env.X={json.dumps(secret)}"]),
        "json": json.dumps({"v": secret}), "json-utf8": json.dumps([secret], ensure_ascii=False),
        "toml": f"X = {_toml(secret)}", "repr": repr({"v": secret}), "repr-bytes": repr(secret.encode()),
        "repr-of-json": repr(json.dumps(secret)),
    }
    r = Redactor([secret])
    for how, text in writers.items():
        (tmp_path / how).write_text(f"before {text} after\n")
    changed = scrub_tree(tmp_path, r)
    assert sorted(changed) == sorted(writers)
    for how in writers:
        data = (tmp_path / how).read_bytes()
        assert REDACTED.encode() in data and not r.find(data), how
    assert scan_tree(tmp_path, r) == []
    assert secret in spellings(secret)


def test_short_secrets_are_found_alone_not_inside_other_words():
    r = Redactor(["Qz7"])
    assert r.redact(b"k=Qz7 'Qz7' \"Qz7\",Qz7\n") == (b"k=<redacted> '<redacted>' \"<redacted>\",<redacted>\n", 4)
    assert r.redact(b"aQz7b 0xQz7 Qz7a") == (b"aQz7b 0xQz7 Qz7a", 0)


def test_secret_names_by_pattern_any_case_and_values_of_any_length():
    for name in ("HF_TOKEN", "hf_token", "OPENAI_APIKEY", "OPENAI_API_KEY", "GITHUB_PAT", "AWS_SECRET_ACCESS_KEY",
                 "AWS_ACCESS_KEY_ID", "db_password", "DB_PASSWD", "MY_CREDENTIALS", "X_AUTH", "apiKey", "authToken",
                 "GOOGLE_APPLICATION_CREDENTIALS", "SESSION_COOKIE", "PRIVATE_PEM", "KEY"):
        assert secret_name(name), name
    for name in ("TOKENIZERS_PARALLELISM", "max_tokens", "tokenizer_path", "api_key_file", "api_key_env",
                 "HF_TOKEN_PATH", "UCX_TLS", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES", "PWD", "KEYBOARD"):
        assert not secret_name(name), name
    # any length counts; only values that cannot be secrets (flags) are left to the by-name redaction
    assert collect([("GITHUB_PAT", "x9"), ("HF_TOKEN", "1"), ("UCX_TLS", "tcp"), ("OPENAI_APIKEY", "false")],
                   ["k"]) == ("x9", "k")


def test_the_archive_scan_refuses_links_and_secrets(tmp_path):
    d = tmp_path / "rep"
    d.mkdir()
    (d / "a.txt").write_text("clean\n")
    (d / "link").symlink_to("/etc/hostname")
    with tarfile.open(tmp_path / "t.tar.gz", "w:gz") as tar:
        tar.add(d, arcname="rep")
    assert scan_tarball(tmp_path / "t.tar.gz", Redactor(["PRIV8"])) == ["rep/link (a link)"]
    (d / "b.log").write_text("token PRIV8\n")
    (d / "link").unlink()
    with tarfile.open(tmp_path / "u.tar.gz", "w:gz") as tar:
        tar.add(d, arcname="rep")
    assert scan_tarball(tmp_path / "u.tar.gz", Redactor(["PRIV8"])) == ["rep/b.log"]
