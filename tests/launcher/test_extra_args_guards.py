"""A worker's extra_args against the guards, judged the way the pinned sglang's argparse reads them
(issue 29): a key (`--api-key`, any abbreviation, `--api-key=K`) is refused before anything starts,
and no abbreviation of a flag a guard watches gets past that guard.

The ground truth is the real parser of sglang 0.5.13.post1 (tests/sglang_env.py): for every word
near a guarded flag, what argparse reads it as; the launcher's check must refuse every word the
parser reads as a guarded flag under another spelling, and must not refuse one the parser reads as
some other option."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from v4flash_pd.config.extraargs import GUARDED, SHORTER, WORKER_KEY_FLAGS, check_worker_args
from v4flash_pd.errors import UserError

T8 = str(Path(__file__).parent / "fixtures" / "topology-8gpu-2node.json")
KEY = "K3y-v4lue-9"

READ = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
words = json.load(sys.stdin)
out = {"options": sorted(o for a in parser._actions for o in a.option_strings), "read": {}}
for w in words:
    try:
        r = parser._parse_optional(w)
    except SystemExit:  # argparse's "ambiguous option" error
        out["read"][w] = "ambiguous"
        continue
    if isinstance(r, list):  # Python >= 3.12 returns every match
        r = r[0] if len(r) == 1 else None
    out["read"][w] = list(r[0].option_strings) if r and r[0] is not None else None
print("RESULT " + json.dumps(out))
"""


def _parser_reads(sglang_python: Path, words: list[str]) -> dict:
    res = subprocess.run([str(sglang_python), "-W", "ignore", "-c", READ], input=json.dumps(words),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])


def _refused(word: str) -> str:
    try:
        check_worker_args((word, "8192"), "engine.extra_args", prefill_chunk=True)
    except UserError as exc:
        return exc.message
    return ""


def test_every_spelling_the_pinned_parser_reads_as_a_guarded_flag_is_refused_or_judged_by_name(sglang_python):
    # every option of the parser near a guarded flag, and every prefix of those down to `--x`
    names = _parser_reads(sglang_python, [])["options"]
    stems = [g for g in GUARDED if not g.endswith("-")] + [o for o in names if o.startswith("--speculative-")]
    near = {o for o in names for g in stems if o[:6] == g[:6]}
    words = sorted({w[:n] for w in (*stems, *near) for n in range(3, len(w) + 1)})
    words += [w + "=8192" for w in words]
    read = _parser_reads(sglang_python, words)["read"]

    def guarded(opts: list[str]) -> bool:
        return any(o in GUARDED or o.startswith("--speculative-") for o in opts)

    slipped, wrongly = [], []
    for w in words:
        opt, got = w.split("=", 1)[0], read[w]
        msg = _refused(w)
        if isinstance(got, list) and guarded(got):
            key = any(o in WORKER_KEY_FLAGS for o in got)
            # the `--speculative-*` guard judges any word of the family alike, abbreviated or not; every other
            # guard compares the full name, so a spelling other than the name must not reach it
            family = opt.startswith("--speculative-") and not any(o in GUARDED for o in got)
            if (key or (opt not in got and not family)) and not msg:
                slipped.append((w, got))
        elif isinstance(got, list) and msg:  # the parser reads it as an unguarded option: leave it alone
            wrongly.append((w, got, msg))
    assert not slipped, f"spellings the pinned parser reads as a guarded flag that pass the guard: {slipped[:10]}"
    assert not wrongly, f"words the pinned parser reads as another option, refused: {wrongly[:5]}"
    # the exceptions the guard makes (options that are themselves a prefix of a guarded flag) are the parser's
    shorter = sorted({o for o in names for g in GUARDED if g != o and g.startswith(o) and o not in GUARDED})
    assert list(SHORTER) == shorter


@pytest.mark.parametrize("where, words", [
    ("engine.extra_args", ["--api-key", KEY]),
    ("engine.extra_args", [f"--api-key={KEY}"]),
    ("engine.extra_args", ["--api-k", KEY]),
    ("engine.extra_args", ["--ap", KEY]),
    ("decode.0.extra_args", [f"--api-ke={KEY}"]),
    ("prefill.0.extra_args", ["--admin-api-key", KEY]),
])
def test_a_worker_key_in_extra_args_is_refused_pointing_to_the_router_key(cli, where, words):
    res = cli("plan", "--topology", T8, "--set", f"{where}={json.dumps(words)}")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and "\n  fix: " in res.stderr and "Traceback" not in res.stderr
    assert where in res.stderr and "router.api_key_file" in res.stderr and "router.api_key_env" in res.stderr
    assert KEY not in res.stdout + res.stderr


@pytest.mark.parametrize("args, words", [
    # abbreviations argparse expands to a flag the [speculative] table owns, with --mtp on and off
    (["--mtp", "2", "--set", 'engine.extra_args=["--speculative-num-s", "5"]'], ["--speculative-num-s",
                                                                                 "--speculative-num-steps"]),
    (["--set", 'engine.extra_args=["--speculative-al=EAGLE"]'], ["--speculative-al", "--speculative-algorithm"]),
    (["--set", 'engine.extra_args=["--specul", "x"]'], ["--specul", "--speculative-"]),
    # the prefill chunk guard: 65536 in an abbreviation would crash sm_120 prefill
    (["--set", 'prefill.0.extra_args=["--chunked-prefill", "65536"]'], ["--chunked-prefill",
                                                                        "--chunked-prefill-size"]),
    (["--mtp", "2", "--set", 'decode.0.extra_args=["--disaggregation-decode-enable-radix"]'],
     ["--disaggregation-decode-enable-radix-cache"]),
    (["--mtp", "2", "--set", 'engine.extra_args=["--pipeline-parallel", "2"]'], ["--pipeline-parallel-size"]),
    (["--mtp", "2", "--set", 'engine.extra_args=["--lora-path", "a"]'], ["--lora-paths"]),
])
def test_abbreviations_of_guarded_flags_are_refused(cli, args, words):
    res = cli("plan", "--topology", T8, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: ") and "\n  fix: " in res.stderr and "Traceback" not in res.stderr
    assert "abbreviation" in res.stderr and all(w in res.stderr for w in words), res.stderr


def test_full_flag_names_still_reach_their_guards_and_unguarded_flags_pass(cli):
    res = cli("plan", "--topology", T8, "--set", 'prefill.0.extra_args=["--chunked-prefill-size", "65536"]')
    assert res.returncode == 2 and "chunked_prefill_size = 65536" in res.stderr
    ok = cli("plan", "--json", "--topology", T8, "--set",
             'engine.extra_args=["--enable-lora-overlap-loading", "--max-running-requests", "64"]')
    assert ok.returncode == 0, ok.stderr
    worker = next(p for p in json.loads(ok.stdout)["processes"] if p["role"] == "decode")
    assert worker["argv"][-3:] == ["--enable-lora-overlap-loading", "--max-running-requests", "64"]


def test_an_abbreviated_pipeline_flag_is_refused_where_the_full_one_is_left_to_its_guard():
    with pytest.raises(UserError, match="abbreviation"):
        check_worker_args(("--pp-si", "2"), "engine.extra_args", prefill_chunk=False)
    check_worker_args(("--pp-size", "2"), "engine.extra_args", prefill_chunk=False)  # judged with --mtp by name
