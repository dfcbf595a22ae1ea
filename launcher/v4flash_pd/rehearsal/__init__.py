"""Rehearsal stand-in for `python -m sglang.launch_server`.

`v4flash-pd up --rehearse` runs the real plan (ports, env, numactl, the real sglang-router) but
starts `python -m v4flash_pd.rehearsal.engine <the same SGLang argv>` instead of each SGLang worker.
The stand-in speaks the HTTP endpoints the router and the launcher use and emulates the PD
bootstrap handshake, so wiring mistakes fail here the way they would fail on the GPU box.
Stdlib only: it runs in the slim launcher image.
"""

ENGINE_MODULE = "v4flash_pd.rehearsal.engine"
REHEARSAL_HEADER = "X-V4flash-Rehearsal"
REHEARSAL_MARK = "[rehearsal]"

__all__ = ["ENGINE_MODULE", "REHEARSAL_HEADER", "REHEARSAL_MARK"]
