"""python -m v4flash_kernels.selfcheck: check each kernel patch on this process's one GPU before serving.

    python -m v4flash_kernels.selfcheck [--json OUT] [--patches sparse_decode,moe,indexer]
        [--batches 1,32] [--prefill-rows 8192] [--context 131072] [--tp-size 4] [--tp-rank 0]
        [--device cuda|cpu] [--seed N] [--no-upstream] [--verify-rows 3,192]
        [--group FILE [--shared-gpu]]

The launcher (`v4flash-pd up`, `selfcheck`, `doctor --gpu`) runs one of these per GPU of its plan,
with CUDA_VISIBLE_DEVICES set to that GPU, in the workers' interpreter and environment. `--device
cpu` runs the small shapes under Triton's interpreter (tests and CI). A check that spans the
worker's GPUs (the all-reduce) runs in all of its processes at once; they meet at `--group FILE`
(a fresh path per check; `--tp-rank`/`--tp-size` place this process in the group). Exit: 0 every checked patch
passed, 1 one failed, 2 bad options, 3 a CUDA error lost the context before every patch ran (run
the rest in a fresh process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, List

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONTEXT_LOST = 0, 1, 2, 3


class UsageError(Exception):
    def __init__(self, msg: str, fix: str) -> None:
        super().__init__(msg)
        self.fix = fix


def _ints(text: str, what: str, minimum: int, example: str = "1,32") -> List[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise UsageError(f"--{what} {text!r}: {part!r} is not an integer", f"give e.g. --{what} {example}") from None
        if v < minimum:
            raise UsageError(f"--{what} {text!r}: {v} is below {minimum}", f"give e.g. --{what} {example}")
        out.append(v)
    return out


def parse(argv: List[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m v4flash_kernels.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the per-GPU record here (rewritten as each case finishes)")
    ap.add_argument("--patches", default=None,
                    help="comma-separated kernel switches (default: every switch in the registry)")
    ap.add_argument("--batches", default="1", help="decode batch sizes at production shapes (B=1, largest captured)")
    ap.add_argument("--prefill-rows", default="0", help="rows of one prefill chunk on this GPU's worker (0 = none)")
    ap.add_argument("--context", default="131072", help="--context-length of the workers (page-table widths)")
    ap.add_argument("--tp-size", default="4")
    ap.add_argument("--tp-rank", default="0")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--seed", default="0")
    ap.add_argument("--gpu", default=None, help="the physical GPU index this process checks (a label for the record)")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream's functions")
    ap.add_argument("--verify-rows", default="",
                    help="rows of the speculative verify batches the worker captures (B x (k+1)); '' = MTP off")
    ap.add_argument("--group", default="", help="file store where this worker's GPUs meet (the all-reduce check)")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="the group's ranks share one GPU (a test seam: the process path on a one-GPU machine)")
    return ap.parse_args(argv)


def options(args: argparse.Namespace) -> Any:
    """The runner's Options from the command line (imports the registry, not torch)."""
    from v4flash_kernels.selfcheck import inject
    from v4flash_kernels.selfcheck.case import Target
    from v4flash_kernels.selfcheck.runner import Options, registry_modules

    batches = tuple(_ints(args.batches, "batches", 1))
    if not batches:
        raise UsageError("--batches is empty", "give at least one batch size, e.g. --batches 1")
    prefill = _ints(args.prefill_rows, "prefill-rows", 0, "8192")
    context = _ints(args.context, "context", 256, "131072")
    tp_size, tp_rank, seed = (_ints(args.tp_size, "tp-size", 1, "4"), _ints(args.tp_rank, "tp-rank", 0, "1"),
                              _ints(args.seed, "seed", 0, "0"))
    if len(prefill) != 1 or len(context) != 1 or len(tp_size) != 1 or len(tp_rank) != 1 or len(seed) != 1:
        raise UsageError("--prefill-rows, --context, --tp-size, --tp-rank and --seed take one integer each",
                         "e.g. --context 131072 --tp-size 4 --tp-rank 1")
    if tp_rank[0] >= tp_size[0]:
        raise UsageError(f"--tp-rank {tp_rank[0]} is not below --tp-size {tp_size[0]}", "ranks count from 0")
    names = tuple(n.strip() for n in args.patches.split(",") if n.strip()) if args.patches is not None else None
    try:
        modules = registry_modules(names)
    except KeyError as exc:
        raise UsageError(str(exc.args[0]), "name switches from the registry (v4flash_kernels/hook/patches.py)") from None
    verify = tuple(_ints(args.verify_rows, "verify-rows", 1, "3,192"))
    gpu = _ints(args.gpu, "gpu", 0, "4") if args.gpu is not None else []
    try:
        injected = inject.from_env(gpu=gpu[0] if gpu else None)
    except ValueError as exc:
        raise UsageError(str(exc), f"unset {inject.ENV} (it is a test seam)") from None
    target = Target(device=args.device, batches=batches, prefill_rows=prefill[0], context=context[0],
                    tp_size=tp_size[0], tp_rank=tp_rank[0], small_only=args.device == "cpu", seed=seed[0],
                    verify_rows=verify, group=args.group, shared_gpu=args.shared_gpu)
    return Options(target=target, patches=tuple(modules), modules=modules, json_path=args.json,
                   inject=injected, upstream=not args.no_upstream, gpu=gpu[0] if gpu else None)


def main(argv: List[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cpu":  # must precede the first triton import (triton.jit reads it)
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        opts = options(args)
    except UsageError as exc:
        print(f"error: {exc}\nfix: {exc.fix}", file=sys.stderr)
        return EXIT_USAGE
    from v4flash_kernels.interpreter import fix_index, interpreting

    if interpreting():
        import warnings

        fix_index()
        # masked-off lanes of the poisoned heads overflow in numpy; the kernels never use them
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    if args.device == "cuda":
        try:
            import torch

            usable = torch.cuda.is_available()
        except Exception as exc:  # torch missing or broken: say so, do not pretend a patch failed
            print(f"error: torch cannot be imported here: {exc}\nfix: run in the serving environment", file=sys.stderr)
            return EXIT_USAGE
        if not usable:
            print("error: no CUDA GPU is visible to torch (check CUDA_VISIBLE_DEVICES and the driver)\n"
                  "fix: run on the GPU box, or pass --device cpu for the interpreter", file=sys.stderr)
            return EXIT_USAGE
    from v4flash_kernels.selfcheck import record
    from v4flash_kernels.selfcheck.runner import run

    rec = run(opts)
    print(json.dumps({n: {k: p[k] for k in ("status", "class", "error", "seconds")}
                      for n, p in rec["patches"].items()}, indent=1))
    if rec["context_lost"]:
        # Leave without torch's exit-time cleanup: with a poisoned context it can abort the process,
        # and the launcher must see "context lost" (start a fresh process), not a crash.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CONTEXT_LOST)
    return EXIT_FAILED if any(p["status"] == record.FAIL for p in rec["patches"].values()) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
