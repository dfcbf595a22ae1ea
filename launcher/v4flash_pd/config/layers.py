"""Layers: defaults < profile < file < V4FLASH_SET < V4FLASH_<OPTION> < --set < --<option>, as one raw dict.

Layers are merged as plain dicts first and typed once at the end (`build.build_config`), so every
layer speaks the same vocabulary (the keys of a config file) and every error can name the key and
its source. Role lists (`prefill`, `decode`, `server`) merge element-wise by index: a file that sets
`[[decode]] cuda_graph_max_bs = 16` tweaks the profile's decode worker instead of replacing it, and
a second `[[prefill]]` entry adds a second prefill worker (2P1D is a config change, not code).
"""

from __future__ import annotations

import copy
import datetime
import os
from pathlib import Path
from typing import Any, Mapping

from v4flash_pd.config.keys import DEFAULTS, KEY, ROLES
from v4flash_pd.errors import UserError
from v4flash_pd.profiles import DEFAULT_PROFILE, get_profile
from v4flash_pd.textfile import read_text_file, toml

# (raw config, profile name, the layers it came from): what `build.build_config` takes.
Layers = tuple[dict[str, Any], str, tuple[str, ...]]


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `over` into a copy of `base`: dicts recursively, role lists by index, env tables as a union."""
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if key in ROLES and isinstance(value, list):
            cur = list(out.get(key) or [])
            for i, item in enumerate(value):
                if not isinstance(item, Mapping):
                    raise UserError(f"config key {key}.{i} must be a table, got {item!r}",
                                    f"write it as [[{key}]] with keys like gpus = [0, 1] and port = 30000")
                if i < len(cur):
                    cur[i] = deep_merge(cur[i], item)
                else:
                    cur.append(copy.deepcopy(dict(item)))
            out[key] = cur
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict) and key != "env":
            out[key] = deep_merge(out[key], value)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):  # env: union
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_value(text: str) -> Any:
    """A `--set` value: TOML syntax when it parses (numbers, bools, lists), else a plain string.

    TOML dates and times come back as the text typed: no config key takes a date, and
    `--set model.served_name=2026-11-29` means that string, not a `datetime.date`.
    """
    reader = toml()
    try:
        value = reader.loads(f"v = {text}")["v"]
    except reader.TOMLDecodeError:
        return text
    return text if isinstance(value, (datetime.date, datetime.time)) else value


def set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply `a.b.0.c=value` to the raw dict (`prefill.0.port=31000`, `env.UCX_TLS=tcp`)."""
    parts = dotted.split(".")
    if not all(parts):
        raise UserError(f"cannot apply override {dotted!r}: empty key segment",
                        "write dotted keys like router.port=9000 or decode.0.env.UCX_TLS=tcp")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            idx = _index(part, dotted, len(node))
            if idx == len(node):
                node.append({})
            node = node[idx]
        elif isinstance(node, dict):
            if part not in node or node[part] is None:
                node[part] = [] if part in ROLES else {}
            node = node[part]
        else:
            _not_a_table(dotted, parts[:i])
    if not isinstance(node, (list, dict)):
        _not_a_table(dotted, parts[:-1])
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(last, dotted, len(node))
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    else:
        node[last] = value


def _not_a_table(dotted: str, prefix: list[str]) -> None:
    where = ".".join(prefix)
    raise UserError(f"cannot apply override {dotted!r}: {where} is a single value, not a table",
                    f"set {where} itself (--set {where}=VALUE), or use a key that has sub-keys, e.g. router.port")


def _index(part: str, dotted: str, length: int) -> int:
    if not part.isdigit() or int(part) > length:
        raise UserError(f"cannot apply override {dotted!r}: {part!r} is not a valid list index",
                        f"role lists are indexed from 0 and may grow by one, e.g. --set decode.{length}.port=30002")
    return int(part)


def split_set_items(text: str) -> list[str]:
    """Split V4FLASH_SET on whitespace outside quotes and brackets, so TOML values written the
    natural way survive: `prefill.0.extra_args=["--chunked-prefill-size", "8192"] env.X="a b"`."""
    items: list[str] = []
    cur: list[str] = []
    quote = ""
    depth = 0
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch.isspace() and depth == 0:
            if cur:
                items.append("".join(cur))
                cur = []
            continue
        cur.append(ch)
    if cur:
        items.append("".join(cur))
    return items


def parse_overrides(items: list[str] | tuple[str, ...], source: str) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        if "=" not in item:
            raise UserError(f"{source}: override {item!r} is not KEY=VALUE",
                            "write overrides like --set router.port=9000 or --set decode.0.env.UCX_TLS=tcp")
        key, _, value = item.partition("=")
        out.append((key.strip(), parse_value(value.strip())))
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    text = read_text_file(path, "config file",
                          "pass an existing TOML file with --config, or drop --config to use the profile alone")
    reader = toml()
    try:
        return dict(reader.loads(text))
    except reader.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}",
                        "fix the syntax at the line shown (TOML: key = value, [table], [[prefill]])") from None


def merged_layers(
    config_file: Path | str | None = None,
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    sets: tuple[str, ...] = (),
    base: tuple[Mapping[str, Any], str] | None = None,
    env_overrides: Mapping[str, Any] | None = None,
    rehearsal: bool = False,
) -> Layers:
    """Every layer merged into one raw dict (the vocabulary of a config file), not yet validated.

    In order: defaults < profile < file < V4FLASH_SET < `env_overrides` (typed options given by their
    V4FLASH_<OPTION> variable) < `sets` (--set items) < `overrides` (typed options on the command
    line), both as dotted keys, e.g. {"model.path": "/m"}. `base` = (raw, profile) of a cluster plan
    file: it stands in for defaults < profile < file, so a box starts exactly the config that was
    rendered; env and flags still go on top. `rehearsal` adds `loopback_layer` over the profile (a
    one-box rehearsal listens on 127.0.0.1 unless a later layer says otherwise); a cluster keeps the
    profile's addresses.
    """
    env = os.environ if env is None else env
    sources = ["defaults"]
    if base is not None:
        raw = deep_merge(DEFAULTS, base[0])
        prof_name = base[1]
        sources.append("cluster-plan")
    else:
        file_raw: dict[str, Any] = {}
        if config_file:
            file_raw = read_config_file(Path(config_file))
        file_profile = file_raw.pop("profile", None)
        if file_profile is not None and not isinstance(file_profile, str):
            raise UserError(f"config key profile must be a profile name, got {file_profile!r}",
                            f'write profile = "{DEFAULT_PROFILE}" (or drop it)')
        prof_name = profile or file_profile or DEFAULT_PROFILE
        raw = deep_merge(DEFAULTS, get_profile(prof_name))
        sources.append(f"profile:{prof_name}")
        if rehearsal:
            raw = deep_merge(raw, loopback_layer(raw))
            sources.append("rehearsal:loopback")
        if file_raw:
            raw = deep_merge(raw, file_raw)
            sources.append(f"file:{config_file}")
    env_sets = split_set_items(env.get("V4FLASH_SET", ""))
    for key, value in parse_overrides(env_sets, "V4FLASH_SET"):
        set_path(raw, key, value)
    if env_sets:
        sources.append("env:V4FLASH_SET")
    if set_keys(raw, env_overrides):
        flags = (KEY[path].flag for path in env_overrides or {} if path in KEY)
        sources.append("env:" + ",".join(f.env for f in flags if f is not None))
    for key, value in parse_overrides(list(sets), "--set"):
        set_path(raw, key, value)
    if set_keys(raw, overrides) or sets:
        sources.append("flags")
    if rehearsal and (raw.get("cluster") or {}).get("boxes"):  # other boxes must reach a cluster's listeners
        return merged_layers(config_file, profile, overrides, env, sets, base, env_overrides, rehearsal=False)
    return raw, prof_name, tuple(sources)


# A rehearsal (and so `make demo`) listens on 127.0.0.1 by default: the profiles put the router (or the
# aggregated server) on 0.0.0.0 for the GPU box, and a rehearsal on a laptop or a CI runner has no
# reason to offer an unauthenticated endpoint to its network.
WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK = "127.0.0.1"


def loopback_layer(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The raw layer that moves the profile's wildcard listeners to 127.0.0.1 (it sits right above the
    profile: a config file, V4FLASH_SET or a flag that names the address wins)."""
    layer: dict[str, Any] = {}
    router = raw.get("router")
    if isinstance(router, Mapping) and router.get("host") in WILDCARDS:
        layer["router"] = {"host": LOOPBACK}
    for role in ROLES:
        entries = raw.get(role)
        if isinstance(entries, list) and entries:
            moved = [{"host": LOOPBACK} if isinstance(e, Mapping) and e.get("host") in WILDCARDS else {}
                     for e in entries]
            if any(moved):
                layer[role] = moved
    return layer


def set_keys(raw: dict[str, Any], overrides: Mapping[str, Any] | None) -> bool:
    """Set every given (not None) dotted key in `raw`; whether any was."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    for key, value in given.items():
        set_path(raw, key, value)
    return bool(given)
