"""Triton sparse-MLA decode for DeepSeek-V4 on sm_120 (and sm_90), plus the SGLang import hook.

Importing this package must stay cheap (the hook's .pth runs in every interpreter): torch and
triton are imported only when a kernel is first used.
"""

from __future__ import annotations

__version__ = "0.1.0"


def sparse_mla_decode(*args, **kwargs):  # same contract as upstream
    """Drop-in for sglang 0.5.13.post1 `flash_mla_sparse_decode_triton` (see attention/op.py)."""
    from v4flash_kernels.attention.op import sparse_mla_decode as _impl

    return _impl(*args, **kwargs)
