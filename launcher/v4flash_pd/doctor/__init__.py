"""`v4flash-pd doctor`: check a box against a plan before minutes of weight loading.

One module per check family (gpu, numa, ports, model, storage, stack, transport, offline), each a
pure-ish function of a `DoctorInput` (expectations read off the Plan, the topology, and a `Probe`
through which every side effect goes), returning frozen `Check` rows.
"""

from v4flash_pd.doctor.context import DoctorInput, Expect, WorkerExpect, expect_from_plan
from v4flash_pd.doctor.probe import CmdResult, Probe, system_probe
from v4flash_pd.doctor.result import (
                                     ERROR,
                                     EXIT_ERROR,
                                     EXIT_OK,
                                     EXIT_WARN,
                                     OK,
                                     SKIP,
                                     WARN,
                                     Check,
                                     exit_code,
                                     render_table,
                                     to_json,
)
from v4flash_pd.doctor.runner import FAMILIES, run_checks

__all__ = [
    "Check", "CmdResult", "DoctorInput", "ERROR", "EXIT_ERROR", "EXIT_OK", "EXIT_WARN", "Expect", "FAMILIES", "OK",
    "Probe", "SKIP", "WARN",
    "WorkerExpect", "exit_code", "expect_from_plan", "render_table", "run_checks", "system_probe", "to_json",
]
