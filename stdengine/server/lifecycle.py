"""The server process: uvicorn on one socket, until SIGINT or SIGTERM, then draining."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


def serve(
    app: Any,
    host: str,
    port: int,
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

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        server_header=False,
        lifespan="off",
    )
    sock = config.bind_socket()  # bound here (not yet listening) so that --port 0 knows its port
    bound_port = sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{bound_port}"
    server = DrainingServer(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if on_stopped is not None and server.started:
        on_stopped(url, received[0] if received else None)
