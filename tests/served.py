"""`infer serve` in process for the tests: the server's app on a real engine (by name, or any
engine class, e.g. a broken one of broken_engines.py), served by uvicorn in a thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

ALIAS = "smollm2-135m-instruct"
KEY = "sekrit"
N_CTX = 2048  # holds the golden induction case


class InProcessServer:
    """`infer serve`'s app (stdengine.server.app) on a real engine, served by uvicorn in a thread."""

    def __init__(self, engine: str | type, model: Path) -> None:
        import uvicorn

        from stdengine import registry
        from stdengine.adapter import SamplingParams
        from stdengine.events import null_emitter
        from stdengine.options import Options
        from stdengine.server.app import build_state, create_app

        cls = registry.engine_class(engine) if isinstance(engine, str) else engine
        loaded = cls.load(
            Options(engine=cls.name, model=str(model), ctx_size=N_CTX, threads=2), null_emitter()
        )
        self.state = build_state(
            loaded,
            parallel=2,
            defaults=SamplingParams(),
            events=null_emitter(),
            model_ref=ALIAS,
            model_path=str(model),
            api_key=KEY,
        )
        config = uvicorn.Config(
            create_app(self.state), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
        )
        sock = config.bind_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died before listening"
            time.sleep(0.02)

    def stop(self) -> None:
        from stdengine.server.app import close_state

        self.server.should_exit = True
        self.thread.join(30)
        close_state(self.state)
