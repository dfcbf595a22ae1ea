"""One self-check job per GPU of a plan: which process, which interpreter and environment, which shapes.

Pure: everything comes from the Plan (each worker's argv and env, exactly as `up` would start it),
so the check runs the kernels under the same Python, the same `V4FLASH_*`/`TRITON_*`/CUDA
variables and at the same production shapes as the worker that will own the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from v4flash_pd.plan import Plan, ProcessSpec

KERNEL_MODULE = "v4flash_kernels.selfcheck"
STANDIN_MODULE = "v4flash_pd.rehearsal.selfcheck"
# SGLang 0.5.13.post1's defaults when the plan leaves them unset (server_args.py, by GPU memory:
# >= 90 GiB and TP >= 4 -> CUDA graphs up to 512 requests; 8192-token prefill chunks).
DEFAULT_GRAPH_MAX_BS_TP4, DEFAULT_GRAPH_MAX_BS_TP1 = 512, 256
DEFAULT_PREFILL_CHUNK = 8192
DEFAULT_CONTEXT = 1 << 20  # DeepSeek-V4-Flash's own maximum (what SGLang uses without --context-length)
# The self-check's own knob: where the Triton compile cache goes when the environment names none
# (the image sets TRITON_CACHE_DIR on the cache volume, so a second start compiles nothing).
CACHE_ENV = "V4FLASH_CACHE_DIR"


@dataclass(frozen=True)
class Job:
    gpu: int  # physical index (nvidia-smi / PCI order; the child sees it as its only device)
    worker: str
    role: str
    argv: tuple[str, ...]  # without --json (the driver adds where to write)
    env: tuple[tuple[str, str], ...]  # what the plan gives the worker, plus this GPU alone
    patches: tuple[str, ...]
    # the worker whose GPUs meet for the checks that span them (the all-reduce): the driver names
    # one fresh rendezvous per worker and run; "" = a one-GPU worker (nothing to meet)
    group: str = ""

    def with_patches(self, patches: tuple[str, ...]) -> Job:
        """The same job for fewer patches (a fresh process after a lost CUDA context or a crash)."""
        argv = list(self.argv)
        i = argv.index("--patches")
        argv[i + 1] = ",".join(patches)
        return Job(self.gpu, self.worker, self.role, tuple(argv), self.env, patches, self.group)


def arg(argv: tuple[str, ...], flag: str) -> str | None:
    """The value of `flag` in an argv (`--flag V` or `--flag=V`); the last one wins, as argparse does."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def _int(argv: tuple[str, ...], flag: str, default: int) -> int:
    v = arg(argv, flag)
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def interpreter_of(spec: ProcessSpec) -> str:
    """The worker's Python: the word before `-m` (after any numactl prefix, which never uses `-m`)."""
    argv = list(spec.argv)
    return argv[argv.index("-m") - 1] if "-m" in argv[1:] else argv[0]


@dataclass(frozen=True)
class Shapes:
    """The production facts a worker's own flags fix (what the self-check's production cases use)."""

    batches: tuple[int, ...]  # decode: B=1 and the largest captured batch; prefill: (1,)
    prefill_rows: int  # one prefill chunk's tokens (0: the worker never prefills)
    context: int
    tp_size: int
    # speculative decoding: the verify batches' rows (B x draft tokens) at the fewest and most
    # requests the decode graphs capture; () without it
    verify_rows: tuple[int, ...] = ()


def shapes(spec: ProcessSpec) -> Shapes:
    tp = _int(spec.argv, "--tp-size", len(spec.gpus) or 1)
    decode = spec.role in ("decode", "server")
    prefill = spec.role in ("prefill", "server")
    max_bs = _int(spec.argv, "--cuda-graph-max-bs", DEFAULT_GRAPH_MAX_BS_TP4 if tp >= 4 else DEFAULT_GRAPH_MAX_BS_TP1)
    draft = _int(spec.argv, "--speculative-num-draft-tokens", 0) if arg(spec.argv, "--speculative-algorithm") else 0
    batches = tuple(sorted({1, max_bs})) if decode else (1,)
    return Shapes(batches=batches,
                  prefill_rows=_int(spec.argv, "--chunked-prefill-size", DEFAULT_PREFILL_CHUNK) if prefill else 0,
                  context=_int(spec.argv, "--context-length", DEFAULT_CONTEXT), tp_size=max(1, tp),
                  verify_rows=tuple(b * draft for b in batches) if decode and draft > 1 else ())


def jobs_for(plan: Plan, patches: tuple[str, ...], launcher_env: Mapping[str, str], *, standin: bool = False,
             device: str = "cuda") -> tuple[Job, ...]:
    """One job per GPU of every worker this plan starts, in GPU order.

    `standin` (a rehearsal) runs the stdlib stand-in instead of the kernels; `device="cpu"` runs
    the real kernels' small shapes under Triton's interpreter (CI: no GPU, real code).
    """
    out: list[Job] = []
    module = STANDIN_MODULE if standin else KERNEL_MODULE
    for spec in plan.workers():
        py = interpreter_of(spec)
        s = shapes(spec)
        for rank, gpu in enumerate(spec.gpus):
            env = dict(spec.env)
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            env["PYTHONUNBUFFERED"] = "1"
            if "TRITON_CACHE_DIR" not in env and "TRITON_CACHE_DIR" not in launcher_env and launcher_env.get(CACHE_ENV):
                env["TRITON_CACHE_DIR"] = f"{launcher_env[CACHE_ENV].rstrip('/')}/triton"
            argv: tuple[str, ...] = (py, "-m", module, "--gpu", str(gpu), "--patches", ",".join(patches),
                    "--batches", ",".join(map(str, s.batches)), "--prefill-rows", str(s.prefill_rows),
                    "--context", str(s.context), "--tp-size", str(s.tp_size), "--tp-rank", str(rank % s.tp_size),
                    "--device", device)
            if s.verify_rows:
                argv += ("--verify-rows", ",".join(map(str, s.verify_rows)))
            out.append(Job(gpu, spec.name, spec.role, argv, tuple(sorted(env.items())), patches,
                           group=spec.name if s.tp_size > 1 else ""))
    return tuple(sorted(out, key=lambda j: j.gpu))
