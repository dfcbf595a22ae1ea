"""The few CUDA runtime calls the IPC buffers need, through ctypes on the libcudart torch already loaded.

Why not torch's own IPC (`storage._share_cuda_()` + `rebuild_cuda_tensor`): the rebuild opens a peer's
handle under the *peer's* device index, which creates a CUDA context on every peer GPU in every
process (hundreds of MB each) and leaves the mapping in a context our kernels do not run in. Here
each rank opens its peers' handles in its own device's context (`cudaIpcMemLazyEnablePeerAccess`),
exactly what a kernel on that device needs, and the buffer is one plain `cudaMalloc` outside torch's
caching allocator (so its expandable-segments setting cannot change how it is shared). Using the
runtime torch loaded (found in /proc/self/maps) keeps one current-device state shared with torch.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any, List

IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class CudaError(RuntimeError):
    pass


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_BYTES)]


def _loaded_cudart() -> str | None:
    """The path of the libcudart this process has mapped (torch's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcudart"):
                    return path
    except OSError:
        return None
    return None


def _torch_cudart_candidates() -> List[Any]:
    import torch

    torch.cuda.init()  # loads the runtime torch links against
    found = _loaded_cudart()
    if found:
        return [found]
    here = os.path.dirname(torch.__file__)
    site = os.path.dirname(here)
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*"))) + [
        "libcudart.so.13", "libcudart.so.12", "libcudart.so"]


class CudaRT:
    """cudaMalloc / cudaMemset / cudaFree / cudaIpc{Get,Open,Close}MemHandle; raises CudaError with the message."""

    def __init__(self, path: str | None = None) -> None:
        errors = []
        for cand in [path] if path else _torch_cudart_candidates():
            try:
                self.lib = ctypes.CDLL(cand)
                self.path = cand
                break
            except OSError as exc:
                errors.append(f"{cand}: {exc}")
        else:
            raise CudaError("cannot load the CUDA runtime: " + "; ".join(errors))
        lib = self.lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.cudaDeviceSynchronize.argtypes = []
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for name in ("cudaMalloc", "cudaFree", "cudaMemset", "cudaDeviceSynchronize", "cudaIpcGetMemHandle",
                     "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaMemcpy"):
            getattr(lib, name).restype = ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.cudaGetErrorString(rc)
            raise CudaError(f"{what} failed: {msg.decode() if msg else rc} (cudaError {rc})")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes})")
        return int(ptr.value or 0)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check(self.lib.cudaMemset(ctypes.c_void_p(ptr), value, nbytes), "cudaMemset")
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def read(self, ptr: int, nbytes: int) -> bytes:
        """Device memory -> host bytes (cudaMemcpyDefault: synchronous, after all prior work)."""
        buf = ctypes.create_string_buffer(nbytes)
        self._check(self.lib.cudaMemcpy(buf, ctypes.c_void_p(ptr), nbytes, 4), "cudaMemcpy")
        return buf.raw

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def ipc_handle(self, ptr: int) -> bytes:
        h = _IpcHandle()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)  # all 64 bytes, NULs included

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, LAZY_ENABLE_PEER_ACCESS),
                    "cudaIpcOpenMemHandle")
        return int(ptr.value or 0)

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")
