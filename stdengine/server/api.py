"""The OpenAI request shapes the server accepts and the response shapes it sends.

Requests are parsed strictly (pydantic, `extra="forbid"`, `strict=True`): a field of the wrong type
or a field we do not know is a 400 that names it, as OpenAI's own API answers "Unrecognized
request argument supplied". Fields we know but cannot honour (n > 1, logprobs or a
response_format from an engine without the capability, ...) are a 400 too, never silently dropped.
Sampling fields map to canonical options; a field whose option the engine does not honour is
refused the same way `infer run` refuses the flag.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from stdengine.adapter import (
    MAX_TOP_LOGPROBS,
    DoneEvent,
    PromptLogprobs,
    SamplingParams,
    TokenEvent,
    TopLogprob,
    Usage,
)
from stdengine.errors import InvalidRequest, UnsupportedOption
from stdengine.options import SAMPLING, SAMPLING_REQUEST_NAMES

if TYPE_CHECKING:
    from stdengine.server.tools import ToolPlan


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# request field -> canonical option (spec/options.md), from the Options fields' declarations; the
# engine must honour the option. max_completion_tokens is the chat route's name only.
SAMPLING_FIELDS: dict[str, str] = SAMPLING_REQUEST_NAMES
CHAT_ONLY_FIELDS = frozenset({"max_completion_tokens"})


def _sampling_fields(route: Literal["chat", "text"]) -> dict[str, Any]:
    """The request fields that set sampling options, typed and bounded as the options declare."""
    fields: dict[str, Any] = {}
    for option in SAMPLING.values():
        # a request's stop may be one string (OpenAI's shape) as well as a list
        kind: Any = str | list[str] if option.name == "stop" else option.annotation
        for name in option.request:
            if route == "chat" or name not in CHAT_ONLY_FIELDS:
                fields[name] = (kind | None, Field(None, ge=option.request_ge, le=option.request_le))
    return fields


class _Completion(_Strict):
    """What chat and text completions share besides sampling: model, streaming, and the OpenAI
    fields this server accepts only at their neutral values (refuse_unsupported checks them)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own tracking; not used
    # llama-server's and vLLM's extensions that benchmarks send to fix an answer's length
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)


# The sampling fields are made from the options' table, so the type checker does not see them:
# the code reads them by name (sampling_for).
if TYPE_CHECKING:

    class _Chat(_Completion): ...

    class _Text(_Completion): ...

else:
    _Chat = create_model("_Chat", __base__=_Completion, **_sampling_fields("chat"))
    _Text = create_model("_Text", __base__=_Completion, **_sampling_fields("text"))


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant message that made tool calls (checked in stdengine.server.tools)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    refusal: str | None = None  # what the openai client sends back with an assistant message


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: the function takes no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Structured(_Strict):
    """The fields that constrain the output (stdengine.server.tools.constraint_for): OpenAI's
    response_format, and llama-server's own json_schema and grammar (GBNF)."""

    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None


class ChatRequest(_Chat, _Structured):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Text, _Structured):
    # text, or token ids (lm-evaluation-harness sends [[ids]]); one prompt per request
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


class EmbeddingsRequest(_Strict):
    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


def parse(model: type[_Strict], body: dict[str, Any]) -> Any:
    """Validate a request body; every problem becomes one InvalidRequest naming the fields."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        parts: list[str] = []
        unknown_top_level = False
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                parts.append(f"Unrecognized request argument supplied: {loc}")
                unknown_top_level = unknown_top_level or len(err["loc"]) == 1
            else:
                parts.append(f"{loc}: {err['msg']}")
        hint = None
        if unknown_top_level:
            hint = "this route accepts: " + ", ".join(model.model_fields)
        raise InvalidRequest("; ".join(parts), hint=hint) from None


def refuse_unsupported(req: ChatRequest | CompletionRequest) -> None:
    """Known OpenAI fields that ask for something this server does not do are an error."""
    bad: list[str] = []
    if req.n is not None and req.n > 1:
        bad.append("n > 1 (this server returns one choice per request)")
    if req.logit_bias:
        bad.append("logit_bias")
    if isinstance(req, ChatRequest):
        # the legacy function-calling fields; tools and tool_choice are their replacement
        if req.functions or req.function_call not in (None, "none", "auto"):
            bad.append("functions / function_call (send tools / tool_choice instead)")
    else:
        if req.suffix is not None:
            bad.append("suffix")
        if req.best_of is not None and req.best_of > 1:
            bad.append("best_of > 1")
    if bad:
        raise UnsupportedOption(
            f"not supported by this server: {'; '.join(bad)}", hint="remove these fields from the request"
        )
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")


def eog_controls(req: ChatRequest | CompletionRequest, engine_name: str, honoured: bool) -> tuple[bool, int]:
    """(ignore_eos, min_tokens) of the request; an UnsupportedOption when the engine cannot
    honour what is asked (engines with Engine.eog_controls can)."""
    ignore_eos, min_tokens = bool(req.ignore_eos), req.min_tokens or 0
    if (ignore_eos or min_tokens) and not honoured:
        asked = [f for f, v in (("ignore_eos", ignore_eos), ("min_tokens", min_tokens)) if v]
        raise UnsupportedOption(
            f"engine '{engine_name}' cannot honour {', '.join(asked)}",
            hint="remove " + ("it" if len(asked) == 1 else "them") + " from the request",
        )
    return ignore_eos, min_tokens


def logprobs_wanted(req: ChatRequest | CompletionRequest) -> int | None:
    """How many top log-probabilities per token the request asks for; None: no log-probabilities."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def refuse_missing(
    req: ChatRequest | CompletionRequest, engine_name: str, capabilities: frozenset[str]
) -> None:
    """Fields that need a capability the engine does not declare are a 400 naming them."""
    needs: dict[str, str] = {}
    if logprobs_wanted(req) is not None:
        needs["logprobs" + (" / top_logprobs" if isinstance(req, ChatRequest) else "")] = "logprobs"
    if isinstance(req, CompletionRequest):
        if prompt_ids(req) is not None:
            needs["prompt (token ids)"] = "tokenize"
        elif req.echo and req.logprobs is not None:
            needs["echo with logprobs"] = "tokenize"
    missing = [f"{f} (needs the '{c}' capability)" for f, c in needs.items() if c not in capabilities]
    if missing:
        raise UnsupportedOption(
            f"engine '{engine_name}' cannot honour {'; '.join(missing)}",
            hint="remove " + ("it" if len(missing) == 1 else "them") + " from the request",
        )


def sampling_for(
    req: ChatRequest | CompletionRequest, defaults: SamplingParams, engine_name: str, honoured: frozenset[str]
) -> SamplingParams:
    """The server's defaults (its own sampling flags), overridden by the request's fields."""
    given = {f: getattr(req, f) for f in SAMPLING_FIELDS if getattr(req, f, None) is not None}
    refused = [f for f in given if SAMPLING_FIELDS[f] not in honoured]
    if refused:
        raise UnsupportedOption(
            f"engine '{engine_name}' cannot honour {', '.join(refused)}",
            hint="remove "
            + ("it" if len(refused) == 1 else "them")
            + " from the request; the engine honours: "
            + ", ".join(f for f, opt in SAMPLING_FIELDS.items() if opt in honoured),
        )
    s = dataclasses.replace(defaults, stop=list(defaults.stop))
    by_option: dict[str, str] = {}  # option -> the request field that set it
    for field, value in given.items():
        option = SAMPLING_FIELDS[field]
        if option in by_option and given[by_option[option]] != value:
            raise InvalidRequest(f"{by_option[option]} and {field} disagree; give one of them")
        by_option[option] = field
        setattr(s, option, [value] if option == "stop" and isinstance(value, str) else value)
    if (
        "n_predict" in by_option
        and s.n_predict == 0
        and not (isinstance(req, CompletionRequest) and req.echo)
    ):
        raise InvalidRequest("max_tokens must be at least 1 (or -1 for no limit; 0 only with echo)")
    return s


def props_defaults(defaults: SamplingParams) -> dict[str, Any]:
    """/props's default_generation_settings: every sampling default, by llama-server's names (an
    option's request name where it has one, the option's own where requests have several:
    n_predict, which they call max_tokens or max_completion_tokens)."""
    return {
        option.request[0] if len(option.request) == 1 else name: getattr(defaults, name)
        for name, option in SAMPLING.items()
    }


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def call_text(call: ToolCall) -> str:
    """An earlier turn's call, written back in the format the model is asked to answer in."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequest(
            f"messages: the arguments of tool call {call.id!r} are not JSON: {call.function.arguments[:80]!r}"
        ) from None
    return json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)


def chat_messages(req: ChatRequest, tool_instructions: str | None = None) -> list[dict[str, str]]:
    """OpenAI messages -> the {role, content} dicts a chat template renders: "developer" is the
    system role; an assistant's tool calls are written as the JSON objects it is asked to answer
    in, and a tool's result becomes a user turn that names the function (a template knows the
    user, assistant and system roles; many refuse any other). tool_instructions (stdengine.server.tools) open
    the system message."""
    names: dict[str, str] = {}  # tool call id -> function name
    out: list[dict[str, str]] = []
    for m in req.messages:
        content = _text(m.content)
        if m.role == "tool":
            if m.content is None:
                raise InvalidRequest("messages: a tool message needs content (the function's result)")
            name = names.get(m.tool_call_id or "", m.name or "the function")
            out.append({"role": "user", "content": f"Result of {name}: {content}"})
            continue
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest("messages: only an assistant message has tool_calls")
            for call in m.tool_calls:
                names[call.id] = call.function.name
            texts = [call_text(c) for c in m.tool_calls]
            calls = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"  # several: an array
            content = "\n".join([content] * bool(content) + [calls])
        elif m.content is None:
            raise InvalidRequest(f"messages: a {m.role} message needs content")
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    if tool_instructions is not None:
        if out[0]["role"] == "system":
            out[0]["content"] = tool_instructions + "\n\n" + out[0]["content"]
        else:
            out.insert(0, {"role": "system", "content": tool_instructions})
    return out


def finish_reason(done: DoneEvent, tool_calls: list[dict[str, Any]] | None) -> str:
    """`tool_calls` for an answer of calls that ended complete (the constraint ended it: `stop`
    without a stop string); calls cut off keep the generation's reason (`length`, or `stop`)."""
    complete = done.finish_reason == "stop" and done.stop is None
    return "tool_calls" if tool_calls and complete else done.finish_reason


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text, or token ids."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if not p:
        raise InvalidRequest("prompt: the list is empty", hint="send text or a list of token ids")
    if p and all(isinstance(x, int) for x in p):
        return list(p)  # type: ignore[arg-type]
    if len(p) != 1:
        raise UnsupportedOption(
            "prompt: a list of several prompts is not supported", hint="send one request per prompt"
        )
    return p[0] if isinstance(p[0], str) else list(p[0])  # type: ignore[arg-type]


def prompt_ids(req: CompletionRequest) -> list[int] | None:
    prompt = completion_prompt(req)
    return None if isinstance(prompt, str) else prompt


# --- log-probabilities --------------------------------------------------------------------------


def _chat_entry(tok: TopLogprob) -> dict[str, Any]:
    # OpenAI's fields, plus the token id as llama-server gives it (-1: the engine cannot say)
    return {"id": tok.id, "token": tok.token, "logprob": tok.logprob, "bytes": list(tok.utf8())}


def chat_logprob(tok: TopLogprob, top: list[TopLogprob]) -> dict[str, Any]:
    """One entry of `logprobs.content` (chat, and the extra `content` of completions)."""
    return {**_chat_entry(tok), "top_logprobs": [_chat_entry(t) for t in top]}


def event_logprob(ev: TokenEvent) -> dict[str, Any] | None:
    if ev.token is None:
        return None
    return chat_logprob(ev.token, ev.top_logprobs or [])


def prompt_logprobs(scores: PromptLogprobs) -> list[dict[str, Any]]:
    """Chat-shaped entries of an echoed prompt: the first token has nothing before it (null)."""
    out = []
    for t, tok in enumerate(scores.tokens):
        entry = chat_logprob(tok, scores.top[t - 1] if t else [])
        if t == 0:
            entry.update(logprob=None, top_logprobs=None)
        out.append(entry)
    return out


class Offsets:
    """text_offset of each token: the characters of the returned text before it, counted over the
    tokens' own bytes (a token that is part of a UTF-8 character starts where that character
    does), from `start` (the echoed prompt's length for the generated tokens)."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        # characters of the pieces so far; an incomplete character waits in the decoder
        self.chars = 0
        self.utf8 = codecs.getincrementaldecoder("utf-8")("ignore")

    def next(self, piece: bytes) -> int:
        offset = self.start + self.chars
        self.chars += len(self.utf8.decode(piece))
        return offset


def legacy_logprobs(entries: list[dict[str, Any]], offsets: Offsets) -> dict[str, Any]:
    """The completions `logprobs` object (OpenAI's legacy shape: tokens, token_logprobs,
    top_logprobs as {text: logprob}, text_offset), with the chat-shaped `content` as well, which
    carries the token ids."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            None if e["top_logprobs"] is None else _text_dict(e["top_logprobs"]) for e in entries
        ],
        "text_offset": [offsets.next(bytes(e["bytes"])) for e in entries],
        "content": entries,
    }


def join_legacy(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two completions `logprobs` objects (an echoed prompt's, the generated tokens') as one."""
    return {k: a[k] + b[k] for k in a}


@dataclasses.dataclass
class LogprobsReply:
    """A request's log-probabilities: chat's {"content": [...]}, or the completions shape, whose
    text offsets count from the start of the echoed prompt (`echo_len` characters long)."""

    kind: Literal["chat", "text"]
    echo_len: int = 0

    def __post_init__(self) -> None:
        self.offsets = Offsets(self.echo_len)  # shared by every chunk of a stream

    def prompt(self, scores: PromptLogprobs) -> dict[str, Any]:
        return legacy_logprobs(prompt_logprobs(scores), Offsets(0))

    def tokens(self, events: list[TokenEvent]) -> dict[str, Any]:
        entries = [e for e in map(event_logprob, events) if e is not None]
        if self.kind == "chat":
            return {"content": entries}
        return legacy_logprobs(entries, self.offsets)


def _text_dict(top: list[dict[str, Any]]) -> dict[str, float]:
    """{text: logprob}; two tokens with the same text keep the likelier (listed first)."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


# --- responses ----------------------------------------------------------------------------------


def new_id(kind: Literal["chat", "text"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


@dataclasses.dataclass
class Reply:
    """What every response and chunk of one request share."""

    kind: Literal["chat", "text"]
    model: str
    fingerprint: str
    include_usage: bool = False
    id: str = ""
    created: int = 0
    echo: str | None = None  # completions with echo: the prompt's text, put before the answer
    logprobs: LogprobsReply | None = None  # the request asked for log-probabilities
    tools: ToolPlan | None = None  # chat with tools: the answer may be a tool call

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.kind)
        self.created = self.created or now_s()

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def final(
        self,
        text: str,
        done: DoneEvent,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The whole answer of a non-streamed request: a text, or (chat) tool calls."""
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message.update(content=None, tool_calls=tool_calls)
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason(done, tool_calls),
            }
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": done.finish_reason}
            body = self._head("text_completion")
        body.update(choices=[choice], usage=usage_dict(done.usage), timings=done.timings.to_dict())
        return body

    def chunk(
        self,
        text: str | None = None,
        *,
        role: bool = False,
        done: DoneEvent | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk: the role (chat only), a piece of text and its tokens' logprobs,
        tool calls' deltas, or the finish (its reason is the DoneEvent's unless `finish` says)."""
        if done is not None:
            finish = finish or done.finish_reason
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif tool_calls is not None:
                delta = {"tool_calls": tool_calls}
            elif text is not None:
                delta = {"content": text}
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None  # OpenAI: every chunk but the last one has usage null
        if done is not None:
            body["timings"] = done.timings.to_dict()
        return body

    def usage_chunk(self, done: DoneEvent) -> dict[str, Any]:
        """The extra last chunk that stream_options.include_usage asks for: no choices, the usage."""
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body.update(choices=[], usage=usage_dict(done.usage), timings=done.timings.to_dict())
        return body
