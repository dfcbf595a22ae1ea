"""What one measurement is, and how measurements become per-path times (pure: no torch).

Kept apart from `runner` (which needs torch and a GPU) so a finished run's JSON can be re-rendered
anywhere (`python -m v4flash_bench.step --from-json`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Tuple

from v4flash_bench.step import model as M


@dataclass(frozen=True)
class Measurement:
    key: str
    impl: str  # "upstream" | "ours"
    name: str
    us: float  # per call; NaN when not measured
    calls_per_replay: int
    reps: int
    ok: bool
    rel_err: float
    detail: str
    source: str
    error: str | None = None  # why there is no time (no patch yet, mismatch, exception)
    kernels: float = float("nan")  # kernel nodes one call puts in a CUDA graph (NaN: not counted)


def impls_for(op: M.Op) -> List[str]:
    """Attention rows are per path already; MoE and indexer logits have an "ours" variant too."""
    variant = op.p.get("variant")
    if variant is not None:
        return ["upstream" if variant == "upstream" else "ours"]
    if op.patch is not None:
        return ["upstream", "ours"]
    return ["upstream"]


FAILED = "FAILED"  # the source of a line whose implementation failed its check (model.OpLine.failed)


def path_times(ops: Iterable[M.Op], meas: Dict[Tuple[str, str], Measurement]) -> Any:
    """(µs, source) keyed by (op key, path) for `model.compose`; NaN where nothing could be timed, and
    NaN with a FAILED source where the implementation failed: its time is not replaced by another's."""
    us: Dict[Tuple[str, str], float] = {}
    src: Dict[Tuple[str, str], str] = {}
    for op in ops:
        variant = op.p.get("variant")
        for path in ("upstream", "patched"):
            if variant is not None:
                impl = "upstream" if variant == "upstream" else "ours"
                m = meas.get((op.key, impl))
            else:
                m = meas.get((op.key, "upstream"))
                if path == "patched" and (op.key, "ours") in meas:
                    mine = meas[(op.key, "ours")]
                    if mine.error is None or not mine.ok:  # measured, or failed: never upstream's time instead
                        m = mine
                    else:  # no patch here (not a failure): the patched path runs upstream's
                        src[(op.key, path)] = f"{mine.error} -> upstream"
            if m is None:
                continue
            if not m.ok:  # a failed check or build: no time stands in for it, the step is incomplete
                us[(op.key, path)] = float("nan")
                src[(op.key, path)] = f"{FAILED}: {m.error}"
                continue
            if m.us != m.us and op.fallback is not None:  # not timed here: the op's labelled estimate
                us[(op.key, path)] = op.fallback[0]
                src[(op.key, path)] = f"{op.fallback[1]} ({m.error or 'not timed'})"
                continue
            us[(op.key, path)] = m.us
            src.setdefault((op.key, path), m.source if m.error is None else m.error)
    return us, src


def kernels_per_step(ops: Iterable[M.Op], path: str, meas: Dict[Tuple[str, str], Measurement]) -> float:
    """Kernels one step of `path` launches: calls per step x kernel nodes per call of the implementation
    the path runs (as `path_times` picks it); NaN when any op's count is missing."""
    total = 0.0
    for op in M.ops_for_path(ops, path):
        variant = op.p.get("variant")
        if variant is not None:
            m = meas.get((op.key, "upstream" if variant == "upstream" else "ours"))
        else:
            mine = meas.get((op.key, "ours"))
            use_ours = path == "patched" and mine is not None and mine.error is None and mine.ok
            m = mine if use_ours else meas.get((op.key, "upstream"))
        total += op.count * (m.kernels if m is not None else float("nan"))
    return total


def all_ok(meas: Dict[Tuple[str, str], Measurement]) -> bool:
    """False when any op mismatched its reference or raised (a missing patch is not a failure)."""
    return all(m.ok for m in meas.values())


def to_json(m: Measurement) -> Dict[str, Any]:
    return asdict(m)
