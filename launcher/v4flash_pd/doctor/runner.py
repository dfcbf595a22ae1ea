"""Runs every check family and never lets one crash the report."""

from __future__ import annotations

import traceback
from typing import Callable, Sequence

from v4flash_pd.doctor import gpu, memory, model, numa, offline, p2p, ports, stack, storage, transport
from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error

Family = Callable[[DoctorInput], list[Check]]

# Order = the order an operator fixes things in: hardware, host, files, software, transport, env.
FAMILIES: tuple[tuple[str, Family], ...] = (
    ("gpu", gpu.run),
    ("p2p", p2p.run),
    ("numa", numa.run),
    ("ports", ports.run),
    ("model", model.run),
    ("memory", memory.run),
    ("storage", storage.run),
    ("stack", stack.run),
    ("transport", transport.run),
    ("offline", offline.run),
)


def run_checks(inp: DoctorInput, families: Sequence[tuple[str, Family]] = FAMILIES,
               only: Sequence[str] = ()) -> tuple[Check, ...]:
    """All checks of the selected families (all by default); a family that raises becomes an error row."""
    out: list[Check] = []
    for name, fn in families:
        if only and name not in only:
            continue
        try:
            out.extend(fn(inp))
        except Exception as exc:  # a doctor that crashes on a broken box is useless
            where = traceback.extract_tb(exc.__traceback__)[-1]
            out.append(error(name, f"the {name} checks crashed: {exc!r} at {where.filename}:{where.lineno}",
                             "report this as a v4flash-pd bug (run with --debug for the traceback)"))
    return tuple(out)
