"""What every route reads: the loaded engine, its slots, the server's defaults and its log.

The state hangs on the app (`app.state.stdengine`); the routes are module-level functions that
read it from their request (`state_of`). Everything about the engine is asked of the loaded
instance, never its class: an instance may widen what its class declares (the openai engine
says `tokenize` when its upstream server can)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request

from stdengine import __version__
from stdengine.adapter import Engine, SamplingParams
from stdengine.errors import ModelNotFound, NotSupported
from stdengine.events import Emitter
from stdengine.server.metrics import Metrics
from stdengine.server.middleware import DEFAULT_MAX_BODY
from stdengine.server.slots import SlotPool

DEFAULT_QUEUE = 16


@dataclass
class ServerState:
    """Everything the routes need: the engine, its slots, the defaults and the log."""

    engine: Engine  # the instance load() returned; tokenize/detokenize/templates go through it
    slots: SlotPool
    defaults: SamplingParams  # the server's sampling flags: what a request's omitted fields get
    events: Emitter
    model_id: str  # what /v1/models lists and responses echo
    model_names: frozenset[str]  # the names a request's `model` may use for this model
    model_path: str | None = None
    api_key: str | None = None
    verbose: bool = False
    max_body: int = DEFAULT_MAX_BODY
    started: float = field(default_factory=time.time)
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def fingerprint(self) -> str:
        return f"stdengine-{__version__}-{self.engine.name}-{self.engine.version()}"

    def n_ctx(self) -> int | None:
        try:
            return int(self.engine.n_ctx())
        except Exception:  # an engine may not know (e.g. a remote server)
            return None

    def need(self, capability: str) -> None:
        """A route that needs a capability the loaded engine does not have answers 501."""
        if capability not in self.engine.capabilities:
            raise NotSupported(f"engine '{self.engine.name}' does not declare the '{capability}' capability")

    def check_model(self, name: str | None) -> str:
        """The request's model must be the served one (by its id, path or file name); none = it."""
        if name is None or name == "":
            return self.model_id
        if name not in self.model_names:
            raise ModelNotFound(
                f"model '{name}' is not served here",
                hint=f"this server serves '{self.model_id}' (GET /v1/models)",
            )
        return name

    def model_meta(self) -> dict[str, Any]:
        """/v1/models's `meta`: the engine and the model's metadata, made JSON-safe (engines may
        put numpy scalars or paths in it)."""
        info = self.engine.info()
        meta = {
            "engine": info.name,
            "engine_version": info.version,
            "backend": info.backend,
            "n_ctx": self.n_ctx(),
        }
        return {**meta, **json.loads(json.dumps(info.model, default=str))}


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.stdengine
    return state


def build_state(
    engine: Engine,
    *,
    parallel: int,
    defaults: SamplingParams,
    events: Emitter,
    model_ref: str,
    model_path: str | None = None,
    api_key: str | None = None,
    queue_size: int = DEFAULT_QUEUE,
    verbose: bool = False,
    max_body: int = DEFAULT_MAX_BODY,
    batching: bool | None = None,
) -> ServerState:
    """Make the slots (N contexts on the one loaded model, when the engine can) and the state.
    batching: one Scheduler (stdengine.batching) steps the contexts together; None = when the engine
    declares `batch_decode` (an engine without it keeps one independent context per thread)."""
    contexts: list[Engine] = [engine]
    while len(contexts) < parallel:
        ctx = engine.new_context()
        if ctx is None:  # one context only: requests take turns on it (the caller says so)
            break
        contexts.append(ctx)
    if batching is None:
        batching = "batch_decode" in engine.capabilities
    names = {model_ref}
    if model_path:
        names |= {model_path, Path(model_path).name, Path(model_path).stem}
    return ServerState(
        engine=engine,
        slots=SlotPool(contexts, queue_size, batching),
        defaults=defaults,
        events=events,
        model_id=model_ref,
        model_names=frozenset(names),
        model_path=model_path,
        api_key=api_key,
        verbose=verbose,
        max_body=max_body,
    )


def close_state(state: ServerState) -> None:
    """Release the extra contexts first, then the engine that owns the model."""
    state.slots.close()
    for ctx in state.slots.contexts[1:]:
        ctx.close()
    state.engine.close()
