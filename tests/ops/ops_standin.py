"""A tiny SSE engine with exactly known timing, for checking bench's arithmetic.

It speaks SGLang's streaming `/generate` (cumulative `meta_info.completion_tokens`, `data: [DONE]`)
and nothing else; the rehearsal engine is used for the end-to-end tests.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandIn:
    def __init__(self, ttft_s: float, itl_s: float, tokens_per_event: int = 1, fail_every: int = 0) -> None:
        self.ttft_s, self.itl_s, self.per_event, self.fail_every = ttft_s, itl_s, tokens_per_event, fail_every
        self.count = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.count += 1
                    n = outer.count
                if outer.fail_every and n % outer.fail_every == 0:
                    msg = b'{"error": "boom"}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                total = body["sampling_params"]["max_new_tokens"]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                time.sleep(outer.ttft_s)
                done = 0
                first = True
                while done < total:
                    if not first:
                        time.sleep(outer.itl_s * outer.per_event)
                    step = 1 if first else min(outer.per_event, total - done)
                    first = False
                    done += step
                    ev = {"text": " w" * done, "meta_info": {"completion_tokens": done}}
                    self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
