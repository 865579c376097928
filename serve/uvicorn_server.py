"""uvicorn's server for `specdistill serve`: a SIGTERM or SIGINT it drained for is not raised
again afterwards, so `Server.serve` returns and the process exits 0."""

import contextlib
import signal
import threading


def _uvicorn_server_class():
    import uvicorn

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

    return Uvicorn


def _Uvicorn(config):  # noqa: N802 - built lazily: uvicorn is imported on first use
    return _uvicorn_server_class()(config)
