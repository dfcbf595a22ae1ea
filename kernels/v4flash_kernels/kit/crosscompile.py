"""Compile a Triton kernel for an sm_120 or sm_90 target without a GPU and read what it needs.

Why: `triton.compile` does not fail when a config needs more shared memory than the target has
(that is only checked when a GPU loads the binary), and a config that fits Hopper's 227 KB can be
far over sm_120's 99 KB. So every op folder's `compile.binaries(arch)` compiles each binary its
dispatcher can launch, and `check_sm120` fails on more than 101376 B of shared memory per block on
sm_120 or any register spill, reading registers and spills from the bundled ptxas.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

SMEM_LIMIT = {120: 101376, 90: 232448}


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    config: str
    arch: int
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    smem_limit: int

    expected_shared: int = 0  # the table's recorded value (0 = not recorded)
    ptx_problem: str = ""  # what the PTX lacks (the all-reduce's memory scopes); "" = fine or not checked

    @property
    def ok(self) -> bool:
        recorded = self.expected_shared in (0, self.shared_bytes)
        return (recorded and self.shared_bytes <= self.smem_limit and self.spill_stores == 0 and self.spill_loads == 0
                and not self.ptx_problem)


def ptxas_stats(ptx: str, arch: int) -> Tuple[Any, ...]:
    """Run the ptxas Triton bundles (ptxas-blackwell for sm_120) with -v; return regs, spills."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    gpu = f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.o")],
            capture_output=True, text=True, check=True, timeout=600,
        )
    log = proc.stdout + proc.stderr
    used = re.search(r"Used (\d+) registers", log)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if used is None or m is None:
        # A ptxas whose -v report changed format: show what it printed instead of failing on None.group.
        raise RuntimeError(f"{ptxas} -v --gpu-name={gpu}: no register/spill report in its output:\n{log}")
    return int(used.group(1)), int(m.group(1)), int(m.group(2))


def compile_kernel(fn: Any, signature: Dict[str, Any], constexprs: Dict[str, Any], hinted: Sequence[str], arch: int,
                   num_warps: int, num_stages: int) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
