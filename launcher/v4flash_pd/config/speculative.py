"""Speculative decoding: the [speculative] table resolved, and every combination refused that the
pinned sglang 0.5.13.post1 would refuse at start (after a 20-minute weight load) or silently change.

What the pinned code does with these flags (paths inside the wheel, `sglang/srt/...`):
- `arg_groups/deepseek_v4_hook.py` (ServerArgs.__post_init__, before aliases are resolved): asserts
  `speculative_algorithm == "EAGLE"` and `speculative_eagle_topk == 1` (None fails too, so top-k is
  always passed).
- `arg_groups/speculative_hook.py`: at top-k 1 replaces `speculative_num_draft_tokens` by
  `num_steps + 1` with only a log line, so any other value is refused here instead.
- `arg_groups/pd_disaggregation_hook.py`: a decode worker with `--disaggregation-decode-enable-radix-cache`
  raises ValueError when speculative decoding is on.
- `server_args.py`: pipeline parallelism (`--pp-size` > 1) asserts no speculative decoding; LoRA
  raises ValueError for EAGLE.
- `model_executor/pool_configurator.py`: `SGLANG_OPT_USE_ONLINE_COMPRESS` asserts no MTP.
- `disaggregation/prefill.py` + `speculative/eagle_disaggregation.py`: prefill stores the draft state
  (top-k p/index, hidden) that decode rebuilds, so prefill and decode must run the same flags: the
  plan passes the table to every worker and refuses speculative flags that would reach only some.
"""

from __future__ import annotations

from v4flash_pd.config.types import Speculative, WorkerSpec
from v4flash_pd.config.values import arg_value
from v4flash_pd.errors import UserError

# The flags the [speculative] table owns: the plan writes them, nobody else may.
OWNED_FLAGS = ("--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
               "--speculative-num-draft-tokens")
SPEC_PREFIX = "--speculative-"
DECODE_RADIX_FLAG = "--disaggregation-decode-enable-radix-cache"
PP_FLAGS = ("--pipeline-parallel-size", "--pp-size")
LORA_FLAGS = ("--enable-lora", "--lora-paths")
ONLINE_COMPRESS_ENV = "SGLANG_OPT_USE_ONLINE_COMPRESS"
# Every flag a check below looks for by name (SPEC_PREFIX: the whole `--speculative-*` family):
# extraargs refuses their abbreviations, so these full-name checks see what argparse would read.
GUARDED_FLAGS = (*OWNED_FLAGS, SPEC_PREFIX, DECODE_RADIX_FLAG, *PP_FLAGS, *LORA_FLAGS)
_TRUE = ("1", "true", "yes", "on", "y", "t")


def given(argv: tuple[str, ...], flag: str) -> bool:
    """Whether `flag` appears in an argv tail (`--flag`, `--flag V` or `--flag=V`)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def spec_flags(argv: tuple[str, ...]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith(SPEC_PREFIX)]


def resolve(algorithm: str, num_steps: int, eagle_topk: int, num_draft_tokens: int | None) -> Speculative:
    """The table's checked values as the workers run them (num_draft_tokens = num_steps + 1)."""
    if num_draft_tokens is not None and num_steps == 0:
        raise UserError(f"speculative.num_draft_tokens = {num_draft_tokens} but speculative.num_steps = 0, which "
                        "turns speculative decoding off",
                        f"turn it on with --mtp {max(num_draft_tokens - 1, 1)} (or --set speculative.num_steps=N), or "
                        "drop speculative.num_draft_tokens")
    if num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
        raise UserError(f"speculative.num_draft_tokens = {num_draft_tokens} with num_steps = {num_steps}: at eagle_topk "
                        f"1 sglang 0.5.13.post1 replaces it by num_steps + 1 = {num_steps + 1} with only a log line "
                        "(arg_groups/speculative_hook.py), so the workers would not run what the config says",
                        f"set speculative.num_draft_tokens = {num_steps + 1}, or leave it out (num_steps + 1 is the "
                        "default); to verify more tokens per step raise num_steps (--mtp N)")
    return Speculative(algorithm, num_steps, eagle_topk, num_steps + 1 if num_steps else 0)


def check_combination(spec: Speculative, mode: str, engine_extra: tuple[str, ...], workers: tuple[WorkerSpec, ...],
                      env: tuple[tuple[str, str], ...]) -> None:
    """Refuse what the workers' own flags and env would make the pinned sglang refuse with `spec`."""
    places = [("engine.extra_args", engine_extra, None)] + \
        [(f"{w.role}.{w.index}.extra_args", w.extra_args, w) for w in workers]
    for where, argv, w in places:
        owned = [f for f in OWNED_FLAGS if given(argv, f)]
        if owned:
            raise UserError(f"{where} passes {', '.join(owned)}: the [speculative] table writes these flags for every "
                            "worker (prefill and decode must run the same ones)",
                            "drop them from extra_args and use --mtp N (N draft steps; 0 = off), or --set "
                            "speculative.num_steps=N")
        other = spec_flags(argv)
        if other and not spec.on:
            raise UserError(f"{where} passes {', '.join(other)} but speculative decoding is off (speculative.num_steps "
                            "= 0), where those flags do nothing",
                            "turn it on with --mtp N, or drop them from extra_args")
        if other and w is not None and mode == "pd":
            raise UserError(f"{where} passes {', '.join(other)} to {w.name} only: prefill stores the draft state "
                            "decode rebuilds, so both must run the same speculative flags",
                            "move them to engine.extra_args (every worker gets those)")
    if not spec.on:
        return
    off = "or turn speculative decoding off (--mtp 0)"
    for where, argv, w in places:
        role = w.role if w is not None else None
        if mode == "pd" and role in (None, "decode") and given(argv, DECODE_RADIX_FLAG):
            raise UserError(f"{where} passes {DECODE_RADIX_FLAG} with speculative decoding on: sglang 0.5.13.post1 "
                            "refuses the decode radix cache with speculative decoding (arg_groups/"
                            "pd_disaggregation_hook.py raises ValueError), so decode would stop at start",
                            f"drop {DECODE_RADIX_FLAG} from {where}, {off}")
        pp = next((arg_value(argv, f) for f in PP_FLAGS if given(argv, f)), None)
        if pp is not None and pp.strip() != "1":
            raise UserError(f"{where} sets pipeline parallelism ({pp}) with speculative decoding on, which "
                            "sglang 0.5.13.post1 asserts against (server_args.py: pipeline parallelism is not "
                            "compatible with speculative decoding)",
                            f"drop --pp-size from {where}, {off}")
        lora = [f for f in LORA_FLAGS if given(argv, f)]
        if lora:
            raise UserError(f"{where} passes {', '.join(lora)} with speculative decoding on: sglang 0.5.13.post1 "
                            "serves LoRA only with NGRAM speculation (server_args.py raises ValueError for EAGLE)",
                            f"drop {', '.join(lora)} from {where}, {off}")
    envs = [("env", env)] + [(f"{w.role}.{w.index}.env", w.env) for w in workers]
    for where, pairs in envs:
        value = dict(pairs).get(ONLINE_COMPRESS_ENV)
        if value is not None and value.strip().lower() in _TRUE:
            raise UserError(f"{where} sets {ONLINE_COMPRESS_ENV}={value} with speculative decoding on: the online c128 "
                            "compressor cannot roll back drafts (model_executor/pool_configurator.py asserts no MTP)",
                            f"remove {ONLINE_COMPRESS_ENV} from {where}, {off}")
