"""Which kind of failure an exception is: what the launcher reports and the operator acts on.

Classes: `compile_error` (Triton could not build the kernel for this GPU: MLIR/LLVM/ptxas, or the
interpreter could not run its body), `resource_error` (shared memory, registers, threads, GPU
memory), `launch_error` (the driver refused or aborted the launch: illegal address, misaligned
access, ...), `exception` (anything else ours raised), `harness_error` (the check's own inputs or
reference failed: nothing can be said about ours). `wrong_result` is decided by the comparison,
`timeout` and `crash` by the launcher watching the process.
"""

from __future__ import annotations

WRONG_RESULT = "wrong_result"
COMPILE_ERROR = "compile_error"
RESOURCE_ERROR = "resource_error"
LAUNCH_ERROR = "launch_error"
EXCEPTION = "exception"
HARNESS_ERROR = "harness_error"
CLASSES = (WRONG_RESULT, COMPILE_ERROR, RESOURCE_ERROR, LAUNCH_ERROR, EXCEPTION, HARNESS_ERROR)

_LAUNCH_WORDS = ("cuda error", "triton error [cuda]", "cuda driver error", "illegal memory access",
                 "illegal instruction", "misaligned address", "unspecified launch failure", "launch failed",
                 "device-side assert", "an illegal", "cudaerror", "cuda_error")
_COMPILE_WORDS = ("passmanager", "mlir", "llvm", "ptxas", "failed to compile", "compilation")


def classify(exc: BaseException) -> str:
    """The class of an exception raised while building, launching or running a kernel."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import InterpreterError, OutOfResources, PTXASError
    except Exception:  # pragma: no cover - triton missing: only the message can tell
        CompilationError = InterpreterError = OutOfResources = PTXASError = ()
    if OutOfResources and isinstance(exc, OutOfResources):
        return RESOURCE_ERROR
    if (CompilationError and isinstance(exc, (CompilationError, PTXASError, InterpreterError))):
        return COMPILE_ERROR
    msg = f"{type(exc).__name__}: {exc}".lower()
    if "outofmemory" in msg or "out of memory" in msg or "out of resource" in msg:
        return RESOURCE_ERROR
    if any(w in msg for w in _LAUNCH_WORDS):
        return LAUNCH_ERROR
    if any(w in msg for w in _COMPILE_WORDS):
        return COMPILE_ERROR
    return EXCEPTION


def describe(exc: BaseException, limit: int = 600) -> str:
    """One line: the exception type and the start of its message (a compile log can be pages long)."""
    text = " ".join(str(exc).split())
    out = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."
