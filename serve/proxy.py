"""A logging proxy in front of an OpenAI-compatible engine (vLLM's server): it forwards
completions and chat completions, writes one JSON line per answered request,
`{"request": <body>, "response": <engine's response>, "time", "upstream"}` (what
`specdistill convert-traffic --from vllm` reads), and lets a deployment swap the engine
behind it without failing a client's request.

    proxy = LoggingProxy("http://127.0.0.1:8001", Path("proxy-log.jsonl"))
    url = proxy.start("127.0.0.1", 8000)        # clients talk to this
    ...                                          # a second engine is up on :8002
    proxy.switch("http://127.0.0.1:8002")        # new requests go there
    proxy.drain("http://127.0.0.1:8001", 120)    # the old one's requests have finished
    proxy.stop()

A swap: requests already sent to the old engine finish there; a request whose connection to
its engine is refused (the engine went away before the request reached it) is sent again to
whichever engine is current, until `retry_s` has passed. Bounded: a body larger than
`max_body` is refused (413), more than `max_in_flight` requests at once are refused (503),
`stream: true` is refused (400: the log keeps whole responses); the engine's own 4xx answers
are passed through unlogged. Errors are OpenAI-shaped.
"""

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from specdistill.serve.errors import error_body

PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARDED_HEADERS = ("Authorization", "Content-Type")


class LoggingProxy:
    """The proxy's state: the current engine, requests in flight per engine, the log."""

    def __init__(
        self,
        upstream: str,
        log: Path,
        *,
        max_body: int = 1 << 20,
        max_in_flight: int = 64,
        timeout: float = 600.0,
        retry_s: float = 60.0,
    ):
        self.log = Path(log)
        self.max_body, self.max_in_flight = max_body, max_in_flight
        self.timeout, self.retry_s = timeout, retry_s
        self._upstream = upstream.rstrip("/")
        self._lock = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self.counts = {"answered": 0, "logged": 0, "refused": 0, "upstream_errors": 0, "retries": 0}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the deployment's side
    @property
    def upstream(self) -> str:
        with self._lock:
            return self._upstream

    def switch(self, upstream: str) -> str:
        """New requests go to `upstream`; returns the engine they went to before."""
        with self._lock:
            old, self._upstream = self._upstream, upstream.rstrip("/")
            return old

    def in_flight(self, upstream: str) -> int:
        with self._lock:
            return self._in_flight.get(upstream.rstrip("/"), 0)

    def drain(self, upstream: str, timeout: float) -> bool:
        """Wait until no request is in flight to `upstream`; False when `timeout` passed."""
        deadline = time.monotonic() + timeout
        key = upstream.rstrip("/")
        with self._lock:
            while self._in_flight.get(key, 0) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        proxy = self

        class Handler(ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return f"http://{host}:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ a request's side
    def _enter(self) -> str | None:
        """The engine this request goes to, counted in flight; None when the proxy is full."""
        with self._lock:
            if sum(self._in_flight.values()) >= self.max_in_flight:
                return None
            self._in_flight[self._upstream] = self._in_flight.get(self._upstream, 0) + 1
            return self._upstream

    def _leave(self, upstream: str) -> None:
        with self._lock:
            self._in_flight[upstream] -= 1
            self._lock.notify_all()

    def forward(self, path: str, body: bytes, headers: dict) -> tuple[int, bytes, str | None]:
        """(status, response body, the engine that answered) for one request; a refused
        connection is retried on the current engine until `retry_s` has passed."""
        deadline = time.monotonic() + self.retry_s
        while True:
            upstream = self._enter()
            if upstream is None:
                return 503, _error(503, "the proxy is at its limit of requests in flight"), None
            try:
                return (*_post(upstream + path, body, headers, self.timeout), upstream)
            except urllib.error.URLError as e:
                if not _refused(e) or time.monotonic() >= deadline:
                    self.count("upstream_errors")
                    return 502, _error(502, f"the engine did not answer: {e.reason}"), None
                self.count("retries")
                time.sleep(0.5)
            finally:
                self._leave(upstream)

    def record(self, request: dict, response: bytes, upstream: str) -> None:
        """Append one answered pair to the log (one line, written whole under the lock)."""
        try:
            parsed = json.loads(response)
        except ValueError:
            return
        line = json.dumps(
            {"request": request, "response": parsed, "time": time.time(), "upstream": upstream}
        )
        with self._lock:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(line + "\n")
            self.counts["logged"] += 1

    def count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1


def _post(url: str, body: bytes, headers: dict, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:  # the engine's own answer: passed through
        return e.code, e.read()


def _refused(error: urllib.error.URLError) -> bool:
    """Whether the request never reached an engine (nothing listens, or it went away)."""
    return isinstance(error.reason, ConnectionRefusedError | ConnectionResetError)


def _error(status: int, message: str, param: str | None = None) -> bytes:
    return error_body(status, message, param).model_dump_json().encode()


class ProxyHandler(BaseHTTPRequestHandler):
    """One HTTP request to the proxy (`owner`: the `LoggingProxy`)."""

    owner: LoggingProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the log file is the record

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, message: str, param: str | None = None) -> None:
        self.owner.count("refused")
        self.close_connection = True
        self._send(status, _error(status, message, param))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            self._send(200, b'{"status": "ok"}')
        else:
            self._refuse(404, f"no route GET {self.path[:100]}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path not in PATHS:
            self._refuse(404, f"no route POST {self.path[:100]}")
            return
        request = self._body()
        if request is None:
            return
        headers = {k: self.headers[k] for k in FORWARDED_HEADERS if self.headers.get(k)}
        raw = json.dumps(request).encode()
        status, answer, upstream = self.owner.forward(self.path, raw, headers)
        if status == 200 and upstream is not None:
            self.owner.record(request, answer, upstream)
            self.owner.count("answered")
        self._send(status, answer)

    def _body(self) -> dict | None:
        """The request's JSON object, or None after refusing it."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._refuse(411, "a request needs a Content-Length")
            return None
        if int(length) > self.owner.max_body:
            self._refuse(413, f"the body is larger than {self.owner.max_body} bytes")
            return None
        try:
            request = json.loads(self.rfile.read(int(length)))
        except (ValueError, UnicodeDecodeError):
            self._refuse(400, "the body is not JSON")
            return None
        if not isinstance(request, dict):
            self._refuse(400, "the body must be a JSON object")
            return None
        if request.get("stream"):
            self._refuse(400, "stream is not supported: the log keeps whole responses", "stream")
            return None
        return request
