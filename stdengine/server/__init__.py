"""`infer serve`: an OpenAI-compatible HTTP server and web chat in front of any engine.

- `app.py`: the routes (OpenAI chat and completions, models, health, metrics, tokenize, embeddings,
  the web page), API-key check and one `request.done` log event per request;
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
