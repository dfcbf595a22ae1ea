"""Small HTTP/1.1 plumbing shared by the stand-in's two servers (stdlib only).

HTTP/1.1 with Content-Length (and chunked encoding for SSE) because the router's client pools
keep-alive connections; an HTTP/1.0 close-per-request server would work but hides pooling bugs.
"""

from __future__ import annotations

import json
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from v4flash_pd.rehearsal import REHEARSAL_HEADER

MAX_BODY = 64 * 1024 * 1024


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class Server6(Server):
    address_family = socket.AF_INET6


def make_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> Server:
    """Bind like uvicorn does: IPv6 literal hosts get an AF_INET6 socket."""
    host = host.strip("[]")
    cls = Server6 if ":" in host else Server
    return cls((host, port), handler)


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Idle keep-alive connections are closed after this long (uvicorn closes after 5 s; a bit
    # longer here so slow SSE readers are not cut off), so pooled router connections cannot
    # pin handler threads forever.
    timeout = 30
    server_version = "v4flash-rehearsal"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: the engine writes one JSON line per request itself."""

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"request body too large ({n} bytes)")
        return self.rfile.read(n) if n > 0 else b""

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()
            if len(out) > MAX_BODY:
                raise ValueError("request body too large")

    def send_bytes(self, status: int, data: bytes, content_type: str,
                   headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header(REHEARSAL_HEADER, "1")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

    def send_text(self, status: int, text: str) -> None:
        self.send_bytes(status, text.encode(), "text/plain; charset=utf-8")

    # SSE over chunked transfer encoding
    def start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header(REHEARSAL_HEADER, "1")
        self.end_headers()

    def sse(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self._chunk(f"data: {data}\n\n".encode())

    def end_sse(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()
