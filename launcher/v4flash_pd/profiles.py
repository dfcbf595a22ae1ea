"""Built-in profiles: raw config layers that sit between the defaults and the user's file.

A profile is plain data in the same shape as a config file, so `v4flash-pd plan --json` of a
profile is reproducible from a file alone, and a new box is a new dict here, not new code.
"""

from __future__ import annotations

import copy
from typing import Any

from v4flash_pd.errors import UserError

# Offline switches are read at import time by huggingface_hub/transformers, so they must be in
# each worker's environment from exec, not set later.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}

# RTX PRO 6000 boxes have no NVLink and no InfiniBand: UCX must be told to use CUDA copy/IPC plus
# shared memory and TCP, and must find NIXL's bundled CUDA transport modules, else VRAM
# registration fails or UCX misdetects VRAM as host memory.
NO_IB_UCX_ENV = {
    "UCX_TLS": "cuda_copy,cuda_ipc,sm,tcp,self",
    "UCX_MODULE_DIR": "auto",  # the Host's <site-packages>/nixl_cu13.libs/ucx, resolved by build_plan
    "SGLANG_DISAGGREGATION_NIXL_BACKEND": "UCX",
}

# context_length: SGLang sizes the KV pool and the CUDA-graph buffers from it, and the unpatched
# indexer's cost per decode step grows with it; 131072 tokens is the long-context point we size and
# benchmark for (the model's own maximum is larger: raise it with --set engine.context_length=N).
# chunked_prefill_size: SGLang's default on a 96 GB GPU, written out because a chunk above 11673
# tokens crashes sm_120 workers (config.MAX_PREFILL_CHUNK).
_RTX6000_ENGINE = {
    "transfer_backend": "nixl",
    "kv_cache_dtype": "fp8_e4m3",
    "moe_runner_backend": "marlin",
    "mem_fraction_static": 0.70,
    "trust_remote_code": True,
    "enable_metrics": True,
    "context_length": 131072,
    "chunked_prefill_size": 8192,
}

# What /v1/models lists and what clients put in "model": the model's name, not its directory (SGLang's
# fallback); `--set model.served_name=NAME` overrides it.
SERVED_NAME = "DeepSeek-V4-Flash"

# MTP speculative decoding on by default: 2 draft steps (EAGLE, top-k 1, 3 draft tokens). Public
# figures for this checkpoint on 4x RTX PRO 6000 (TP4): 2 steps are the best setting at 1 stream
# (176 -> 299 tok/s) and at 64 streams (+33-43 %), and 3 steps lose to 2 in every row; docs/speculative.md
# has the figures, their sources and our own step-bench cycle. `--mtp 0` turns it off.
SPECULATIVE_DEFAULT = {"num_steps": 2}

# Decode captures CUDA graphs up to the 64 streams per TP4 group the README's figures are for (with
# MTP: 64 x 3 = 192 verify rows); `plan` shows that the KV pool holds them (memory.py).
DECODE_GRAPH_MAX_BS = 64

# Both PD profiles prefill with one TP4 worker on socket 0's GPUs.
_PREFILL_TP4_SOCKET0: dict[str, Any] = {
    "gpus": [0, 1, 2, 3],
    "tp": 4,
    "numa_node": 0,
    "port": 30000,
    "bootstrap_port": 8998,
    "nccl_port": 30010,
}

PROFILES: dict[str, dict[str, Any]] = {
    "rtx6000-8x-pd": {
        "mode": "pd",
        "model": {"path": "/models/DeepSeek-V4-Flash", "served_name": SERVED_NAME},
        "engine": dict(_RTX6000_ENGINE),
        "speculative": dict(SPECULATIVE_DEFAULT),
        "env": {**OFFLINE_ENV, **NO_IB_UCX_ENV},
        "prefill": [dict(_PREFILL_TP4_SOCKET0)],
        "decode": [
            {
                "gpus": [4, 5, 6, 7],
                "tp": 4,
                "numa_node": 1,
                "port": 30001,
                "nccl_port": 30011,
                "cuda_graph_max_bs": DECODE_GRAPH_MAX_BS,
            }
        ],
        "router": {"host": "0.0.0.0", "port": 8000, "metrics_port": 29000},
    },
    # Decode as two TP2 replicas (issue 21): prefill TP4 on socket 0 as above; decode-0 on GPUs 4,5 and
    # decode-1 on GPUs 6,7, both on socket 1's NUMA node, behind the one router. At TP2 a GPU holds half
    # the experts (73.9 GiB of weights with the moe switch's e8m0 expert scales, 86.0 with the pinned fp32
    # ones, memory.py), so the decode workers take mem_fraction_static 0.85: SGLang's 14 GiB (with MTP)
    # stays outside the pool and the pool holds the 32 streams of 8K tokens each replica's graphs cover;
    # `plan` shows the arithmetic (with --moe off the weights do not fit: raise it to 0.94). Decode in PD
    # keeps no prefix cache, so the router spreads streams round-robin instead of by prefix.
    "rtx6000-8x-pd-2xtp2": {
        "mode": "pd",
        "model": {"path": "/models/DeepSeek-V4-Flash", "served_name": SERVED_NAME},
        "engine": dict(_RTX6000_ENGINE),
        "speculative": dict(SPECULATIVE_DEFAULT),
        "env": {**OFFLINE_ENV, **NO_IB_UCX_ENV},
        "prefill": [dict(_PREFILL_TP4_SOCKET0)],
        "decode": [
            {
                "gpus": [4, 5],
                "tp": 2,
                "numa_node": 1,
                "port": 30001,
                "nccl_port": 30011,
                "cuda_graph_max_bs": 32,
                "mem_fraction_static": 0.85,
            },
            {
                "gpus": [6, 7],
                "tp": 2,
                "numa_node": 1,
                "port": 30002,
                "nccl_port": 30012,
                "cuda_graph_max_bs": 32,
                "mem_fraction_static": 0.85,
            },
        ],
        "router": {"host": "0.0.0.0", "port": 8000, "metrics_port": 29000,
                   "extra_args": ["--decode-policy", "round_robin"]},
    },
    # One aggregated TP4 server on the first socket: the A/B baseline for PD (same GPUs count per
    # engine, no KV transfer, no router).
    "rtx6000-tp4": {
        "mode": "aggregated",
        "model": {"path": "/models/DeepSeek-V4-Flash", "served_name": SERVED_NAME},
        "engine": dict(_RTX6000_ENGINE, transfer_backend=None),
        "speculative": dict(SPECULATIVE_DEFAULT),
        "env": dict(OFFLINE_ENV),
        "server": [
            {
                "gpus": [0, 1, 2, 3],
                "tp": 4,
                "numa_node": 0,
                "host": "0.0.0.0",
                "port": 8000,
                "nccl_port": 30010,
                "cuda_graph_max_bs": DECODE_GRAPH_MAX_BS,
            }
        ],
    },
}

DEFAULT_PROFILE = "rtx6000-8x-pd"


def get_profile(name: str) -> dict[str, Any]:
    """A deep copy, so callers can merge into it freely."""
    if name not in PROFILES:
        raise UserError(
            f"unknown profile {name!r}",
            f"use one of: {', '.join(sorted(PROFILES))} (or leave --profile unset for {DEFAULT_PROFILE})",
        )
    return copy.deepcopy(PROFILES[name])
