"""Running the app with uvicorn: in the foreground (``llminfer serve``) or in a background thread (tests,
notebooks, examples)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn settings llminfer uses: lifespan on, no access log (the app logs one line per request)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
                          timeout_graceful_shutdown=10)


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` until Ctrl-C or SIGTERM, then shut down gracefully and return.

    Raises:
        SystemExit: uvicorn could not start (for example the port is in use; the reason is logged).
    """
    try:
        uvicorn.Server(uvicorn_config(app, host, port, log_level)).run()
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it handled; the server has already stopped cleanly.
        pass


@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 120.0,
                    log_level: str = "warning") -> Iterator[str]:
    """Run ``app`` with uvicorn in a daemon thread; yield its base URL (``http://127.0.0.1:PORT``).

    ``port=0`` picks a free port (the socket is bound before the server starts, so there is no race).

    Raises:
        RuntimeError: the server did not start within ``startup_timeout_s`` seconds (e.g. the engine failed
            to load; the lifespan error is in the log).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host, bound_port, log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="llminfer-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the server did not start (see the log for the lifespan error)")
        time.sleep(0.02)
    url_host = f"[{host}]" if ":" in host else host
    try:
        yield f"http://{url_host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
