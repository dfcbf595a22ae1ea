"""`status` reads files anyone who can write the run dir can forge: `selfcheck.json`, `plan.json`,
`state.json`, the per-worker `patch/*.json` and the `.pid` files. Whatever they hold (the right schema
with the wrong types, a FIFO, a huge or deeply nested file, escape sequences), `status` and
`status --json` finish promptly with a clean line about the bad file, never a traceback, and no
control character from a file reaches the terminal."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from v4flash_pd.selfcheck.result import SCHEMA

Cli = Callable[..., subprocess.CompletedProcess]
ESC = "\x1b"
EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b31m"  # set the window title, clear the screen, a C1 CSI


def good_selfcheck() -> dict:
    return {"schema": SCHEMA, "standin": True, "interpreter": False, "seconds": 1.5, "requested": ["moe"],
            "decision": "switched_off", "switched_off": ["moe"], "gpus": [{"gpu": 0}],
            "patches": {"moe": {"status": "fail", "gpus": {"0": "fail"}, "failed_gpus": [0], "class": "wrong_result",
                                "where": "GPU 0 (decode-0)", "error": "rel err 1", "cases": 2, "upstream": "x"}}}


def with_patch(**fields: object) -> dict:
    doc = good_selfcheck()
    doc["patches"]["moe"].update(fields)
    return doc


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def huge(path: Path) -> None:
    with open(path, "wb") as f:  # sparse: costs no disk
        f.truncate(1 << 30)


def text(doc: object) -> Callable[[Path], None]:
    return lambda p: p.write_text(doc if isinstance(doc, str) else json.dumps(doc))


# (id, file in the run dir, how to forge it, a word the clean line about it says)
CASES: list[tuple[str, str, Callable[[Path], None], str]] = [
    ("selfcheck-patch-not-a-table", "selfcheck.json", text({**good_selfcheck(), "patches": {"moe": "x"}}),
     "patches.moe is a string"),
    ("selfcheck-failed-gpus-a-string", "selfcheck.json", text(with_patch(failed_gpus="5")), "failed_gpus"),
    ("selfcheck-gpus-a-list", "selfcheck.json", text(with_patch(gpus=[0])), "gpus"),
    ("selfcheck-status-a-number", "selfcheck.json", text(with_patch(status=3)), "patches.moe.status"),
    ("selfcheck-seconds-a-string", "selfcheck.json", text({**good_selfcheck(), "seconds": "slow"}), "seconds"),
    ("selfcheck-requested-a-number", "selfcheck.json", text({**good_selfcheck(), "requested": 3}), "requested"),
    ("selfcheck-switched-off-a-number", "selfcheck.json", text({**good_selfcheck(), "switched_off": 5}),
     "switched_off"),
    ("selfcheck-fifo", "selfcheck.json", fifo, "not a regular file"),
    ("selfcheck-huge", "selfcheck.json", huge, "too large"),
    ("selfcheck-deeply-nested", "selfcheck.json", text('{"schema": ' + "[" * 100000 + "]" * 100000 + "}"),
     "nested"),
    ("selfcheck-not-utf8", "selfcheck.json", lambda p: p.write_bytes(b'{"schema": "\xff"}'), "selfcheck.json"),
    ("plan-fifo", "plan.json", fifo, "not a regular file"),
    ("plan-processes-a-string", "plan.json", text({"processes": "prefill-0"}), "processes"),
    ("plan-a-list", "plan.json", text([1, 2]), "plan.json"),
    ("plan-process-without-a-name", "plan.json", text({"processes": [{"role": "prefill"}]}), "processes"),
    ("patch-record-fifo", "patch/patch-123.json", fifo, "not a regular file"),
    ("pid-file-fifo", "prefill-0.pid", fifo, "stopped"),
    ("state-launcher-pid-a-string", "state.json", text({"status": "stopped", "launcher_pid": "abc"}), "stopped"),
    ("state-status-a-table", "state.json", text({"status": {"x": 1}}), "'x'"),
]


def stopped_run(tmp: Path) -> Path:
    run = tmp / "run"
    (run / "patch").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"status": "stopped", "url": "http://127.0.0.1:1"}))
    (run / "plan.json").write_text(json.dumps({"processes": []}))
    return run


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("name, file, forge, word", CASES, ids=[c[0] for c in CASES])
def test_status_survives_a_forged_run_dir_file(name: str, file: str, forge: Callable[[Path], None], word: str,
                                               as_json: bool, cli: Cli, tmp_path: Path) -> None:
    run = stopped_run(tmp_path)
    forge(run / file)
    res = cli("status", "--run-dir", str(run), *(["--json"] if as_json else []), timeout=20)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, (res.stdout, res.stderr)
    if as_json:
        info = json.loads(res.stdout)
        assert info["run_dir"] == str(run)
    assert word in res.stdout, res.stdout


def test_escape_sequences_from_a_forged_run_dir_never_reach_the_terminal(cli: Cli, tmp_path: Path) -> None:
    run = stopped_run(tmp_path)
    (run / "state.json").write_text(json.dumps({"status": "stopped" + EVIL, "reason": EVIL, "url": EVIL}))
    (run / "plan.json").write_text(json.dumps({"processes": [
        {"name": "prefill-0" + EVIL, "role": "prefill", "health_url": "http://127.0.0.1:1/health", "gpus": [0],
         "binding": "-"}]}))
    doc = good_selfcheck()
    doc["patches"] = {"moe" + EVIL: {**doc["patches"]["moe"], "class": EVIL, "where": EVIL, "error": EVIL}}
    doc["switched_off"] = ["moe" + EVIL]
    (run / "selfcheck.json").write_text(json.dumps(doc))
    (run / "patch" / "patch-123.json").write_text(json.dumps(
        {"pid": 123, "patches": {"moe" + EVIL: {"active": False, "reason": EVIL}}}))
    for as_json in (False, True):
        res = cli("status", "--run-dir", str(run), *(["--json"] if as_json else []), timeout=20)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        out = res.stdout + res.stderr
        assert not [c for c in out if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F], repr(out)
        assert "moe" in res.stdout and "pwned" in res.stdout  # shown, escaped
    assert "\\x1b]0;pwned\\x07" in cli("status", "--run-dir", str(run)).stdout
