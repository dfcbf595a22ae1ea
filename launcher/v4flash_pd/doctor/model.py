"""Model directory checks that fail in milliseconds instead of minutes into weight loading.

A half-copied shard is the classic air-gap failure. Each safetensors file states its own size
(an 8-byte header length, a JSON header, tensors at explicit offsets), so a truncated shard is
caught from its header even without a manifest; with a bundle manifest sizes are compared too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from v4flash_pd.doctor.context import DoctorInput
from v4flash_pd.doctor.result import Check, error, ok, skip, warn

INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


def safetensors_problem(path: Path) -> str:
    """'' when the file's size matches what its header promises, else one sentence."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"{path.name}: {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                return f"{path.name}: header length {n} does not fit in {size} bytes (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except OSError as exc:
        return f"{path.name}: cannot read ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError):
        return f"{path.name}: header is not valid JSON (corrupt)"
    ends = [int(v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    want = 8 + n + (max(ends) if ends else 0)
    if size < want:
        return f"{path.name}: truncated, {size} bytes but its header needs {want}"
    if size > want:
        return f"{path.name}: {size - want} unexpected trailing bytes (header says {want})"
    return ""


def _read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except (OSError, ValueError) as exc:
        return None, f"{path.name} is not readable JSON ({exc})"
    if not isinstance(data, dict):
        return None, f"{path.name} is not a JSON object"
    return data, ""


def check_dir(model: Path) -> Check:
    if not model.is_dir():
        return error("model-dir", f"{model} does not exist or is not a directory",
                     "set model.path (--model / V4FLASH_MODEL) to the checkpoint directory, or load the "
                     "bundle's weights (`v4flash-pd bundle load --model`)")
    cfg, why = _read_json(model / "config.json")
    if cfg is None:
        return error("model-dir", f"{model}: {why}",
                     "point model.path at the Hugging Face checkpoint directory (the one with config.json)")
    arch = ",".join(cfg.get("architectures") or []) or cfg.get("model_type", "?")
    return ok("model-dir", f"{model} ({arch})")


def check_tokenizer(model: Path, tokenizer: Path) -> Check:
    names = {p.name for p in tokenizer.iterdir()} if tokenizer.is_dir() else set()
    if not names:
        return error("model-tokenizer", f"tokenizer dir {tokenizer} does not exist",
                     "set model.tokenizer_path to a local directory (offline boxes cannot fetch a repo id)")
    if not ({"tokenizer.json", "tokenizer.model"} & names):
        return error("model-tokenizer", f"{tokenizer} has neither tokenizer.json nor tokenizer.model",
                     "copy the tokenizer files from the checkpoint (the model download is incomplete)")
    tcfg, _ = _read_json(tokenizer / "tokenizer_config.json")
    has_template = "chat_template.jinja" in names or bool(tcfg and tcfg.get("chat_template"))
    if tcfg is None:
        return warn("model-tokenizer", f"{tokenizer} has no readable tokenizer_config.json",
                    "copy tokenizer_config.json from the checkpoint; without it special tokens may be wrong")
    if not has_template:
        return warn("model-tokenizer", f"{tokenizer}: no chat template (tokenizer_config.json or chat_template.jinja)",
                    "copy chat_template.jinja from the checkpoint; transformers may try to fetch it even "
                    "offline (transformers#42914) and /v1/chat/completions needs it")
    return ok("model-tokenizer", f"{tokenizer}: tokenizer files and chat template present")


def check_weights(model: Path) -> Check:
    index, why = _read_json(model / INDEX)
    if index is None and (model / INDEX).exists():
        return error("model-weights", f"{model}/{why}", "re-copy the index from the checkpoint")
    if index is not None:
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            return error("model-weights", f"{INDEX} has no weight_map", "re-copy the index from the checkpoint")
        shards = sorted(set(map(str, wm.values())))
    else:
        shards = sorted(p.name for p in model.glob("*.safetensors"))
        if not shards:
            return error("model-weights", f"{model} has no {INDEX} and no *.safetensors",
                         "the weights are missing: copy or `bundle load --model` them")
    missing = [s for s in shards if not (model / s).is_file()]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        return error("model-weights", f"{len(missing)} of {len(shards)} shard(s) named by the index are missing: "
                                      f"{', '.join(missing[:5])}{more}",
                     "finish the copy (rsync -a --partial) or re-run `v4flash-pd bundle load --model`")
    bad = [p for p in (safetensors_problem(model / s) for s in shards if s.endswith(".safetensors")) if p]
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        return error("model-weights", "; ".join(bad[:3]) + more,
                     "re-copy those shards (a copy was interrupted); verify with "
                     "`v4flash-pd bundle verify` or sha256sum against the source")
    total = sum((model / s).stat().st_size for s in shards)
    return ok("model-weights", f"{len(shards)} shard(s), {total / 2**30:.1f} GiB, headers consistent with sizes")


def check_manifest(model: Path) -> Check:
    try:
        from v4flash_pd.bundle.preflight import check_model_against_manifest, find_manifest
    except ImportError as exc:
        return skip("model-manifest", f"bundle support not importable ({exc})")
    path = find_manifest(model)
    if path is None:
        return skip("model-manifest", "no model manifest (written by `bundle create/load --model`)")
    try:
        problems = check_model_against_manifest(model)
    except Exception as exc:  # a manifest we cannot read is a finding, not a crash
        return error("model-manifest", f"{path}: {exc}", "regenerate it with `v4flash-pd bundle create --model`")
    if problems:
        more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
        return error("model-manifest", f"differs from {path.name}: " + "; ".join(problems[:4]) + more,
                     "re-copy the listed files from the bundle (`v4flash-pd bundle load --model`), then "
                     "`v4flash-pd bundle verify`")
    return ok("model-manifest", f"sizes match {path}")


def run(inp: DoctorInput) -> list[Check]:
    e = inp.expect
    if not e.model_path:
        return [error("model-dir", "no model path configured", "set model.path, --model or V4FLASH_MODEL")]
    model = Path(e.model_path)
    first = check_dir(model)
    if first.status == "error" and not model.is_dir():
        return [first] + [skip(n, "model dir missing") for n in ("model-tokenizer", "model-weights", "model-manifest")]
    tok = Path(e.tokenizer_path) if e.tokenizer_path else model
    return [first, check_tokenizer(model, tok), check_weights(model), check_manifest(model)]
