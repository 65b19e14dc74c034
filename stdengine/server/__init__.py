"""`infer serve`: an OpenAI-compatible HTTP server and web chat in front of any engine.

- `app.py`: `create_app` puts the pieces together; `run_server` serves it;
- `state.py`: what the routes read (the loaded engine instance, its slots, the sampling defaults);
- `routes.py`: the routes as module-level handlers (models, health, props, metrics, tokenize,
  embeddings, the web page); `completion.py`: chat and text completions, one path for both, and
  the one reader of a generation's events for whole and streamed answers;
- `middleware.py`: API-key check, one `request.done` log event per request, and the request limits
  (body size, JSON nesting, prompt length);
- `envelope.py`: every error as OpenAI's error envelope (the kinds are stdengine.errors');
- `lifecycle.py`: uvicorn on one socket, and draining on SIGINT or SIGTERM;
- `api.py`: the OpenAI request shapes we accept (strictly) and the response shapes we send;
- `slots.py`: the contexts that serve requests at once, the bounded queue in front of them, and
  the bridge from an engine's blocking `generate()` in a worker thread to the asyncio server;
- `metrics.py`: llama-server's Prometheus metrics under the `stdengine:` prefix;
- `static/index.html`: the web chat (one file, inline JS and CSS, no build step, no network).

spec/server.md is the prose. FastAPI and uvicorn come with the `server` extra; nothing here is
imported by the CLI until `infer serve` runs.
"""

from __future__ import annotations

from stdengine.server.app import ServerState, build_state, create_app, run_server

__all__ = ["ServerState", "build_state", "create_app", "run_server"]
