"""The README's decode-step table against the committed GPU runs it cites.

Each figure is recomposed here from the raw JSON in docs/runs (the same `--from-json` an operator would
run), as the default configuration (`--opt-in ''`), and must appear in the README row that quotes it. A
README edited by hand, a run replaced, or a composition change that moves a number fails this test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest

from v4flash_bench.step.__main__ import main

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "docs" / "runs" / "2026-12-02-h200"
# each run's own composition arguments (its meta.argv), so --from-json finds every measurement
RUN_ARGS = {
    "3eafec2": [],
    "6c100a6": ["--batches", "1,64", "--contexts", "128K", "--prefill=", "--mtp", "2", "--verify-batches", "1",
                "--tp", "4"],
}


def _recompose(tmp_path: Path, commit: str) -> Dict[str, object]:
    out = tmp_path / f"{commit}.json"
    rc = main(["--from-json", str(RUNS / f"step-{commit}.json"), *RUN_ARGS[commit], "--opt-in", "", "--json",
               str(out)])
    assert rc in (0, 1), rc  # 1: the run's own failed upstream checks, carried over, not a re-render error
    data: Dict[str, object] = json.loads(out.read_text())
    return data


def _readme_row(first_cell: str) -> str:
    rows = [ln for ln in (REPO / "README.md").read_text().splitlines() if ln.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, (first_cell, rows)
    return rows[0]


def _comp(data: Dict[str, object], spec: str) -> Dict[str, float]:
    comps: List[Dict[str, float]] = data["compositions"]  # type: ignore[assignment]
    return next(c for c in comps if c["spec"] == spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, object]]:
    tmp = tmp_path_factory.mktemp("runs")
    return {commit: _recompose(tmp, commit) for commit in RUN_ARGS}


@pytest.mark.parametrize("row, commit, spec", [
    ("B=1, 128K context", "6c100a6", "decode B=1 C=128K L=8K"),
    ("B=1, default 1M context", "3eafec2", "decode B=1 C=1M L=8K"),
    ("B=64, 128K context", "6c100a6", "decode B=64 C=128K L=8K"),
    ("B=64, default 1M context", "3eafec2", "decode B=64 C=1M L=8K"),
])
def test_decode_rows_are_the_committed_runs_default_composition(runs, row, commit, spec):
    c = _comp(runs[commit], spec)
    text = _readme_row(row)
    assert f"**{c['patched_ms']:.1f} ms, {c['patched_tok_s']:,.0f} tok/s**" in text, (text, c)
    if "timed" in text:
        assert f"({c['patched_timed_ms']:.1f} timed" in text, (text, c)


def test_kernel_counts_and_whole_step_graphs_are_the_runs(runs):
    data = runs["6c100a6"]
    kernels = {(k["spec"], k["path"]): k["kernels"] for k in data["kernels_per_step"]}  # type: ignore[index, union-attr]
    b1 = _readme_row("B=1, 128K context")
    assert f"{kernels[('decode B=1 C=128K L=8K', 'upstream')]:,.0f} / " \
           f"{kernels[('decode B=1 C=128K L=8K', 'patched')]:,.0f}" in b1
    graphs = {g["path"]: g for g in data["step_graphs"]}  # type: ignore[union-attr]
    assert graphs == {}, "a default re-render leaves out graphs that captured the fused q path"
    raw = json.loads((RUNS / "step-6c100a6.json").read_text())
    g1 = {g["path"]: g for g in raw["step_graphs"] if g["spec"] == "decode B=1 C=128K L=8K"}
    graph_row = _readme_row("same, the whole step as one CUDA graph (fused q path on; its per-op sum 7.5 ms)")
    assert f"**{g1['patched']['ms']:.1f} ms timed**" in graph_row and f"{g1['patched']['kernels']:,}" in graph_row
    assert f"{g1['upstream']['ms']:.1f} ms timed" in graph_row


def test_mtp_cycle_is_the_runs_verify_over_its_plain_step(runs):
    data = runs["6c100a6"]
    plain = _comp(data, "decode B=1 C=128K L=8K")["patched_ms"]
    cycle = _comp(data, "verify k=2 B=1 C=128K L=8K")["patched_ms"]
    text = _readme_row("MTP verify k=2, B=1 (cycle: verify + 2 drafts)")
    assert f"**{cycle:.1f} ms** ({cycle / plain:.2f}x the plain step" in text, (text, cycle, plain)
