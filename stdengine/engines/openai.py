"""The `openai` engine: any OpenAI-compatible HTTP server (llama-server, llama-cpp-python's server,
vLLM, Ollama, a one-off engine) behind the adapter interface.

What HTTP allows: chat and completions, streamed (server-sent events); the sampling fields of the
OpenAI API; llama.cpp's extra sampling fields when the server is llama.cpp-like; tokenize and
detokenize when the server offers them, and log-probabilities (generated tokens' and, through an
echoed completion of token ids, score()) when it serves them (both probed at load). What it does
not: logits, and every load-time option (the server was started with its own) -- the core refuses
those before load.

Stop strings are matched here, by the core's StopMatcher, on the streamed text, so that they behave
exactly as in every other engine; on a match the stream is closed, which makes the server stop.
spec/engines.md is the prose.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from stdengine import __version__
from stdengine.adapter import (
    DoneEvent,
    Engine,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerationEvent,
    PromptLogprobs,
    SamplingParams,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
    check_logprobs,
    now_ms,
)
from stdengine.errors import (
    ContextOverflow,
    EngineFailure,
    EngineUnavailable,
    InferError,
    InvalidRequest,
    ModelNotFound,
    UnsupportedOption,
    UsageError,
)
from stdengine.generation import StopMatcher, render_chat_template, validate_sampling
from stdengine.openai_wire import (
    DONE,
    TOKENIZE_ROUTES,
    Entry,
    ErrorReply,
    WireError,
    bearer,
    choice_text,
    detokenize_body,
    detokenized,
    echo_body,
    logprob_entries,
    model_ids,
    parse_chunk,
    root_url,
    sse_events,
    tokenize_body,
    tokens_of,
)
from stdengine.options import SAMPLING

if TYPE_CHECKING:
    import httpx

    from stdengine.events import Emitter
    from stdengine.options import Options
    from stdengine.structured import Constraint

# Server dialects: which of llama.cpp's extra sampling fields a server takes (besides the OpenAI ones).
DIALECT_EXTRAS: dict[str, tuple[str, ...]] = {
    "llama.cpp": ("top_k", "min_p", "repeat_penalty", "repeat_last_n"),  # llama-server
    "llama-cpp-python": ("top_k", "min_p", "repeat_penalty"),  # its penalty window is a server setting
    "openai": (),
}
ENGINE_ARGS = {
    "model": "the served model to use (default: -m, else the first id of /v1/models)",
    "dialect": "auto (default), llama.cpp, llama-cpp-python or openai: which extra fields the server takes",
    "timeout": "seconds to wait for the server's next bytes (default 600, llama-server's own)",
}


class CallsAsText:
    """A server's streamed `tool_calls` deltas as the text of the call format stdengine's server
    reads back (stdengine.server.tools): a JSON array of `{"name": ..., "arguments": ...}`
    objects, written as the deltas come (a call's arguments are JSON text already)."""

    def __init__(self) -> None:
        self.index: int | None = None  # the call being written
        self.has_arguments = False

    def feed(self, deltas: list[dict[str, Any]] | None) -> str:
        out = ""
        for delta in deltas or []:
            function = delta.get("function") or {}
            index = delta.get("index", 0)
            if index != self.index:
                out += self._close() + ("[" if self.index is None else ", ")
                out += '{"name": ' + json.dumps(function.get("name") or "") + ', "arguments": '
                self.index, self.has_arguments = index, False
            if function.get("arguments"):
                out += function["arguments"]
                self.has_arguments = True
        return out

    def _close(self) -> str:
        if self.index is None:
            return ""
        return ("" if self.has_arguments else "{}") + "}"

    def end(self) -> str:
        return self._close() + "]" if self.index is not None else ""


class OpenAIEngine(Engine):
    name = "openai"
    description = "any OpenAI-compatible HTTP server (llama-server, vLLM, Ollama, ...) at --url"
    # what every instance can do; an instance adds "tokenize" and "logprobs" when its server
    # offers them (see load)
    capabilities = frozenset({"stream", "chat_template"})
    needs_model_file = False
    takes_prompt_tokens = True
    engine_args = ENGINE_ARGS
    option_map = {
        "model": "the served model's name, sent as `model` (default: the first id of /v1/models)",
        "url": "base URL of the server (/v1 routes below it); OPENAI_BASE_URL when unset",
        "api_key": "Authorization: Bearer KEY; OPENAI_API_KEY when unset",
        "seed": "seed (-1: not sent)",
        "temp": "temperature",
        "top_p": "top_p",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
        "n_predict": "max_tokens (-1: unlimited)",
        "stop": "core stop matcher on the streamed text (the stream is closed at a match)",
        "top_k": "top_k, llama.cpp-like servers only (refused by others unless left at 40)",
        "min_p": "min_p, llama.cpp-like servers only (refused by others unless left at 0.05)",
        "repeat_penalty": "repeat_penalty, llama.cpp-like servers only (refused by others unless left at 1.0)",
        "repeat_last_n": "repeat_last_n, llama-server only (refused by others unless left at 64)",
    }

    @classmethod
    def version(cls) -> str:
        return __version__

    @classmethod
    def availability(cls) -> tuple[bool, str | None]:
        try:
            import httpx  # noqa: F401
        except ImportError:
            return False, "httpx is not installed (pip install httpx)"
        return True, None

    def __init__(
        self, client: httpx.Client, root: str, model: str, dialect: str, options: Options, events: Emitter
    ) -> None:
        self.client = client
        self.root = root  # scheme://host:port[/prefix], without /v1
        self.model = model
        self.dialect = dialect
        self.options = options
        self.events = events
        self.bos_prefix: list[int] = []  # what the server's tokenizer adds to "" (BOS, if any)
        self.tokenize_route: str | None = None
        self.server_n_ctx: int | None = None
        self.build = ""

    # --- loading: find the server, its model and what it offers ----------------------------
    @classmethod
    def load(cls, options: Options, events: Emitter) -> OpenAIEngine:
        import httpx

        args = dict(options.engine_args)
        unknown = sorted(set(args) - set(ENGINE_ARGS))
        if unknown:
            raise UsageError(
                f"engine 'openai' has no engine argument {', '.join(unknown)}",
                hint="valid -E keys: " + "; ".join(f"{k}: {v}" for k, v in ENGINE_ARGS.items()),
            )
        dialect = args.get("dialect", "auto")
        if dialect != "auto" and dialect not in DIALECT_EXTRAS:
            raise UsageError(
                f"unknown dialect '{dialect}'", hint="-E dialect= takes auto, " + ", ".join(DIALECT_EXTRAS)
            )
        try:
            timeout = float(args.get("timeout", "600"))
        except ValueError:
            raise UsageError(f"-E timeout must be a number of seconds, not '{args['timeout']}'") from None
        root = _root_url(options.url or os.environ.get("OPENAI_BASE_URL"))
        headers = bearer(options.api_key or os.environ.get("OPENAI_API_KEY"))
        client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))

        t0 = now_ms()
        engine = cls(client, root, "", "openai", options, events)
        try:
            listing = engine._request("GET", "/v1/models", what="a model list (GET /v1/models)")
            engine.model = engine._choose_model(model_ids(listing.json()), args.get("model"))
            detected = engine._probe(listing)
            engine.dialect = detected if dialect == "auto" else dialect
        except Exception:
            client.close()
            raise
        engine._check_extras_supported(SamplingParams.from_options(options), at="load")
        # the instance's own capabilities (an instance attribute: the class's stay as declared)
        caps = set(cls.capabilities)
        if engine.tokenize_route:
            caps.add("tokenize")
        if engine._serves_logprobs():
            caps.add("logprobs")
        # constraints are passed on as response_format (or GBNF grammar), and tools as they are:
        # the server enforces them
        caps.update(("structured", "tool_calls"))
        if engine.dialect != "llama.cpp" and not options.chat_template:
            # the server applies its template without showing it: nothing here renders it
            caps.discard("chat_template")
        engine.capabilities = frozenset(caps)  # type: ignore[misc]
        events.info(
            "model.loaded",
            path=engine.model,
            url=root,
            dialect=engine.dialect,
            tokenize=engine.tokenize_route is not None,
            logprobs="logprobs" in engine.capabilities,
            load_ms=round(now_ms() - t0, 1),
        )
        return engine

    def _choose_model(self, ids: list[str], from_args: str | None) -> str:
        if from_args and self.options.model and from_args != self.options.model:
            raise UsageError(
                f"two served model names: -m {self.options.model} and -E model={from_args}",
                hint="give the name once",
            )
        wanted = from_args or self.options.model
        if wanted:
            if ids and wanted not in ids:
                raise ModelNotFound(
                    f"the server at {self.root} does not serve '{wanted}'",
                    hint="it serves: " + ", ".join(ids),
                )
            return wanted
        if not ids:
            raise ModelNotFound(
                f"the server at {self.root} lists no models (GET /v1/models)",
                hint="name the served model with -m NAME or -E model=NAME",
            )
        return ids[0]

    def _probe(self, listing: httpx.Response) -> str:
        """Which dialect the server speaks, and whether it tokenizes. llama-server says
        `Server: llama.cpp` and has /tokenize and /props; llama-cpp-python has /extras/tokenize."""
        llama_server = "llama.cpp" in listing.headers.get("server", "")
        for route in TOKENIZE_ROUTES if llama_server else ("/extras/tokenize",):
            found = tokens_of(self._try_json("POST", route, tokenize_body(route, "", model=self.model)))
            if found is not None:
                self.tokenize_route, self.bos_prefix = route, found
                break
        if llama_server:
            props = self._try_json("GET", "/props", None)
            if props:
                self.build = str(props.get("build_info", ""))
                n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
                self.server_n_ctx = int(n_ctx) if isinstance(n_ctx, int) else None
            return "llama.cpp"
        return "openai" if self.tokenize_route is None else "llama-cpp-python"

    def _serves_logprobs(self) -> bool:
        """Whether the server echoes a token-id prompt with its log-probabilities (what score()
        needs): one completion of one token after token 0 (an id every vocabulary has)."""
        found = self._try_json("POST", "/v1/completions", echo_body(self.model, [0], 1))
        try:
            entries = logprob_entries(found["choices"][0]["logprobs"]) if found else []
        except (KeyError, IndexError, TypeError, WireError):
            return False
        return bool(entries) and math.isnan(entries[0][0].logprob)

    def _try_json(self, method: str, path: str, body: Any) -> dict[str, Any] | None:
        """A probe: the JSON object answered, or None when the route is missing or failing."""
        import httpx

        try:
            r = self.client.request(method, self.root + path, json=body)
        except httpx.HTTPError:
            return None
        if r.status_code in (401, 403):
            raise self._error(r, f"{method} {path}")
        if r.status_code != 200:
            return None
        try:
            data = r.json()
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    # --- adapter surface -----------------------------------------------------------------
    def info(self) -> EngineInfo:
        return EngineInfo(
            name=self.name,
            version=__version__,
            build=self.build or f"dialect={self.dialect}",
            backend="remote",
            model={"url": self.root, "id": self.model, "dialect": self.dialect},
        )

    def n_ctx(self) -> int:
        if self.server_n_ctx is None:
            raise NotImplementedError("this server does not say its context size")
        return self.server_n_ctx

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """The upstream server's ids (forwarded to its tokenize route)."""
        route = self._need_tokenize()
        if route != "/tokenize" and not parse_special:
            raise InvalidRequest(
                "this server (llama-cpp-python) always parses special tokens",
                hint="tokenize with parse_special=True, or use a llama-server",
            )
        body = tokenize_body(route, text, add_special, parse_special, self.model)
        tokens = tokens_of(self._json("POST", route, body, what=f"POST {route}"))
        if tokens is None:
            raise EngineFailure(f"the server at {self.root} answered POST {route} without a token list")
        # llama-cpp-python's tokenizer always adds the special prefix; take it off when not asked for
        if route != "/tokenize" and not add_special and tokens[: len(self.bos_prefix)] == self.bos_prefix:
            tokens = tokens[len(self.bos_prefix) :]
        return tokens

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The upstream server's text for the ids (forwarded to its detokenize route)."""
        route = self._need_tokenize()
        back = TOKENIZE_ROUTES[route]
        body = detokenize_body(route, [int(t) for t in tokens], self.model)
        answer = self._json("POST", back, body, what=f"POST {back}")
        try:
            return detokenized(route, answer)
        except (KeyError, TypeError):
            raise EngineFailure(f"the server at {self.root} answered POST {back} without the text") from None

    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> Any:
        raise InvalidRequest(
            "engine 'openai' cannot return logits: the OpenAI API has no such call",
            hint="use an in-process engine (reference, llamacpp) for decode()",
        )

    def reset(self) -> None:
        """Nothing to do: the server manages its own cache per request."""

    def score_prompt(self, tokens: Sequence[int], top_n: int) -> PromptLogprobs:
        """One completion of the token ids with echo, logprobs=top_n and max_tokens=1: echoed
        token t+1 carries the top_n after tokens[:t+1], and the generated token the last row. A
        server that ends at once (an end-of-generation token is not reported) is asked again with
        the last token repeated, whose echo then carries that row."""
        if "logprobs" not in self.capabilities:
            raise InvalidRequest(f"the server at {self.root} does not serve echoed log-probabilities")
        check_logprobs(top_n)
        ids = [int(t) for t in tokens]
        if not ids:
            raise InvalidRequest("nothing to score: the token list is empty")
        entries = self._echo(ids, top_n)
        if len(entries) == len(ids):
            entries = self._echo([*ids, ids[-1]], top_n)
        if len(entries) <= len(ids):
            raise EngineFailure(
                f"the server at {self.root} echoed {len(entries)} log-probabilities for {len(ids)} tokens",
                hint="the server must echo every prompt token (echo: true with logprobs)",
            )
        return PromptLogprobs(
            # the ids are the ones sent (the completions shape does not carry ids)
            tokens=[
                TopLogprob(tok.token, tok.logprob, t, tok.piece)
                for (tok, _), t in zip(entries[: len(ids)], ids, strict=True)
            ],
            top=[top for _, top in entries[1 : len(ids) + 1]],
        )

    def _echo(self, ids: list[int], top_n: int) -> list[Entry]:
        data = self._json(
            "POST", "/v1/completions", echo_body(self.model, ids, top_n), what="POST /v1/completions (echo)"
        )
        try:
            return logprob_entries(data["choices"][0]["logprobs"])
        except (KeyError, IndexError, TypeError, WireError) as e:
            raise EngineFailure(
                f"the server at {self.root} answered an echo with logprobs in an unknown shape: {e}"
            ) from None

    def has_chat_template(self) -> bool:
        return True  # the server renders its model's template (or --chat-template is rendered here)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        if self.options.chat_template:
            return render_chat_template(
                self.options.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables
            )
        if self.dialect == "llama.cpp":
            body = {"messages": messages, **variables}
            data = self._json("POST", "/apply-template", body, what="POST /apply-template")
            return str(data["prompt"])
        raise InvalidRequest(
            "this server applies its chat template itself and does not show it",
            hint="pass a template with --chat-template to render it here",
        )

    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        s = request.sampling
        validate_sampling(s)
        n_logprobs = check_logprobs(request.logprobs)
        if n_logprobs is not None and "logprobs" not in self.capabilities:
            raise InvalidRequest(f"the server at {self.root} does not serve log-probabilities")
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "temperature": s.temp,
            "top_p": s.top_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "stream_options": {"include_usage": True},
        }
        body.update(self._check_extras_supported(s, at="request"))
        if request.constraint is not None:
            body.update(self._constraint_fields(request.constraint))
        if s.seed >= 0:
            body["seed"] = s.seed
        if request.tool_fields is not None:
            if request.messages is None or self.options.chat_template:
                raise UnsupportedOption(
                    "tools are passed on only in a chat the server renders itself",
                    hint="leave out --chat-template to let the server show its model the tools",
                )
            body.update(request.tool_fields)
        if request.messages is not None and not self.options.chat_template:
            route = "/v1/chat/completions"
            body["messages"] = request.messages
            if s.n_predict >= 0:
                body["max_tokens"] = s.n_predict
            if n_logprobs is not None:
                body.update(logprobs=True, top_logprobs=n_logprobs)
        else:
            route = "/v1/completions"
            if n_logprobs is not None:
                body["logprobs"] = n_logprobs
            if request.messages is not None:  # --chat-template: rendered here, completed raw
                body["prompt"] = self.apply_chat_template(request.messages)
            elif request.prompt_tokens is not None:
                if not request.prompt_tokens:
                    raise InvalidRequest("the prompt is empty", hint="give the model some tokens to complete")
                body["prompt"] = [int(t) for t in request.prompt_tokens]
            elif not request.prompt:
                raise InvalidRequest("the prompt is empty", hint="give the model some text to complete")
            else:
                body["prompt"] = request.prompt
            body["max_tokens"] = s.n_predict if s.n_predict >= 0 else None  # the API's default is 16
        if s.n_predict == 0:
            yield DoneEvent(finish_reason="length", usage=Usage(), timings=Timings())
            return
        yield from self._stream(route, body, s, n_logprobs is not None)

    def close(self) -> None:
        self.client.close()

    # --- internals -----------------------------------------------------------------------
    def _need_tokenize(self) -> str:
        if self.tokenize_route is None:
            raise InvalidRequest(
                f"the server at {self.root} offers no tokenizer (no /tokenize route)",
                hint="the 'tokenize' capability is declared only for servers that have one",
            )
        return self.tokenize_route

    def _constraint_fields(self, constraint: Constraint) -> dict[str, Any]:
        """A constraint as the request fields the server takes: OpenAI's response_format for JSON
        (llama-server and vLLM take it on completions too), llama-server's `grammar` for GBNF.
        The server enforces it; what else it cannot send is refused."""
        if constraint.kind == "json_object":
            return {"response_format": {"type": "json_object"}}
        if constraint.kind == "json_schema":
            schema = {"name": "output", "schema": constraint.schema, "strict": True}
            return {"response_format": {"type": "json_schema", "json_schema": schema}}
        if constraint.kind == "grammar" and constraint.syntax == "gbnf" and self.dialect == "llama.cpp":
            return {"grammar": constraint.text}
        raise UnsupportedOption(
            f"cannot pass {constraint.describe()} to the server at {self.root} ({self.dialect} dialect)",
            hint="a JSON schema or json_object goes to any server; a GBNF grammar to llama.cpp's",
        )

    def _check_extras_supported(self, s: SamplingParams, at: str) -> dict[str, Any]:
        """llama.cpp's extra sampling fields this server takes; one it does not take is refused
        unless it is left at its default (then it is simply not sent)."""
        extras = DIALECT_EXTRAS[self.dialect]
        refused = [
            k for k in DIALECT_EXTRAS["llama.cpp"] if k not in extras and getattr(s, k) != SAMPLING[k].default
        ]
        if refused:
            raise UnsupportedOption(
                f"the server at {self.root} ({self.dialect} dialect) takes no {', '.join(refused)}",
                hint=f"leave {'it' if len(refused) == 1 else 'them'} at the default, or pass -E dialect=llama.cpp "
                "if the server does take llama.cpp's fields",
                options=refused,
                at=at,
            )
        return {k: getattr(s, k) for k in extras}

    def _request(self, method: str, path: str, body: Any = None, *, what: str) -> httpx.Response:
        import httpx

        try:
            r = self.client.request(method, self.root + path, json=body)
        except httpx.HTTPError as e:
            raise self._transport_error(e, what) from e
        if r.status_code != 200:
            raise self._error(r, what)
        return r

    def _json(self, method: str, path: str, body: Any = None, *, what: str) -> Any:
        """A request's JSON answer; an answer that is not JSON is the server's failure."""
        r = self._request(method, path, body, what=what)
        try:
            return r.json()
        except ValueError:
            raise EngineFailure(
                f"the server at {self.root} answered {what} with something that is not JSON: {r.text[:200]!r}",
                hint="is this an OpenAI-compatible server?",
            ) from None

    def _stream(
        self, route: str, body: dict[str, Any], s: SamplingParams, logprobs: bool
    ) -> Iterator[GenerationEvent]:
        import httpx

        stops = StopMatcher(s.stop)
        calls = CallsAsText()
        finish: FinishReason | None = None
        matched: str | None = None
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        n_pieces = 0
        t0 = now_ms()
        t_first: float | None = None
        done = False
        try:
            with self.client.stream("POST", self.root + route, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise self._error(r, f"POST {route}")
                for data in sse_events(r.iter_text()):
                    if data == DONE:
                        done = True
                        break
                    chunk = self._chunk(data)
                    if "error" in chunk:
                        raise self._error_from(ErrorReply.of(500, chunk), f"POST {route}")
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    for choice in chunk.get("choices") or []:
                        piece = choice_text(choice) + calls.feed(
                            (choice.get("delta") or {}).get("tool_calls")
                        )
                        entries = self._chunk_logprobs(choice) if logprobs else []
                        text = ""
                        if piece:
                            n_pieces += 1
                            t_first = t_first if t_first is not None else now_ms()
                            text, matched = stops.feed(piece)
                        # one event per token the chunk reports, the chunk's text on the first
                        for i, (tok, top) in enumerate(entries):
                            yield TokenEvent(tok.id, "" if i else text, tok.logprob, top, tok)
                        if piece and not entries:
                            yield TokenEvent(-1, text)
                        if matched is not None:
                            break  # leaving the `with` closes the stream: the server stops
                        if choice.get("finish_reason"):
                            finish = "length" if choice["finish_reason"] == "length" else "stop"
                    if matched is not None:
                        break
        except httpx.HTTPError as e:
            raise self._transport_error(e, f"POST {route}", mid_stream=t_first is not None) from e
        if matched is not None:
            finish = "stop"
        elif finish is None and not done:
            raise EngineFailure(
                f"the server at {self.root} ended the stream before its end (no finish_reason, no [DONE])",
                hint="the server may have crashed: check its log",
            )
        else:
            tail = stops.feed(calls.end())[0] + stops.flush()
            if tail:
                yield TokenEvent(-1, tail)
        t2 = now_ms()
        t1 = t_first if t_first is not None else t2
        n_gen = int(usage.get("completion_tokens") or 0) if matched is None else 0
        n_gen = n_gen or n_pieces
        yield DoneEvent(
            finish_reason=finish or "stop",
            stop=matched,
            usage=Usage(
                prompt_tokens=int(usage.get("prompt_tokens") or timings.get("prompt_n") or 0),
                completion_tokens=n_gen,
            ),
            # the server's own timings when it sends them (llama-server), else measured here
            timings=Timings(
                prompt_n=int(timings.get("prompt_n", usage.get("prompt_tokens") or 0)),
                prompt_ms=float(timings.get("prompt_ms", t1 - t0)),
                predicted_n=int(timings.get("predicted_n", n_gen)) if matched is None else n_gen,
                predicted_ms=float(timings.get("predicted_ms", t2 - t1)) if matched is None else t2 - t1,
            ),
        )

    def _chunk(self, data: str) -> dict[str, Any]:
        try:
            return parse_chunk(data)
        except WireError as e:
            raise EngineFailure(
                f"the server at {self.root} sent {e}", hint="is this an OpenAI-compatible server?"
            ) from None

    def _chunk_logprobs(self, choice: dict[str, Any]) -> list[Entry]:
        try:
            return logprob_entries(choice.get("logprobs"))
        except WireError as e:
            raise EngineFailure(f"the server at {self.root} sent logprobs in an unknown shape: {e}") from None

    def _transport_error(self, e: Exception, what: str, mid_stream: bool = False) -> InferError:
        import httpx

        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            return EngineUnavailable(
                f"cannot reach the server at {self.root} ({what}): {e}",
                hint="start the server, or check --url",
            )
        if isinstance(e, httpx.TimeoutException):
            return EngineFailure(
                f"the server at {self.root} did not answer {what} in time: {e}",
                hint="raise the limit with -E timeout=SECONDS, or check the server",
            )
        where = "in the middle of the stream" if mid_stream else "during the request"
        return EngineFailure(
            f"the connection to the server at {self.root} broke {where} ({what}): {type(e).__name__}: {e}",
            hint="the server may have crashed or restarted: check its log",
        )

    def _error(self, r: httpx.Response, what: str) -> InferError:
        return self._error_from(ErrorReply.of(r.status_code, r.content or r.reason_phrase), what)

    def _error_from(self, err: ErrorReply, what: str) -> InferError:
        """An error reply as the standard error, keeping the server's message."""
        status = err.status
        said = f"the server at {self.root} answered {what} with {status}: {err.message}"
        low = err.message.lower()
        if err.context_overflow:
            return ContextOverflow(
                said, hint="shorten the prompt, or start the server with a larger context", **err.details
            )
        if status in (401, 403):
            return EngineUnavailable(said, hint="pass the server's key with --api-key or OPENAI_API_KEY")
        if status == 404:
            if "model" in low:
                return ModelNotFound(said, hint="name a served model with -m NAME (see GET /v1/models)")
            return EngineUnavailable(said, hint="check --url: is this an OpenAI-compatible server?")
        if status in (400, 422):
            return InvalidRequest(said)
        if status == 503:
            return EngineUnavailable(said, hint="the server may still be loading its model: retry shortly")
        return EngineFailure(said, hint="check the server's log")


def _root_url(url: str | None) -> str:
    if not url:
        raise UsageError(
            "engine 'openai' needs the server's URL",
            hint="pass --url http://HOST:PORT (or set INFER_URL or OPENAI_BASE_URL)",
        )
    return root_url(url)


def wait_until_ready(url: str, timeout_s: float = 60.0) -> None:
    """Poll GET /v1/models until the server answers (for scripts and tests that start one)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(_root_url(url) + "/v1/models", timeout=2.0).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise EngineUnavailable(f"the server at {url} did not come up within {timeout_s:.0f} s")
        time.sleep(0.2)
