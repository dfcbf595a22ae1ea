"""PD bootstrap emulation: prefill's bootstrap server and decode's side of the handshake.

Real SGLang (0.5.13, disaggregation/common/conn.py): the prefill server runs an HTTP bootstrap
server on `--disaggregation-bootstrap-port` (bound to `--host`, prefill only); decode, given the
router-injected bootstrap_host/port/room, asks it (`GET /route?...=-1`) for prefill's layout and
then receives the KV for that room. Here the "KV" is a digest of the prompt: prefill registers
the room with the digest, decode fetches the room over HTTP and checks the digest, so a wrong
host, port or room fails exactly where it would on the GPU box.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, TypeVar
from urllib.parse import parse_qs, urlsplit

from v4flash_pd.httpclient import Reply, request
from v4flash_pd.poll import poll_until
from v4flash_pd.rehearsal.httpbase import JsonHandler, Server, make_server

_T = TypeVar("_T")
ROOM_PATH = "/rehearsal/room/"
_LAYOUT_QUERY = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


class HandshakeError(Exception):
    """Decode could not get the room's KV from prefill; the message says why."""


@dataclass(frozen=True)
class Room:
    """What prefill publishes for one bootstrap room (the stand-in's KV cache)."""

    room: int
    digest: str
    prompt_tokens: int
    prefill: str
    registered_at: float


class RoomStore:
    """Thread-safe, bounded map room -> Room, with waiting in both directions.

    Decode long-polls for a room to appear; prefill waits until decode has taken it (the real
    prefill keeps the request open until the KV transfer to decode is done).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._cond = threading.Condition()
        self._rooms: OrderedDict[int, Room] = OrderedDict()
        self._taken: set[int] = set()
        self._capacity = capacity

    def register(self, room: Room) -> None:
        with self._cond:
            self._rooms[room.room] = room
            self._rooms.move_to_end(room.room)
            self._taken.discard(room.room)
            while len(self._rooms) > self._capacity:
                old, _ = self._rooms.popitem(last=False)
                self._taken.discard(old)
            self._cond.notify_all()

    def take(self, room: int, wait_s: float) -> Room | None:
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._cond:
            while room not in self._rooms:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            self._taken.add(room)
            self._cond.notify_all()
            return self._rooms[room]

    def wait_taken(self, room: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while room not in self._taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def __len__(self) -> int:
        with self._cond:
            return len(self._rooms)


@dataclass(frozen=True)
class Layout:
    """Prefill's parallel layout as the real bootstrap server reports it (PrefillServerInfo)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_cache_dtype: str
    follow_bootstrap_room: bool = True


def serve_bootstrap(host: str, port: int, store: RoomStore, layout: Layout,
                    is_ready: Callable[[], bool], log: Callable[[dict[str, Any]], None]) -> Server:
    """Bind prefill's bootstrap server (not started: the caller runs serve_forever)."""

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/health":
                return self.send_text(200, "OK")
            if url.path == "/route":
                return self._route(parse_qs(url.query))
            if url.path.startswith(ROOM_PATH):
                return self._room(url.path[len(ROOM_PATH):], parse_qs(url.query))
            self.send_text(404, "Not Found")

        def do_PUT(self) -> None:
            self.read_body()
            self.send_text(200 if urlsplit(self.path).path == "/route" else 404, "OK")

        def _route(self, q: dict[str, list[str]]) -> None:
            keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
            if not all(q.get(k) for k in keys):
                return self.send_text(400, "Missing inputs for bootstrap server.")
            if not is_ready():
                return self.send_text(503, "Prefill server not fully registered yet "
                                           "(0 workers registered).")
            if all(q[k][0] == "-1" for k in keys):
                return self.send_json(200, {**asdict(layout), "rehearsal": True})
            return self.send_json(200, {"rank_ip": host, "rank_port": port, "rehearsal": True})

        def _room(self, raw: str, q: dict[str, list[str]]) -> None:
            try:
                room = int(raw)
                wait = min(float(q.get("wait", ["0"])[0]), 10.0)
            except ValueError:
                return self.send_json(400, {"error": f"bad room or wait in {self.path!r}"})
            got = store.take(room, wait)
            if got is None:
                return self.send_json(404, {"error": f"bootstrap_room {room} is not registered",
                                            "rehearsal": True})
            log({"rehearsal": "room_fetched", "bootstrap_room": room, "digest": got.digest,
                 "peer": self.client_address[0]})
            self.send_json(200, {**asdict(got), "rehearsal": True})

    return make_server(host, port, Handler)


def _get(host: str, port: int, path: str, timeout: float) -> Reply:
    host = host.strip("[]")
    return request(f"http://{'[' + host + ']' if ':' in host else host}:{port}{path}", timeout=timeout)


def _decode(rep: Reply, cls: type[_T], last: list[str]) -> _T | None:
    """A 200 reply's JSON as dataclass `cls`; None (and why, in last[0]) when it does not fit."""
    try:
        d = rep.json()
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})  # type: ignore[attr-defined]
    except (ValueError, KeyError, TypeError) as e:
        last[0] = f"{type(e).__name__}: {e}"
        return None


def _why(rep: Reply) -> str:
    return f"HTTP {rep.status}: {rep.body[:200]}" if rep.status else f"no answer ({rep.kind}): {rep.error}"


def fetch_room(host: str, port: int, room: int, timeout_s: float,
               retry_s: float = 0.05) -> tuple[Layout, Room]:
    """Decode's handshake: ask prefill's bootstrap server for its layout, then for the room.

    Bounded by `timeout_s` overall, like SGLANG_DISAGGREGATION_WAITING_TIMEOUT bounds the real one.
    Raises HandshakeError naming the step and the address that failed.
    """
    deadline = time.monotonic() + timeout_s
    where = f"bootstrap server {host}:{port}"
    last = ["no attempt made"]

    def left() -> float:
        return max(0.01, deadline - time.monotonic())

    def get_layout() -> Layout | None:
        rep = _get(host, port, "/route?" + _LAYOUT_QUERY, min(left(), 2.0))
        if rep.status == 200:
            return _decode(rep, Layout, last)
        last[0] = _why(rep)
        return None

    layout = poll_until(get_layout, timeout_s, retry_s)
    if layout is None:
        raise HandshakeError(f"could not get prefill's layout from {where} within {timeout_s:g}s: {last[0]}")

    def get_room() -> Room | None:
        wait = min(left(), 1.0)
        rep = _get(host, port, f"{ROOM_PATH}{room}?wait={wait:.3f}", wait + 2.0)
        if rep.status == 200:
            return _decode(rep, Room, last)
        last[0] = f"HTTP {rep.status}" if rep.status else _why(rep)
        return None

    got = poll_until(get_room, deadline - time.monotonic(), retry_s)
    if got is None:
        raise HandshakeError(f"bootstrap_room {room} never appeared on {where} within "
                             f"{timeout_s:g}s (last: {last[0]})")
    return layout, got
