"""`python -m v4flash_pd.rehearsal.engine <sglang.launch_server argv>`: the rehearsal stand-in.

Serves SGLang 0.5.13's HTTP endpoints on --host/--port, answers deterministically, emulates the PD
bootstrap handshake (prefill serves --disaggregation-bootstrap-port; decode must reach it with the
request's bootstrap_host/port/room) and writes one JSON line per request to stdout so the run's
logs show which room each side saw. Knobs come from V4FLASH_REHEARSAL_* env (see knobs.py).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from v4flash_pd.rehearsal import REHEARSAL_MARK
from v4flash_pd.rehearsal import protocol as P
from v4flash_pd.rehearsal.args import EngineArgs, parse_engine_args, speculative_problem
from v4flash_pd.rehearsal.bootstrap import HandshakeError, Layout, Room, RoomStore, fetch_room, serve_bootstrap
from v4flash_pd.rehearsal.httpbase import JsonHandler, Server, make_server
from v4flash_pd.rehearsal.knobs import KnobError, Knobs, knobs_from_env
from v4flash_pd.rehearsal.textgen import Completion, generate


class Failure(Exception):
    """A request the engine aborts: HTTP status and message, as SGLang would report them."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EngineState:
    """Everything the request handlers share; created once in `run`."""

    def __init__(self, args: EngineArgs, knobs: Knobs) -> None:
        self.args = args
        self.knobs = knobs
        self.started = time.monotonic()
        self.store = RoomStore() if args.disaggregation_mode == "prefill" else None
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._out_lock = threading.Lock()
        self.active = 0
        self.tokens_in_flight = 0
        self._ready_logged = False
        self.spec_tokens = 0  # tokens produced by verify steps, and the verifies (avg_spec_accept_length)
        self.spec_verifies = 0

    @property
    def loading(self) -> bool:
        return time.monotonic() - self.started < self.knobs.load_seconds

    def check_ready_logged(self) -> None:
        if not self.loading and not self._ready_logged:
            self._ready_logged = True
            self.log({"rehearsal": "ready"})

    def log(self, record: dict[str, Any]) -> None:
        record = {"ts": round(time.time(), 3), "role": self.args.role, **record}
        line = json.dumps(record, default=str)
        with self._out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def say(self, text: str) -> None:
        with self._out_lock:
            sys.stdout.write(f"{REHEARSAL_MARK} {text}\n")
            sys.stdout.flush()

    def spec_metrics(self, completion_tokens: int) -> dict[str, Any]:
        """A finished request's speculative meta_info (decode or an aggregated server with the flags on):
        every token after the first came from a verify step, at the knob's accept length."""
        a = self.args
        if not a.speculative or a.role == "prefill" or a.speculative_num_draft_tokens is None:
            return {}
        length = min(self.knobs.accept_length or float(a.speculative_num_draft_tokens),
                     float(a.speculative_num_draft_tokens))
        spec = P.spec_metrics(completion_tokens, completion_tokens - 1, a.speculative_num_draft_tokens, length)
        if spec:
            with self._lock:
                self.spec_tokens += completion_tokens - 1
                self.spec_verifies += spec["spec_verify_ct"]
        return spec

    def avg_accept_length(self) -> float | None:
        with self._lock:
            return self.spec_tokens / self.spec_verifies if self.spec_verifies else None

    def begin(self, tokens: int) -> None:
        with self._lock:
            self.active += 1
            self.tokens_in_flight += tokens

    def end(self, tokens: int) -> None:
        with self._lock:
            self.active -= 1
            self.tokens_in_flight -= tokens


# -- the PD side of a request ---------------------------------------------------------------------


def pd_handshake(state: EngineState, req: P.GenRequest) -> str:
    """Do the role's part of the KV handoff; returns how the first token's delay is accounted.

    Returns 'ttft' when this process pays the time to first token (aggregated server, or a
    transfer-free health-style request), 'prefill' when prefill already paid it (decode), and
    'none' when nothing more is due (prefill, which slept before registering the room).
    Raises Failure with SGLang's status and a message saying which step failed.
    """
    args, knobs = state.args, state.knobs
    mode = args.disaggregation_mode
    if mode == "null":
        return "ttft"
    if req.bootstrap_host == P.FAKE_BOOTSTRAP_HOST or (
            req.bootstrap_room is None and args.disaggregation_transfer_backend == "fake"):
        return "ttft"
    if req.bootstrap_room is None:
        raise Failure(400, "Invalid request: Disaggregated request received without bootstrap "
                           f"room id. req.rid='{req.rid}'")
    room = req.bootstrap_room
    if mode == "prefill":
        assert state.store is not None
        _sleep_ms(state, knobs.ttft_ms)  # "compute the KV"
        state.store.register(Room(room=room, digest=req.prompt.digest,
                                  prompt_tokens=req.prompt.n_tokens,
                                  prefill=f"{args.host}:{args.disaggregation_bootstrap_port}",
                                  registered_at=time.time()))
        state.log({"rehearsal": "room_registered", "bootstrap_room": room,
                   "digest": req.prompt.digest, "rid": req.rid})
        if not state.store.wait_taken(room, knobs.bootstrap_timeout_s):
            raise Failure(500, f"KV transfer failed for request req.rid='{req.rid}' "
                               f"bootstrap_room={room}: no decode fetched it from this prefill's "
                               f"bootstrap server within {knobs.bootstrap_timeout_s:g}s")
        return "none"
    # decode
    port = req.bootstrap_port if req.bootstrap_port is not None else \
        args.disaggregation_bootstrap_port
    prefix = (f"Decode handshake failed for request rank=0 req.rid='{req.rid}' "
              f"req.bootstrap_room={room}")
    if not req.bootstrap_host:
        raise Failure(500, f"{prefix} with exception bootstrap_host is missing")
    try:
        layout, got = fetch_room(req.bootstrap_host, port, room, knobs.waiting_timeout_s)
    except HandshakeError as e:
        raise Failure(500, f"{prefix} with exception {e}") from None
    if got.digest != req.prompt.digest:
        raise Failure(500, f"{prefix} with exception KV mismatch: prefill computed prompt digest "
                           f"{got.digest[:12]} but this request's prompt has "
                           f"{req.prompt.digest[:12]}")
    state.log({"rehearsal": "room_received", "bootstrap_host": req.bootstrap_host,
               "bootstrap_port": port, "bootstrap_room": room, "digest": got.digest,
               "prefill_tp": layout.attn_tp_size, "rid": req.rid})
    return "prefill"


def _sleep_ms(state: EngineState, ms: float) -> None:
    if ms > 0:
        state.stopping.wait(ms / 1000.0)


# -- HTTP ----------------------------------------------------------------------------------------


class EngineHandler(JsonHandler):
    """One stand-in engine's HTTP routes: SGLang's GET routes, its generate and OpenAI routes (POST/PUT),
    its `--api-key` check; `state` is the engine's (set by `make_handler` on a subclass per engine)."""

    state: EngineState

    @property
    def args(self) -> EngineArgs:
        return self.state.args

    def _log(self, status: int, t0: float, **extra: Any) -> None:
        self.state.log({"method": self.command, "path": urlsplit(self.path).path,
                        "status": status, "ms": round((time.monotonic() - t0) * 1000, 1), **extra})

    def _refused(self, path: str, t0: float) -> bool:
        """SGLang's --api-key: every route but /health* and /metrics* wants `Authorization: Bearer KEY`
        (401 otherwise); the router passes its own key on, so only it gets through."""
        key = self.args.api_key
        if not key or path.startswith(("/health", "/metrics")):
            return False
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode()):
            return False
        self.send_json(401, {"error": "Unauthorized"})
        self._log(401, t0)
        return True

    def do_GET(self) -> None:
        t0 = time.monotonic()
        path = urlsplit(self.path).path
        if self._refused(path, t0):
            return
        status = self._get(path)
        self._log(status, t0)

    def do_HEAD(self) -> None:
        self.do_GET()

    def _get(self, path: str) -> int:
        self.state.check_ready_logged()
        if path in ("/health", "/health_generate"):
            ok = not self.state.loading and not self.state.stopping.is_set()
            self.send_bytes(200 if ok else 503, b"", "text/plain")
            return 200 if ok else 503
        if path == "/ping":
            self.send_text(200, "pong")
            return 200
        if path in ("/server_info", "/get_server_info"):
            self.send_json(200, P.server_info(self.args, self.state.active,
                                              avg_spec_accept_length=self.state.avg_accept_length()))
            return 200
        if path in ("/model_info", "/get_model_info"):
            self.send_json(200, P.model_info(self.args))
            return 200
        if path == "/get_load":
            self.send_json(200, P.get_load(self.state.active, self.state.tokens_in_flight))
            return 200
        if path == "/v1/models":
            self.send_json(200, P.models_list(self.args))
            return 200
        if path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
            if name != self.args.model_name:
                self.send_json(404, {"error": {"message": f"The model '{name}' does not "
                                                          "exist", "code": "model_not_found"}})
                return 404
            self.send_json(200, P.model_card(self.args))
            return 200
        if path == "/flush_cache":
            self.send_text(200, "Cache flushed.\n")
            return 200
        self.send_json(404, {"detail": "Not Found"})
        return 404

    def do_POST(self) -> None:
        t0 = time.monotonic()
        path = urlsplit(self.path).path
        try:
            raw = self.read_body()  # read first: the connection may carry the next request
        except (ValueError, OSError) as e:
            self.send_json(400, P.bad_request_body(P.API_GENERATE, str(e)))
            return self._log(400, t0)
        if self._refused(path, t0):
            return
        if path == "/flush_cache":
            self.send_text(200, "Cache flushed.\n")
            return self._log(200, t0)
        parser = P.PARSERS.get(path)
        if parser is None:
            self.send_json(404, {"detail": "Not Found"})
            return self._log(404, t0)
        api = {"/generate": P.API_GENERATE, "/v1/completions": P.API_COMPLETIONS}.get(
            path, P.API_CHAT)
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise P.BadRequest("the request body must be a JSON object")
            req = parser(body)
        except (ValueError, P.BadRequest) as e:
            self.send_json(400, P.bad_request_body(api, str(e)))
            return self._log(400, t0, error=str(e))
        self._generate(req, t0)

    do_PUT = do_POST  # SGLang routes /generate for POST and PUT

    def _generate(self, req: P.GenRequest, t0: float) -> None:
        fields = {"rid": req.rid, "bootstrap_host": req.bootstrap_host,
                  "bootstrap_port": req.bootstrap_port,
                  "bootstrap_room": req.bootstrap_room, "stream": req.stream,
                  "prompt_tokens": req.prompt.n_tokens}
        if self.state.loading:
            self.send_json(503, P.http_exception_body(503, "The server is still loading "
                                                           "(rehearsal load time)."))
            return self._log(503, t0, **fields)
        self.state.begin(req.prompt.n_tokens)
        try:
            status, n, err = self._serve(req, t0)
        except (BrokenPipeError, ConnectionResetError):
            status, n, err = 499, 0, "client disconnected"
        finally:
            self.state.end(req.prompt.n_tokens)
        extra: dict[str, int | str] = {"completion_tokens": n}
        if err:
            extra["error"] = err
        self._log(status, t0, **fields, **extra)

    def _serve(self, req: P.GenRequest, t0: float) -> tuple[int, int, str | None]:
        knobs = self.state.knobs
        try:
            paid = pd_handshake(self.state, req)
        except Failure as f:
            self._fail(req, f)
            return (200 if req.stream else f.status), 0, f.message
        corrupt = max(knobs.corrupt_rate, knobs.spec_corrupt_rate if self.args.speculative else 0.0)
        comp = generate(req.prompt, req.max_new_tokens, req.ignore_eos, corrupt, knobs.natural_tokens)
        if self.args.disaggregation_mode == "prefill" and paid == "none":
            comp = comp.truncated(1)  # prefill computes the first token; decode the rest
        first_ms = knobs.ttft_ms if paid == "ttft" else 0.0
        spec = self.state.spec_metrics(comp.n_tokens)
        if req.stream:
            self._stream(req, comp, t0, first_ms, spec)
        else:
            _sleep_ms(self.state, first_ms + knobs.itl_ms * max(0, comp.n_tokens - 1))
            if req.api == P.API_GENERATE:
                self.send_json(200, P.generate_reply(req, comp, comp.n_tokens, True,
                                                     time.monotonic() - t0,
                                                     self.args.weight_version, spec))
            else:
                self.send_json(200, P.openai_reply(req, comp, req.model or self.args.model_name,
                                                   P.now()))
        return 200, comp.n_tokens, None

    def _fail(self, req: P.GenRequest, f: Failure) -> None:
        """Non-streamed: an error status. Streamed: SGLang has already sent 200 and puts the
        abort into the stream, so do the same."""
        if not req.stream:
            body = (P.bad_request_body(req.api, f.message) if f.status == 400
                    else P.http_exception_body(f.status, f.message))
            return self.send_json(f.status, body)
        self.start_sse()
        if req.api == P.API_GENERATE:
            self.sse(P.generate_abort_chunk(req, f.message, f.status))
        else:
            self.sse(P.openai_stream_error(f.message, f.status))
        self.end_sse()

    def _stream(self, req: P.GenRequest, comp: Completion, t0: float,
                first_ms: float, spec: dict[str, Any]) -> None:
        self.start_sse()
        itl = self.state.knobs.itl_ms
        if req.api == P.API_GENERATE:
            _sleep_ms(self.state, first_ms)
            for k in range(1, comp.n_tokens + 1):
                if k > 1:
                    _sleep_ms(self.state, itl)
                self.sse(P.generate_reply(req, comp, k, k == comp.n_tokens,
                                          time.monotonic() - t0, self.args.weight_version, spec))
            if comp.n_tokens == 0:
                self.sse(P.generate_reply(req, comp, 0, True, time.monotonic() - t0,
                                          self.args.weight_version))
        else:
            model = req.model or self.args.model_name
            for i, chunk in P.openai_chunks(req, comp, model, P.now()):
                if i == 0:
                    _sleep_ms(self.state, first_ms)
                elif i is not None:
                    _sleep_ms(self.state, itl)
                self.sse(chunk)
        self.end_sse()


def make_handler(state: EngineState) -> type[JsonHandler]:
    """The handler class of one engine's server: `EngineHandler` bound to its state."""
    return type("Handler", (EngineHandler,), {"state": state})


# -- process -------------------------------------------------------------------------------------


def _serve_in_thread(server: Server, name: str) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                         name=name, daemon=True)
    t.start()
    return t


def _bind(state: EngineState, what: str, fn: Callable[[], Server]) -> Server | None:
    try:
        return fn()
    except OSError as e:
        state.say(f"error: cannot bind the {what}: {e}")
        return None


def run(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start the stand-in and block until SIGTERM/SIGINT (exit 0) or the crash knob fires."""
    args = parse_engine_args(argv)
    problem = speculative_problem(args)
    if problem:  # the pinned sglang stops in ServerArgs.__post_init__ with this
        print(f"{REHEARSAL_MARK} error: {problem}", file=sys.stderr)
        return 1
    try:
        knobs = knobs_from_env(env)
    except KnobError as e:
        print(f"{REHEARSAL_MARK} error: {e}", file=sys.stderr)
        return 2
    state = EngineState(args, knobs)
    stop = state.stopping
    # The handler only records the signal: it runs in the main thread between two bytecodes, maybe
    # while that thread holds the Event's condition lock inside wait(), so Event.set() there could
    # deadlock. The main thread turns the record into `stop` (the request threads watch it) within
    # one poll (_wait_stop polls in short sleeps, which the signal interrupts).
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signalled.append(signum))

    def _wait_stop(seconds: float) -> bool:
        """Sleep up to `seconds`, True as soon as a stop was signalled (and `stop` is set)."""
        end = time.monotonic() + seconds
        while not signalled:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, 0.05))
        stop.set()
        return True

    servers: list[Server] = []
    if state.store is not None:
        layout = Layout(attn_tp_size=args.tp_size, attn_cp_size=1, dp_size=args.dp_size,
                        pp_size=args.pp_size, page_size=256, kv_cache_dtype=args.kv_cache_dtype)
        boot = _bind(state, f"bootstrap server on {args.host}:{args.disaggregation_bootstrap_port}",
                     lambda: serve_bootstrap(args.host, args.disaggregation_bootstrap_port,
                                             state.store, layout,  # type: ignore[arg-type]
                                             lambda: not state.loading, state.log))
        if boot is None:
            return 1
        servers.append(boot)
    if knobs.bind_delay_s > 0:
        # Real SGLang loads weights before uvicorn binds: the port refuses connections meanwhile.
        state.say(f"loading weights (rehearsal): HTTP port opens in {knobs.bind_delay_s:g}s")
        if _wait_stop(knobs.bind_delay_s):
            for s in servers:
                s.server_close()
            return 0
        state.started = time.monotonic()
    http = _bind(state, f"HTTP server on {args.host}:{args.port}",
                 lambda: make_server(args.host, args.port, make_handler(state)))
    if http is None:
        for s in servers:
            s.server_close()
        return 1
    servers.append(http)

    boot_txt = (f" bootstrap={args.host}:{args.disaggregation_bootstrap_port}"
                if state.store is not None else "")
    spec_txt = (f"speculative={args.speculative_algorithm}:{args.speculative_num_steps}/"
                f"{args.speculative_eagle_topk}/{args.speculative_num_draft_tokens} " if args.speculative else "")
    state.say(f"v4flash-pd rehearsal stand-in for sglang.launch_server (NOT a real engine): "
              f"role={args.role} http={args.host}:{args.port}{boot_txt} tp={args.tp_size} "
              f"model={args.model_name} transfer_backend={args.disaggregation_transfer_backend} {spec_txt}"
              f"pid={os.getpid()} load_seconds={knobs.load_seconds:g}")
    state.log({"rehearsal": "started", "host": args.host, "port": args.port,
               "bootstrap_port": args.disaggregation_bootstrap_port if state.store else None,
               "tp_size": args.tp_size, "pid": os.getpid(),
               "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "ignored_args": len(args.ignored)})
    for i, s in enumerate(servers):
        _serve_in_thread(s, f"http-{i}")

    deadline = None if knobs.crash_after_s is None else time.monotonic() + knobs.crash_after_s
    ready_said = False
    while not _wait_stop(0.0):
        if not ready_said and not state.loading:
            ready_said = True
            state.check_ready_logged()
            state.say("The server is fired up and ready to roll! (rehearsal)")
        if deadline is not None and time.monotonic() >= deadline:
            state.say(f"crashing on purpose after {knobs.crash_after_s:g}s "
                      f"(V4FLASH_REHEARSAL_CRASH_AFTER_S), exit {knobs.crash_exit_code}")
            os._exit(knobs.crash_exit_code)
        _wait_stop(0.05)

    state.say("received a stop signal, shutting down")
    if knobs.stop_delay_s:
        state.say(f"taking {knobs.stop_delay_s:g}s to stop (V4FLASH_REHEARSAL_STOP_DELAY_S)")
        time.sleep(knobs.stop_delay_s)
    for s in servers:
        s.shutdown()
        s.server_close()
    state.log({"rehearsal": "stopped"})
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
