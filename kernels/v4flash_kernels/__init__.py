"""Triton drop-ins for the sm_120 fallbacks of a DeepSeek-V4-Flash step, the SGLang import hook that puts
them in, and the per-GPU self-check (docs/architecture.md has the map of this package).

Importing this package must stay cheap (the hook's .pth runs in every interpreter): it defines only the
version; torch and triton are imported when a kernel is first used.
"""

from __future__ import annotations

__version__ = "0.1.0"
