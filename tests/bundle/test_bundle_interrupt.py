"""SIGINT in the middle of model hashing: no complete-looking bundle, and a rerun resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bundle_helpers import REPO, run_cli

FILES = 32
FILE_BYTES = 128 << 20  # 4 GiB in all, sparse: a few seconds of hashing, no disk space used


def _sparse_model(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    for i in range(FILES):
        with open(model / f"model-{i:05d}-of-{FILES:05d}.safetensors", "wb") as fh:
            fh.write(os.urandom(64))  # distinct content per shard
            fh.truncate(FILE_BYTES)
    return model


@pytest.mark.slow
def test_sigint_mid_hash_leaves_no_bundle_and_rerun_resumes(tmp_path: Path) -> None:
    model = _sparse_model(tmp_path)
    out = tmp_path / "bundle"
    partial = tmp_path / ".bundle.partial"
    state = partial / ".state" / "model-hashes.jsonl"
    args = ["bundle", "create", "--out", str(out), "--no-image", "--model", str(model), "--no-progress"]
    # SIG_DFL first: a suite started in the background by a non-interactive shell inherits SIGINT ignored,
    # and Python then never raises KeyboardInterrupt (create ran to the end, exit 0, under `nohup ... &`)
    proc = subprocess.Popen([sys.executable, "-m", "v4flash_pd", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if state.is_file() and len(state.read_text().splitlines()) >= 3:
            break
        assert proc.poll() is None, f"create ended before it could be interrupted: {proc.communicate()}"
        time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail("no model file finished hashing within 60 s")
    assert proc.poll() is None, "create finished before SIGINT: make the synthetic model bigger"
    proc.send_signal(signal.SIGINT)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr

    # Nothing that looks like a bundle: DIR absent; the partial dir has no SHA256SUMS/MANIFEST.json.
    assert not out.exists()
    assert partial.is_dir() and not (partial / "SHA256SUMS").exists() and not (partial / "MANIFEST.json").exists()
    done_before = len([json.loads(line) for line in state.read_text().splitlines() if line.strip()])
    assert 3 <= done_before < FILES
    ver = run_cli("bundle", "verify", str(out))
    assert ver.returncode == 2 and "was interrupted" in ver.stderr, ver.stderr
    ver = run_cli("bundle", "verify", str(partial))
    assert ver.returncode == 1 and "SHA256SUMS" in ver.stderr

    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    resumed = re.search(r"resuming: (\d+) file\(s\)", res.stderr)
    hashed = re.search(r"hashing (\d+) file\(s\)", res.stderr)
    assert resumed and hashed, res.stderr
    assert int(resumed.group(1)) >= done_before
    assert int(hashed.group(1)) == FILES - int(resumed.group(1)) < FILES
    assert out.is_dir() and not partial.exists()
    assert not (out / ".state").exists()
    ver = run_cli("bundle", "verify", str(out), "--model", str(model), "--full", "--no-progress")
    assert ver.returncode == 0, ver.stdout + ver.stderr
