"""The server process: uvicorn on one socket, until SIGINT or SIGTERM, then draining."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from stdengine.errors import UsageError


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound and not yet listening (as uvicorn binds one). `infer serve`
    binds before it loads the model, so that a port in use or a host that is not this machine's
    is a usage error at once, not after the load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hints = {
            errno.EADDRINUSE: "another process listens there: choose another --port, or stop it",
            errno.EACCES: "ports below 1024 need privileges: choose another --port",
        }
        hint = hints.get(e.errno or 0, "--host must be an address of this machine (0.0.0.0: all of them)")
        raise UsageError(f"cannot listen on {host} port {port}: {e.strerror or e}", hint=hint) from None
    sock.set_inheritable(True)
    return sock


def serve(
    app: Any,
    sock: socket.socket,
    *,
    on_listening: Callable[[str], None] | None = None,
    on_stopped: Callable[[str, str | None], None] | None = None,
    ready: threading.Event | None = None,
) -> None:
    """Serve `app` until SIGINT or SIGTERM, then drain: stop accepting connections, let requests
    in flight (and those queued) finish, return. Returns normally, so the caller can close the
    engine.

    on_listening(url) is called once the socket listens (a client may connect from then on; the
    URL has the real port, also for port 0); on_stopped(url, signal name or None) once the
    requests in flight are drained."""
    import uvicorn

    received: list[str] = []

    class DrainingServer(uvicorn.Server):
        # uvicorn re-raises the signal after its graceful shutdown, which would kill the process
        # before the engine is closed; we only ask it to shut down and return.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            received.append(signal.Signals(sig).name)
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)  # the socket listens once this returns
            if on_listening is not None:
                on_listening(url)
            if ready is not None:
                ready.set()

    config = uvicorn.Config(app, log_level="warning", access_log=False, server_header=False, lifespan="off")
    host, bound_port = sock.getsockname()[:2]  # the real port, also for --port 0
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{bound_port}"
    server = DrainingServer(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if on_stopped is not None and server.started:
        on_stopped(url, received[0] if received else None)
