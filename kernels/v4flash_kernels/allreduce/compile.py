"""The all-reduce binaries `launch` can start, compiled for a target (`check_sm120`); their PTX must
also carry the memory scopes the flag protocol relies on."""

from __future__ import annotations

import re
from typing import List

from v4flash_kernels.kit.crosscompile import SMEM_LIMIT, CompileResult, compile_kernel, ptxas_stats

# What the all-reduce's flag protocol needs from the PTX (kernel.py): flags raised with a release at
# system scope after the CTA barrier, polled with acquire at system scope (peers write them over
# PCIe/NVLink), the epoch bookkeeping at GPU scope, received data read through L2 (.cg), and the
# pushes vectorised (16-byte stores: the alignment hints on the IPC pointers took effect).
ALLREDUCE_PTX_NEEDS = (  # Triton prints scope and semantic in either order (exch: .sys.release, cas: .acquire.sys)
    (r"atom\.global\.(sys\.release|release\.sys)\.exch\.b64", "flag raise: atom.release.sys"),
    (r"atom\.global\.(sys\.acquire|acquire\.sys)\.cas\.b64", "flag wait: atom.acquire.sys (cas)"),
    (r"atom\.global\.(gpu\.acq_rel|acq_rel\.gpu)\.add", "CTA arrival: atom.acq_rel.gpu"),
    (r"atom\.global\.(gpu\.release|release\.gpu)\.exch\.b64", "epoch store: atom.release.gpu"),
    (r"ld\.global\.cg\.v4", "received data: 16-byte ld.cg"),
    (r"st\.global\.v4", "pushes: 16-byte stores"),
)
ALLREDUCE_PTX_FORBIDDEN = (
    (r"\b(atom|ld|st|red)\.global(\.\w+)*?\.cta\.", "a CTA-scoped memory operation (flags cross GPUs)"),
    (r"\b(atom|ld|st|red)\.global(\.\w+)*?\.(sys\.relaxed|relaxed\.sys)\.",
     "a relaxed system-scope operation (flags need release/acquire)"),
)


def allreduce_ptx_problem(ptx: str, vectorised: bool = True) -> str:
    """'' when the PTX has every scope the all-reduce protocol needs and none it must not use
    (`vectorised=False`: a size that is not a multiple of 16 elements, whose accesses are scalar)."""
    needs = ALLREDUCE_PTX_NEEDS if vectorised else [n for n in ALLREDUCE_PTX_NEEDS if "16-byte" not in n[1]]
    missing = [what for pat, what in needs if not re.search(pat, ptx)]
    wrong = [what for pat, what in ALLREDUCE_PTX_FORBIDDEN if re.search(pat, ptx)]
    return "; ".join([f"missing {m}" for m in missing] + [f"has {w}" for w in wrong])


def compile_allreduce(two_shot: bool, world: int, dtype: str, arch: int, spin_limit: int = 0) -> CompileResult:
    """One all-reduce binary as `allreduce.launch.launch` passes it (spin_limit 0: production's unbounded
    waits; the start-up probe's bounded ones otherwise)."""
    from v4flash_kernels.allreduce import kernel as k
    from v4flash_kernels.allreduce import plan as P

    esize = {"bf16": 2, "fp32": 4}[dtype]
    sig = {"X": f"*{dtype}", "OUT": f"*{dtype}", **{f"P{i}": "i64" for i in range(P.MAX_RANKS)},
           "rank": "i32", "n": "i32", "slot": "i32", "span": "i32"}
    const = {"WORLD": world, "BLOCK": P.BLOCK_BYTES // esize, "DATA_OFF": P.DATA_OFF,
             "HALF_BYTES": P.Layout().half_bytes, "FLAGS1_OFF": P.FLAGS1_OFF, "MAX_CTAS": P.MAX_CTAS,
             "SPIN_LIMIT": spin_limit}
    if two_shot:
        const["FLAGS2_OFF"] = P.FLAGS2_OFF
    # what Triton's specialisation gives a real call: 16-byte aligned tensors and IPC addresses,
    # numel a multiple of 16 (n % 16 != 0 compiles a variant with scalar tails, same scopes)
    hinted = ["X", "OUT", *(f"P{i}" for i in range(P.MAX_RANKS)), "n", "slot", "span"]
    fn = k.two_shot_kernel if two_shot else k.one_shot_kernel
    ck = compile_kernel(fn, sig, const, hinted, arch, P.NUM_WARPS, 1)
    ptx = ck.asm["ptx"]
    regs, st, ld = ptxas_stats(ptx, arch)
    name = f"{'two' if two_shot else 'one'}_shot/n{world}/{dtype}" + ("/probe" if spin_limit else "")
    return CompileResult("allreduce", name, arch,
                         int(ck.metadata.shared), regs, st, ld, SMEM_LIMIT[arch], ptx_problem=allreduce_ptx_problem(ptx))


def binaries(arch: int) -> List[CompileResult]:
    """Every all-reduce binary `launch` can start: both algorithms, every rank count of `plan.WORLDS`, bf16 and fp32, and the
    start-up probe's bf16 binaries with bounded waits."""
    from v4flash_kernels.allreduce import plan as P
    from v4flash_kernels.allreduce.comm import PROBE_SPINS

    worlds = P.WORLDS
    return ([compile_allreduce(two, world, dt, arch) for two in (False, True) for world in worlds
             for dt in ("bf16", "fp32")]
            + [compile_allreduce(two, world, "bf16", arch, PROBE_SPINS) for two in (False, True) for world in worlds])
