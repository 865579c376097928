"""uvicorn for `specdistill serve`: the app on a background thread (`HttpServer.start`: tests,
benchmarks) or in the foreground (`HttpServer.run`: the command line).

Binding beyond loopback without an API key is refused (serve/auth.py `check_bind`). On
SIGTERM or SIGINT uvicorn stops accepting and gives running requests `drain_s` seconds; a
signal it drained for is not raised again afterwards, so `run` returns and the process
exits 0.
"""

import contextlib
import signal
import socket
import threading
import time

import uvicorn

from specdistill.serve.auth import ApiKeys, check_bind

START_TIMEOUT_S = 30  # a background server that has not started by then is an error
STOP_MARGIN_S = 10  # beyond drain_s, how long `stop` waits for the HTTP thread


class Uvicorn(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT it drained for is not raised again
    afterwards: `serve` returns and the process exits 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class HttpServer:
    """uvicorn serving `app` with the keys it checks, `insecure` (serving beyond loopback
    without a key allowed) and `drain_s` (the graceful shutdown's seconds)."""

    def __init__(self, app, keys: ApiKeys, insecure: bool, drain_s: float):
        self.app, self.keys, self.insecure, self.drain_s = app, keys, insecure, drain_s
        self.server = None  # the background server, once started
        self.thread: threading.Thread | None = None

    def config(self, host: str, log_level: str, **kwargs):
        """uvicorn's configuration for `host`, once the bind is allowed."""
        check_bind(host, self.keys, self.insecure)
        return uvicorn.Config(
            self.app,
            host=host,
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=self.drain_s,
            **kwargs,
        )

    def listen(self, host: str, port: int) -> tuple[object, socket.socket]:
        """(configuration, bound socket) of a background server (port 0: a free port)."""
        config = self.config(host, "warning")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return config, sock

    def start(self, config, sock: socket.socket) -> str:
        """Serve on `sock` on a background thread; the base URL once it answers."""
        host, port = config.host, sock.getsockname()[1]
        self.server = Uvicorn(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name="specdistill-http",
        )
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return f"http://{host}:{port}"

    def run(self, config) -> None:
        """Serve in the foreground until SIGTERM or SIGINT, then drain."""
        Uvicorn(config).run()

    def stop(self) -> None:
        """End the background server (running requests get `drain_s` seconds)."""
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=STOP_MARGIN_S + self.drain_s)
