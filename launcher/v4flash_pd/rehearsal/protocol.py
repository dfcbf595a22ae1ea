"""Request parsing and reply shapes of SGLang 0.5.13's HTTP API, as pure functions.

Shapes follow sglang/srt/entrypoints/http_server.py and entrypoints/openai/protocol.py of the
pinned wheel, trimmed to the fields clients and the router read, plus `"rehearsal": true` markers.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from v4flash_pd.rehearsal.textgen import (
    EOS_TOKEN_ID,
    Completion,
    Prompt,
    prompt_from_ids,
    prompt_from_messages,
    prompt_from_text,
)

SGLANG_VERSION = "0.5.13.post1"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang disaggregation/utils.py: health checks use this host
DEFAULT_MAX_NEW_TOKENS = 128     # SamplingParams default
DEFAULT_COMPLETION_MAX_TOKENS = 16  # CompletionRequest.max_tokens default
DEFAULT_CONTEXT_LENGTH = 65536

API_GENERATE = "generate"
API_COMPLETIONS = "completions"
API_CHAT = "chat"


class BadRequest(ValueError):
    """The request cannot be served; SGLang answers these with 400."""


@dataclass(frozen=True)
class GenRequest:
    """One generation request, whatever endpoint it came through."""

    api: str
    rid: str
    prompt: Prompt
    max_new_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    model: str | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer or null, got {v!r}")
    return v


def _bootstrap(body: dict[str, Any]) -> dict[str, Any]:
    host = body.get("bootstrap_host")
    if isinstance(host, list) or isinstance(body.get("bootstrap_room"), list):
        raise BadRequest("batched bootstrap fields are not emulated by the rehearsal stand-in")
    return {"bootstrap_host": host, "bootstrap_port": _opt_int(body, "bootstrap_port"),
            "bootstrap_room": _opt_int(body, "bootstrap_room")}


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool)
                                                 for x in value):
        return value
    return None


def _max_tokens(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{key} must be a non-negative integer, got {value!r}")
    return value


def parse_generate(body: dict[str, Any]) -> GenRequest:
    """POST /generate (SGLang native): `text` or `input_ids`, `sampling_params`, `stream`."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise BadRequest("batched requests are not emulated by the rehearsal stand-in")
    if isinstance(text, str):
        prompt = prompt_from_text(text)
    elif (checked := _ids(ids)) is not None:
        prompt = prompt_from_ids(checked)
    else:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = _max_tokens(sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "max_new_tokens")
    return GenRequest(api=API_GENERATE, rid=str(body.get("rid") or uuid.uuid4().hex),
                      prompt=prompt, max_new_tokens=max_new,
                      ignore_eos=bool(sp.get("ignore_eos", False)),
                      stream=bool(body.get("stream", False)), include_usage=False, model=None,
                      **_bootstrap(body))


def _openai_common(body: dict[str, Any]) -> dict[str, Any]:
    opts = body.get("stream_options") or {}
    return {"stream": bool(body.get("stream", False)),
            "include_usage": bool(isinstance(opts, dict) and opts.get("include_usage")),
            "ignore_eos": bool(body.get("ignore_eos", False)),
            "model": body.get("model"), **_bootstrap(body)}


def parse_completions(body: dict[str, Any]) -> GenRequest:
    """POST /v1/completions: a single `prompt` (string or token ids)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        prompt = prompt_from_text(p)
    elif (checked := _ids(p)) is not None:
        prompt = prompt_from_ids(checked)
    elif isinstance(p, list):
        raise BadRequest("batched prompts are not emulated by the rehearsal stand-in")
    else:
        raise BadRequest("prompt must be a string or a list of token ids")
    max_tokens = _max_tokens(body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS), "max_tokens")
    return GenRequest(api=API_COMPLETIONS, rid=f"cmpl-{uuid.uuid4().hex}", prompt=prompt,
                      max_new_tokens=max_tokens, **_openai_common(body))


def parse_chat(body: dict[str, Any]) -> GenRequest:
    """POST /v1/chat/completions: `messages`; no max tokens means 'until EOS'."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict)
                                                                 for m in messages):
        raise BadRequest("messages must be a non-empty list of objects")
    raw = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if raw is None:
        raw, key = body.get("max_tokens"), "max_tokens"
    return GenRequest(api=API_CHAT, rid=f"chatcmpl-{uuid.uuid4().hex}",
                      prompt=prompt_from_messages(messages),
                      max_new_tokens=_max_tokens(raw, key), **_openai_common(body))


PARSERS = {"/generate": parse_generate, "/v1/completions": parse_completions,
           "/v1/chat/completions": parse_chat}


# -- replies ------------------------------------------------------------------------------------


def native_finish_reason(c: Completion) -> dict[str, Any]:
    if c.finish == "stop":
        return {"type": "stop", "matched": EOS_TOKEN_ID}
    return {"type": "length", "length": c.n_tokens}


def generate_reply(req: GenRequest, c: Completion, k: int, finished: bool,
                   e2e_latency: float, weight_version: str = "default",
                   spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Native /generate body (and each native stream chunk: cumulative text, k tokens so far).
    `spec`: the speculative-decoding metrics SGLang adds to a finished request's meta_info."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": native_finish_reason(c) if finished else None,
        "prompt_tokens": req.prompt.n_tokens,
        "weight_version": weight_version,
        "completion_tokens": k,
        "cached_tokens": 0,
        "e2e_latency": round(e2e_latency, 6),
        "rehearsal": True,
    }
    if finished and spec:
        meta.update(spec)
    return {"text": c.text_upto(k), "meta_info": meta}


def spec_metrics(completion_tokens: int, drafted_tokens: int, num_draft_tokens: int,
                 accept_length: float) -> dict[str, Any]:
    """meta_info's speculative fields as tokenizer_manager.py `_calculate_spec_decoding_metrics` writes
    them: `drafted_tokens` (the tokens this server produced by verify steps) took
    ceil(drafted / accept_length) verifies; accept length = completion_tokens / verifies (bonus included).
    Empty when no verify ran (SGLang writes nothing then)."""
    verify = math.ceil(drafted_tokens / accept_length) if drafted_tokens > 0 else 0
    if verify == 0 or num_draft_tokens < 2:
        return {}
    proposed = verify * (num_draft_tokens - 1)
    correct = max(0, drafted_tokens - verify)
    return {"spec_accept_rate": correct / proposed, "spec_accept_length": completion_tokens / verify,
            "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed, "spec_verify_ct": verify,
            "spec_accepted_drafts": correct, "spec_proposed_drafts": proposed}


def generate_abort_chunk(req: GenRequest, message: str, status: int) -> dict[str, Any]:
    """What a native stream carries when the scheduler aborts the request (e.g. PD handshake)."""
    return {"text": "", "meta_info": {
        "id": req.rid, "prompt_tokens": req.prompt.n_tokens, "completion_tokens": 0,
        "finish_reason": {"type": "abort", "message": message, "status_code": status},
        "rehearsal": True}}


def usage(req: GenRequest, c: Completion) -> dict[str, Any]:
    return {"prompt_tokens": req.prompt.n_tokens, "completion_tokens": c.n_tokens,
            "total_tokens": req.prompt.n_tokens + c.n_tokens, "prompt_tokens_details": None}


def _openai_finish(c: Completion) -> tuple[str, int | None]:
    return (c.finish, EOS_TOKEN_ID if c.finish == "stop" else None)


def openai_reply(req: GenRequest, c: Completion, model: str, created: int) -> dict[str, Any]:
    finish, matched = _openai_finish(c)
    if req.api == API_CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text,
                                                          "reasoning_content": None,
                                                          "tool_calls": None},
                                  "logprobs": None, "finish_reason": finish,
                                  "matched_stop": matched}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish,
                  "matched_stop": matched}
        obj = "text_completion"
    return {"id": req.rid, "object": obj, "created": created, "model": model,
            "choices": [choice], "usage": usage(req, c), "rehearsal": True}


def openai_chunks(req: GenRequest, c: Completion, model: str, created: int) -> Iterator[tuple[int | None, dict[str, Any]]]:
    """Stream chunks after the first token's delay: yields (token_index_or_None, chunk).

    The caller sleeps before chunks whose index is > 0 (inter-token latency).
    """
    obj = "chat.completion.chunk" if req.api == API_CHAT else "text_completion"
    base = {"id": req.rid, "object": obj, "created": created, "model": model}

    def chunk(delta_text: str | None, finish: str | None, matched: int | None,
              first: bool = False) -> dict[str, Any]:
        if req.api == API_CHAT:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                      "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return {**base, "choices": [choice]}

    if req.api == API_CHAT:
        yield None, chunk("", None, None, first=True)
    for i in range(c.n_tokens):
        yield i, chunk(c.delta(i), None, None)
    finish, matched = _openai_finish(c)
    yield None, chunk(None if req.api == API_CHAT else "", finish, matched)
    if req.include_usage:
        yield None, {**base, "choices": [], "usage": usage(req, c)}


def http_exception_body(status: int, message: str) -> dict[str, Any]:
    """SGLang's HTTPException handler body (used for 5xx aborts such as a failed handshake)."""
    return {"object": "error", "message": message, "type": str(status), "param": None,
            "code": status, "rehearsal": True}


def bad_request_body(api: str, message: str) -> dict[str, Any]:
    """400 body: native /generate uses {"error": {"message"}}, OpenAI routes ErrorResponse."""
    if api == API_GENERATE:
        return {"error": {"message": message}, "rehearsal": True}
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None,
            "code": 400, "rehearsal": True}


def openai_stream_error(message: str, status: int) -> dict[str, Any]:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return {"error": {"object": "error", "message": message, "type": kind, "param": None,
                      "code": status}}


def now() -> int:
    return int(time.time())


# -- info endpoints -----------------------------------------------------------------------------


def server_info(args: Any, active: int, max_running: int = 1024,
                avg_spec_accept_length: float | None = None) -> dict[str, Any]:
    """/server_info: server args (SGLang field names), scheduler info, version, rehearsal flag; with
    speculative decoding, `internal_states[0].avg_spec_accept_length` once a verify ran (scheduler.py)."""
    fields = {k: v for k, v in vars(args).items() if k not in ("ignored", "api_key")}
    state: dict[str, Any] = {"num_running_reqs": active, "rehearsal": True}
    if avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = avg_spec_accept_length
    return {
        **fields,
        "context_length": args.context_length or DEFAULT_CONTEXT_LENGTH,
        "load_balance_method": "round_robin",
        "max_total_num_tokens": 1_000_000,
        "max_running_requests": max_running,
        "internal_states": [state],
        "version": SGLANG_VERSION,
        "kv_events": None,
        "rehearsal": True,
        "ignored_args": list(args.ignored),
    }


def model_info(args: Any) -> dict[str, Any]:
    return {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": args.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "rehearsal": True,
    }


def models_list(args: Any) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(args)]}


def model_card(args: Any) -> dict[str, Any]:
    return {"id": args.model_name, "object": "model", "created": now(), "owned_by": "sglang",
            "root": args.model_name, "parent": None,
            "max_model_len": args.context_length or DEFAULT_CONTEXT_LENGTH}


def get_load(active: int, prompt_tokens_in_flight: int) -> list[dict[str, Any]]:
    """/get_load: one entry per DP rank; the router reads `num_tokens`."""
    return [{"dp_rank": 0, "num_reqs": active, "num_waiting_reqs": 0,
             "num_tokens": prompt_tokens_in_flight, "num_pending_tokens": 0,
             "ts_tic": time.perf_counter()}]
