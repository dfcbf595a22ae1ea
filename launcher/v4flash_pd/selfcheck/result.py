"""The run-level self-check result (`selfcheck.json`, schema `v4flash-pd.selfcheck/1`): merge, read, show.

One record per run: which patches were asked for, each GPU's merged record (from `driver`), and a
verdict per patch over all GPUs: `pass` (every GPU passed it), `fail` (some GPU failed it: the
first failure is named), `unchecked` (its registry entry has no self-check), plus what the launcher
did about it (`switched_off`, `decision`). `standin` marks a rehearsal (nothing ran on a GPU),
`interpreter` a CPU run under Triton's interpreter (real kernel code, small shapes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from v4flash_pd.table import format_table
from v4flash_pd.textfile import read_json_record

SCHEMA = "v4flash-pd.selfcheck/1"
GPU_SCHEMA = "v4flash.selfcheck.gpu/1"
FILE = "selfcheck.json"
PASS, FAIL, UNCHECKED = "pass", "fail", "unchecked"


def summarize(gpus: list[dict[str, Any]], requested: tuple[str, ...], seconds: float,
              started: float | None = None) -> dict[str, Any]:
    patches: dict[str, dict[str, Any]] = {}
    for name in requested:
        per = [(g, g["patches"].get(name)) for g in gpus]
        failed = [(g, e) for g, e in per if not isinstance(e, dict) or e.get("status") == FAIL]
        unchecked = bool(per) and all(isinstance(e, dict) and e.get("status") == UNCHECKED for _, e in per)
        verdict = FAIL if failed else UNCHECKED if unchecked else PASS
        entry: dict[str, Any] = {
            "status": verdict,
            "gpus": {str(g["gpu"]): (e or {}).get("status", "missing") for g, e in per},
            "failed_gpus": [g["gpu"] for g, _ in failed],
            "class": None, "error": None,
            "cases": max((len((e or {}).get("cases") or []) for _, e in per), default=0),
            "upstream": next(((e or {}).get("upstream") for _, e in per if (e or {}).get("upstream")), ""),
        }
        if failed:
            g, e = failed[0]
            e = e if isinstance(e, dict) else {"class": "harness_error", "error": "no result from this GPU"}
            entry.update(**{"class": e.get("class") or "harness_error"}, error=e.get("error") or "failed",
                         where=f"GPU {g['gpu']} ({g['worker']})")
        elif unchecked:
            entry["error"] = "its registry entry names no self-check module: nothing vouches for it on this GPU"
        patches[name] = entry
    return {
        "schema": SCHEMA,
        "standin": any(g.get("standin") for g in gpus),
        "interpreter": any(g.get("interpreter") for g in gpus),
        "started": started if started is not None else time.time() - seconds,
        "seconds": round(seconds, 3),
        "requested": list(requested),
        "patches": patches,
        "gpus": gpus,
        "switched_off": [],
        "decision": "",
    }


def failed(summary: dict[str, Any]) -> list[str]:
    return [n for n, p in summary.get("patches", {}).items() if p.get("status") == FAIL]


def passed(summary: dict[str, Any]) -> list[str]:
    return [n for n, p in summary.get("patches", {}).items() if p.get("status") == PASS]


def unchecked(summary: dict[str, Any]) -> list[str]:
    return [n for n, p in summary.get("patches", {}).items() if p.get("status") == UNCHECKED]


def mark(summary: dict[str, Any]) -> str:
    """'' for a real GPU run; what the numbers are otherwise (shown next to every verdict)."""
    if summary.get("standin"):
        return "[stand-in: rehearsal, no kernel ran]"
    if summary.get("interpreter"):
        return "[CPU interpreter, small shapes only]"
    return ""


def headline(summary: dict[str, Any]) -> str:
    n_gpu = len(summary.get("gpus") or [])
    bad = failed(summary)
    word = f"{len(bad)} FAILED ({', '.join(bad)})" if bad else "all passed"
    loose = unchecked(summary)
    if loose:
        word += f"; {', '.join(loose)} has no self-check" if len(loose) == 1 else \
            f"; {', '.join(loose)} have no self-check"
    tag = mark(summary)
    return (f"kernel self-check: {len(summary.get('requested') or [])} patch(es) on {n_gpu} GPU(s), {word} "
            f"in {summary.get('seconds', 0):.1f}s" + (f" {tag}" if tag else ""))


def gpu_ranges(gpus: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5'."""
    spans: list[list[int]] = []
    for g in sorted(gpus):
        if spans and spans[-1][1] == g - 1:
            spans[-1][1] = g
        else:
            spans.append([g, g])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) or "-"


def render(summary: dict[str, Any]) -> str:
    rows = []
    for name, p in summary.get("patches", {}).items():
        gpus = sorted(int(g) for g in p.get("gpus", {}))
        if p["status"] == FAIL:
            where = f"failed on {gpu_ranges(sorted(p.get('failed_gpus', [])))} of {gpu_ranges(gpus)}"
            detail = f"{p.get('class')} on {p.get('where')}: {p.get('error')}"
        else:
            where = gpu_ranges(gpus)
            detail = p.get("error") or f"{p.get('cases', 0)} case(s) per GPU; {p.get('upstream') or ''}".rstrip("; ")
        action = " -> OFF for this run" if name in summary.get("switched_off", []) else ""
        rows.append((name, ("FAILED" if p["status"] == FAIL else p["status"]) + action, where, detail))
    lines = [headline(summary)]
    lines += format_table(("patch", "result", "GPUs", "detail"), rows, indent="  ")
    return "\n".join(lines)


def warnings(summary: dict[str, Any], action: str, pending: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """One loud line per failing patch: which patch, which GPU(s), what went wrong, and `action`
    (a `pending` one, on by default only once verified, simply stays off)."""
    out = []
    for name in failed(summary):
        p = summary["patches"][name]
        then = ("it stays OFF for this run (on by default only once verified on this box)" if name in pending
                else action)
        out.append(f"WARNING kernel patch {name} FAILED its self-check on GPU {gpu_ranges(sorted(p['failed_gpus']))} "
                   f"({p.get('class')}; first: {p.get('where')}: {p.get('error')}); {then}")
    for name in unchecked(summary):
        out.append(f"WARNING kernel patch {name} has no self-check: it runs unverified on these GPUs")
    return out


def write(run_path: Path, summary: dict[str, Any]) -> Path:
    path = run_path / FILE
    tmp = run_path / f".{FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def clear(run_path: Path) -> None:
    """Remove a run dir's verdict (before `up` decides this run's: a reused run dir keeps none of the last)."""
    (run_path / FILE).unlink(missing_ok=True)


def load(path: Path) -> dict[str, Any]:
    """A selfcheck.json; ValueError (with what is wrong) for anything that is not one."""
    try:
        data = read_json_record(path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a v4flash-pd self-check result (schema {SCHEMA})")
    if not isinstance(data.get("patches"), dict) or not isinstance(data.get("gpus"), list):
        raise ValueError(f"{path} is incomplete (no patches/gpus)")
    wrong = shape_problem(data)
    if wrong:
        raise ValueError(f"{path} is not a v4flash-pd self-check result: {wrong}")
    return data


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def shape_problem(data: dict[str, Any]) -> str:
    """'' when every field the renderers use has its type; else the first field that does not (a file
    with the right schema and the wrong types is refused here, not by a traceback in `status`)."""
    want: list[tuple[str, Any, bool, str]] = [
        ("seconds", data.get("seconds", 0), _is(data.get("seconds", 0), (int, float)), "a number"),
        ("requested", data.get("requested", []), _is(data.get("requested", []), list), "a list"),
        ("decision", data.get("decision", ""), _is(data.get("decision", ""), str), "a string"),
    ]
    off = data.get("switched_off", [])
    want.append(("switched_off", off, _is(off, list) and all(_is(n, str) for n in off), "a list of patch names"))
    for name, p in data["patches"].items():
        key = f"patches.{name}"
        if not _is(p, dict):
            want.append((key, p, False, "a table"))
            continue
        gpus, failed_on = p.get("gpus", {}), p.get("failed_gpus", [])
        want += [
            (f"{key}.status", p.get("status"), _is(p.get("status"), str), "a string"),
            (f"{key}.gpus", gpus, _is(gpus, dict) and all(str(g).isdigit() for g in gpus), "a table by GPU number"),
            (f"{key}.failed_gpus", failed_on, _is(failed_on, list) and all(_is(g, int) for g in failed_on),
             "a list of GPU numbers"),
            (f"{key}.cases", p.get("cases", 0), _is(p.get("cases", 0), int), "a number"),
        ]
    for field, value, ok, kind in want:
        if not ok:
            return f"{field} is {_json_type(value)}, not {kind}"
    return ""


def brief(summary: dict[str, Any]) -> dict[str, Any]:
    """What `status --json` shows: the verdict per patch and what was done, without the per-case detail."""
    return {
        "headline": headline(summary), "standin": bool(summary.get("standin")),
        "interpreter": bool(summary.get("interpreter")), "decision": summary.get("decision", ""),
        "switched_off": list(summary.get("switched_off") or []),
        "patches": {n: {k: p.get(k) for k in ("status", "failed_gpus", "class", "where", "error")}
                    for n, p in summary.get("patches", {}).items()},
    }


def status_lines(summary: dict[str, Any]) -> list[str]:
    lines = [headline(summary)]
    off = summary.get("switched_off") or []
    for name in failed(summary):
        p = summary["patches"][name]
        done = "switched off for this run" if name in off else (
            "start refused (--strict-selfcheck)" if summary.get("decision") == "refused" else "not acted on")
        lines.append(f"  {name} FAILED on GPU {gpu_ranges(sorted(p.get('failed_gpus') or []))} "
                     f"({p.get('class')}; first: {p.get('where')}: {p.get('error')}) -> {done}")
    return lines
