"""The subset of SGLang 0.5.13's server flags the stand-in needs; everything else is ignored.

Why parse_known_args: the stand-in must accept any argv the real `sglang.launch_server` accepts
(the plan passes dozens of flags), yet reject the values SGLang itself would reject for the flags
that matter to the PD wiring (mode, transfer backend), so a rehearsal catches those mistakes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

# Choices as in sglang 0.5.13 server_args.py.
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")


@dataclass(frozen=True)
class EngineArgs:
    """Server arguments with SGLang's field names (they appear verbatim in /server_info)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    context_length: int | None = None
    kv_cache_dtype: str = "auto"
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    weight_version: str = "default"
    # Speculative decoding, under SGLang's field names (the DeepSeek-V4 MTP runs as EAGLE).
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    disaggregation_decode_enable_radix_cache: bool = False
    ignored: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)  # never shown: /server_info leaves it out

    @property
    def model_name(self) -> str:
        """What /v1/models reports: SGLang uses served_model_name, falling back to model_path."""
        return self.served_model_name or self.model_path

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def role(self) -> str:
        """prefill, decode, or 'server' for an aggregated (null-mode) server."""
        return "server" if self.disaggregation_mode == "null" else self.disaggregation_mode


def build_parser() -> argparse.ArgumentParser:
    """Flags spelled as SGLang spells them (aliases included: `--tp` is what plans use)."""
    p = argparse.ArgumentParser(
        prog="python -m v4flash_pd.rehearsal.engine",
        description="Rehearsal stand-in for sglang.launch_server (accepts the same argv).",
    )
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", dest="served_model_name")
    p.add_argument("--tokenizer-path", dest="tokenizer_path")
    p.add_argument("--tensor-parallel-size", "--tp-size", "--tp", dest="tp_size", type=int,
                   default=1)
    p.add_argument("--data-parallel-size", "--dp-size", "--dp", dest="dp_size", type=int,
                   default=1)
    p.add_argument("--pipeline-parallel-size", "--pp-size", dest="pp_size", type=int, default=1)
    p.add_argument("--base-gpu-id", dest="base_gpu_id", type=int, default=0)
    p.add_argument("--gpu-id-step", dest="gpu_id_step", type=int, default=1)
    p.add_argument("--context-length", dest="context_length", type=int)
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", default="auto")
    p.add_argument("--disaggregation-mode", dest="disaggregation_mode",
                   choices=DISAGGREGATION_MODES, default="null")
    p.add_argument("--disaggregation-bootstrap-port", dest="disaggregation_bootstrap_port",
                   type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", dest="disaggregation_transfer_backend",
                   choices=TRANSFER_BACKENDS, default="mooncake")
    p.add_argument("--weight-version", dest="weight_version", default="default")
    p.add_argument("--speculative-algorithm", dest="speculative_algorithm")
    p.add_argument("--speculative-num-steps", dest="speculative_num_steps", type=int)
    p.add_argument("--speculative-eagle-topk", dest="speculative_eagle_topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", dest="speculative_num_draft_tokens", type=int)
    p.add_argument("--disaggregation-decode-enable-radix-cache", dest="disaggregation_decode_enable_radix_cache",
                   action="store_true")
    p.add_argument("--api-key", dest="api_key", default=None)
    return p


def speculative_problem(args: EngineArgs) -> str:
    """What the pinned sglang raises at start for these speculative flags on DeepSeek-V4 ("" = none):
    arg_groups/deepseek_v4_hook.py, speculative_hook.py and pd_disaggregation_hook.py, in that order."""
    if args.speculative_algorithm is None:
        return ""
    if args.speculative_algorithm != "EAGLE":
        return "AssertionError: Only EAGLE speculative algorithm is supported for DeepseekV4ForCausalLM"
    if args.speculative_eagle_topk != 1:
        return "AssertionError: Only EAGLE speculative algorithm with topk == 1 is supported for DeepseekV4ForCausalLM"
    if args.speculative_num_steps is None:
        return "AssertionError (speculative_hook.py): --speculative-num-steps unset while --speculative-eagle-topk is set"
    if args.disaggregation_mode == "decode" and args.disaggregation_decode_enable_radix_cache:
        return ("ValueError: --disaggregation-decode-enable-radix-cache is incompatible with speculative decoding "
                f"(--speculative-algorithm {args.speculative_algorithm})")
    return ""


def parse_engine_args(argv: list[str]) -> EngineArgs:
    """Parse an SGLang argv; invalid values for known flags exit 2 like SGLang's argparse does."""
    ns, rest = build_parser().parse_known_args(argv)
    for name, value in (("--port", ns.port), ("--disaggregation-bootstrap-port",
                                              ns.disaggregation_bootstrap_port)):
        if not 0 < value < 65536:
            build_parser().error(f"{name} must be in 1..65535, got {value}")
    args = EngineArgs(ignored=tuple(rest), **dict(vars(ns)))
    if args.speculative and args.speculative_num_steps is not None and \
            args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        # speculative_hook.py at top-k 1: num_draft_tokens becomes num_steps + 1 (a warning, not an error)
        args = replace(args, speculative_num_draft_tokens=args.speculative_num_steps + 1)
    return args
