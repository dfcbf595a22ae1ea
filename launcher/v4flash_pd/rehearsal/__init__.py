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
# Next to every number or verdict `bench` and `eval` print from a server whose replies carry the stand-in's
# `"rehearsal": true` (meta_info): what they measured is the launcher's path, not a GPU box.
STANDIN_LABEL = "[stand-in: rehearsal engines, no model, no GPU]"

__all__ = ["ENGINE_MODULE", "REHEARSAL_HEADER", "REHEARSAL_MARK", "STANDIN_LABEL", "is_standin_reply"]


def is_standin_reply(meta: object) -> bool:
    """A /generate reply's (or stream event's) meta_info as the stand-in writes it: `"rehearsal": true`."""
    return isinstance(meta, dict) and meta.get("rehearsal") is True
