"""Structured output and tool calls on the server: a request's `response_format` (and llama-server's
`json_schema` and `grammar`) become the GenerateRequest's constraint, and `tools` become a prompt
and a constraint whose answer is parsed back into OpenAI's `tool_calls`.

Tool calls (spec/server.md, "Tool calls") use the chat template's own format where the template
renders `tools` in one we know (CallFormat: Hermes' <tool_call> tags, Llama 3.1's "parameters"),
and otherwise ours, for every model: the tool list goes into the system message as JSON, with the instruction to answer a call as a JSON object
`{"name": ..., "arguments": {...}}` (with parallel_tool_calls, several as a JSON array), and the
earlier turns' calls and results are written back in that format. In either, for `required` and a named
function the output is constrained to such calls (the names declared, the arguments valid for
their parameters), so a call is valid by construction; for `auto` the output is either calls or
a text that does not start like them. CallStream reads the answer as it is generated, so a
stream sends each call's name and then its arguments while they are written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from stdengine.errors import InvalidRequest, UnsupportedOption
from stdengine.server import api
from stdengine.structured import Constraint, require_structured

# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


# the integers exact in every JSON parser (RFC 8259's interoperable range)
MAX_SAFE_INTEGER = 2**53 - 1


def closed_objects(schema: Any) -> Any:
    """The schema as llama-server reads it: `additionalProperties: false` on each object that
    lists its properties and says nothing of others (a client such as `llm --schema` sends such
    schemas and means these fields only), and integers without bounds kept to what a JSON parser
    holds exactly (llama-server allows 16 digits). Otherwise a small model may add fields or
    digits without end, and the answer never completes."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") == "integer":
        out.setdefault("minimum", -MAX_SAFE_INTEGER)
        out.setdefault("maximum", MAX_SAFE_INTEGER)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(x) for x in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    return out


def _rebased(schema: Any, base: str) -> Any:
    """schema with its local references ("#" and "#/...") moved under base, a JSON pointer of
    the place where it will stand."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, base) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def _constraint(kind: str, value: Any = None) -> Constraint:
    if kind == "json_schema":
        return Constraint.json_schema(closed_objects(value))
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "lark":
        return Constraint.grammar(value, "lark")
    return Constraint.grammar(value, "gbnf")


def constraint_for(
    req: api.ChatRequest | api.CompletionRequest, engine_name: str, capabilities: frozenset[str]
) -> Constraint | None:
    """The output constraint the request's response_format / json_schema / grammar fields ask for
    (None: text), refused by name when the engine cannot honour it."""
    asked: list[tuple[str, str, Any]] = []
    rf = req.response_format
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise InvalidRequest(
            f"response_format: type {rf.type} takes no json_schema", hint="send type json_schema with it"
        )
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", "json_object", None))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequest("response_format: type json_schema needs json_schema.schema")
        # strict or not, the output is made to match the schema: that is what a client wants
        asked.append(("response_format", "json_schema", rf.json_schema.schema_))
    if req.json_schema is not None:
        asked.append(("json_schema", "json_schema", req.json_schema))
    if req.grammar is not None:
        asked.append(("grammar", "gbnf", req.grammar))
    if len(asked) > 1:
        raise InvalidRequest(
            f"{' and '.join(a[0] for a in asked)} both constrain the output", hint="give one of them"
        )
    if not asked:
        return None
    field, kind, value = asked[0]
    require_structured(field, engine_name, capabilities)
    return _constraint(kind, value)


# --- tool calls ---------------------------------------------------------------------------------


NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}  # a function without parameters

# The most calls one answer may hold with parallel_tool_calls: a small model can otherwise repeat
# a call until max_tokens cuts the answer off.
MAX_PARALLEL_CALLS = 4


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class CallFormat:
    """How an answer writes calls. Ours ("json") is for every model; the others are what a chat
    template that renders `tools` itself teaches its model (spec/server.md, "Tool calls")."""

    name: str
    args_key: str = "arguments"  # the call object's key of the arguments
    wrap: tuple[str, str] | None = None  # the text around each call object (Hermes' tags)
    several: bool = True  # several calls per answer are possible (parallel_tool_calls)

    def openers(self, parallel: bool) -> str:
        """The first characters of an answer that is calls."""
        if self.wrap is not None:
            return self.wrap[0][:1]
        return "{[" if parallel else "{"


JSON_CALLS = CallFormat("json")
# Hermes / Qwen 2.5: each call `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`
HERMES_CALLS = CallFormat("hermes", wrap=("<tool_call>\n", "\n</tool_call>"))
# Llama 3.1 / 3.2: one bare object `{"name": ..., "parameters": ...}`
LLAMA3_CALLS = CallFormat("llama3", args_key="parameters", several=False)


def template_format(template: str | None) -> CallFormat:
    """The call format a chat template renders its `tools` for, known by its markers; ours when
    the template does not use `tools` or its format is not one of these."""
    if not template or not re.search(r"\btools\b", template):
        return JSON_CALLS
    if "<tool_call>" in template:
        return HERMES_CALLS
    if '"parameters"' in template:  # Llama 3.1's '{"name": function name, "parameters": ...}'
        return LLAMA3_CALLS
    return JSON_CALLS


@dataclass
class ToolPlan:
    """How a chat request with tools is answered: the functions the model may call, what the
    request's tool_choice allows ("auto", "required", or one function's name), whether the
    answer may hold several calls (parallel_tool_calls, where the format has them), and the
    format of calls (ours in the system message, or the chat template's own)."""

    functions: dict[str, api.FunctionDef]
    choice: str  # "auto", "required" or "name:<function>"
    parallel: bool = True
    format: CallFormat = JSON_CALLS

    def __post_init__(self) -> None:
        self.parallel = self.parallel and self.format.several

    def callable(self) -> list[api.FunctionDef]:
        if self.choice.startswith("name:"):
            return [self.functions[self.choice[5:]]]
        return list(self.functions.values())

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` a template that renders them itself gets (None: ours, in the system message)."""
        if self.format is JSON_CALLS:
            return None
        return [
            {"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions.values()
        ]

    def instructions(self) -> str | None:
        """Our format's system message (None: the template shows the tools)."""
        if self.format is not JSON_CALLS:
            return None
        listing = [
            {k: v for k, v in (("name", f.name), ("description", f.description)) if v}
            | {"parameters": f.parameters or NO_ARGUMENTS}
            for f in self.functions.values()
        ]
        if self.choice == "auto":
            when = "If a function helps, call it; otherwise answer normally."
        elif self.choice == "required":
            when = "You must call one of them."
        else:
            when = f"You must call {self.choice[5:]}."
        several = (
            "To call several at once, answer with a JSON array of such objects. " if self.parallel else ""
        )
        return (
            "You can call these functions (each with a JSON Schema of its arguments):\n"
            + json.dumps(listing, ensure_ascii=False)
            + '\nTo call one, answer with only a JSON object {"name": <function name>, "arguments": '
            + "<an object of its arguments>}. "
            + several
            + when
        )

    def call_schema(self) -> dict[str, Any]:
        """A JSON Schema that only one call the request allows matches. A function's parameters
        that refer to their own parts ($ref "#/$defs/...", as pydantic writes nested models) move to
        this schema's $defs, their references rebased there: nested in the call, "#" would be the
        call's root, not theirs."""
        key = self.format.args_key
        calls, defs = [], {}
        for i, f in enumerate(self.callable()):
            args = f.parameters or NO_ARGUMENTS
            rebased = _rebased(args, f"#/$defs/args{i}")
            if rebased != args:
                defs[f"args{i}"] = rebased
                args = {"$ref": f"#/$defs/args{i}"}
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, key: args},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
            )
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**one, "$defs": defs} if defs else one

    def openers(self) -> str:
        """The first characters of an answer that is calls."""
        return self.format.openers(self.parallel)

    def constraint(self) -> Constraint:
        """Calls as the format writes them: one, or (parallel) 1 to MAX_PARALLEL_CALLS (a JSON
        array in ours, one tagged block after another in Hermes'). Under auto, also a text that
        cannot be mistaken for calls: its first non-blank character is not one calls start with
        (so a text is never read as calls)."""
        one = self.call_schema()
        if self.format.wrap is None:
            several = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
            answer = {"anyOf": [one, several]} if self.parallel else one
            if "$defs" in one:  # the references point at the root's
                answer["$defs"] = one["$defs"]
            if self.choice != "auto":
                return _constraint("json_schema", answer)
            rules = [f"calls: %json {json.dumps(closed_objects(answer), ensure_ascii=False)}"]
        else:
            opening, closing = (json.dumps(t) for t in self.format.wrap)
            n = MAX_PARALLEL_CALLS if self.parallel else 1
            rules = [
                "calls: " + " | ".join(' "\\n" '.join(["block"] * k) for k in range(1, n + 1)),
                f"block: {opening} call {closing}",
                f"call: %json {json.dumps(closed_objects(one), ensure_ascii=False)}",
            ]
        start = "calls"
        if self.choice == "auto":
            not_opener = "".join("\\" + c if c in "[]{}^-\\" else c for c in self.openers())
            rules.append(f"TEXT: /\\s*([^{not_opener}\\s][\\s\\S]*)?/")
            start = "calls | TEXT"
        return _constraint("lark", "\n".join([f"start: {start}", *rules]) + "\n")


@dataclass
class ScannedCall:
    """A call object in (a prefix of) an answer: its name once the name's string is complete,
    and where the JSON text of its arguments starts and (once it is closed) ends."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None

    def arguments(self, text: str) -> str:
        """The arguments' JSON text so far."""
        if self.args_start is None:
            return ""
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]


def scan_calls(text: str, args_key: str = "arguments") -> list[ScannedCall]:
    """The call objects of an answer's text, complete or not: a top-level object, or the objects
    of a top-level array. Reads the JSON as far as it goes (a stream's prefix), so a call's name
    and the growing text of its arguments are known while it is generated."""
    calls: list[ScannedCall] = []
    stack: list[str] = []  # the open objects and arrays
    call_depth = -1  # len(stack) inside the current call object; -1: outside any
    key: str | None = None  # the call object's key whose value is being read
    expect_key = False
    string_start: int | None = None
    escaped = False
    for i, ch in enumerate(text):
        if string_start is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                if len(stack) == call_depth:
                    value = json.loads(text[string_start : i + 1])
                    if expect_key:
                        key = value
                    elif key == "name":
                        calls[-1].name = value
                string_start = None
            continue
        if ch == '"':
            string_start = i
        elif ch in "{[":
            if ch == "{" and stack in ([], ["["]):
                calls.append(ScannedCall())
                call_depth, key, expect_key = len(stack) + 1, None, True
            elif len(stack) == call_depth and key == args_key and not expect_key:
                calls[-1].args_start = i
            stack.append(ch)
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            if len(stack) == call_depth and key == args_key and calls[-1].args_start is not None:
                calls[-1].args_end = i + 1
            elif len(stack) < call_depth:
                call_depth = -1
        elif len(stack) == call_depth and ch in ":,":
            expect_key = ch == ","
            if expect_key:
                key = None
    return calls


class CallStream:
    """An answer under a tool plan, as it is sent: each `feed` (a piece of the generated text)
    returns the stream's chunks for it (keyword arguments of api.Reply.chunk: a text, or
    tool_calls deltas), `end` the last ones and the calls. An answer that may be a text (auto) is
    held until its first non-blank character says which it is. Once it is calls, each call's id,
    type and name go out as soon as its name is complete, then its arguments as they are
    generated (OpenAI's order), so the joined deltas are the call's arguments text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.is_call: bool | None = True if plan.choice != "auto" else None
        self.ids: list[str] = []  # the calls whose head is sent
        self.sent: list[int] = []  # how much of each one's arguments text is sent

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.is_call is None:
            start = self.text.lstrip()[:1]
            if not start:
                return []
            self.is_call = start in self.plan.openers()
            if not self.is_call:
                return [{"text": self.text}]
        elif not self.is_call:
            return [{"text": piece}] if piece else []
        return self._deltas()

    def _deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, call in enumerate(scan_calls(self.text, self.plan.format.args_key)):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                function = {"name": call.name, "arguments": ""}
                out.append(
                    {
                        "tool_calls": [
                            {"index": i, "id": self.ids[i], "type": "function", "function": function}
                        ]
                    }
                )
            arguments = call.arguments(self.text)
            if len(arguments) > self.sent[i]:
                out.append(
                    {"tool_calls": [{"index": i, "function": {"arguments": arguments[self.sent[i] :]}}]}
                )
                self.sent[i] = len(arguments)
        return out

    def end(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The last chunks, and the answer's calls as sent (None: the answer is a text). Calls
        cut off by max_tokens are calls too, their arguments as far as they got (as in OpenAI's
        API); a call is one once its name is complete, so an answer cut off before any name is
        a text."""
        if not self.is_call or not self.ids:
            held = self.is_call is not False and self.text
            return ([{"text": self.text}] if held else []), None
        calls = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments(self.text)},
            }
            # the scan may end with one more call whose name was cut off: not a call
            for call_id, c in zip(self.ids, scan_calls(self.text, self.plan.format.args_key), strict=False)
        ]
        return [], calls


def answer_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """A whole answer's calls, as a stream of it would have sent them (None: a text)."""
    stream = CallStream(plan)
    stream.feed(text)
    return stream.end()[1]


def tool_plan(
    req: api.ChatRequest, engine_name: str, capabilities: frozenset[str], template: str | None = None
) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none" (the model then answers in
    text, and the tools are not shown to it). Tools need the engine's `structured` capability.
    template: the engine's chat template, whose own tool format is used where it has one."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools")
        return None
    if choice == "none":
        return None
    require_structured("tools", engine_name, capabilities)
    if (
        (req.response_format is not None and req.response_format.type != "text")
        or req.json_schema is not None
        or req.grammar is not None
    ):
        raise UnsupportedOption(
            "response_format, json_schema or grammar together with tools is not supported",
            hint="give tools or an output format, not both",
        )
    if req.logprobs:
        raise UnsupportedOption("logprobs together with tools is not supported", hint="remove logprobs")
    parallel = req.parallel_tool_calls is not False  # OpenAI's default is true
    functions: dict[str, api.FunctionDef] = {}
    for tool in req.tools:
        if tool.function.name in functions:
            raise InvalidRequest(f"tools: the function name {tool.function.name!r} is declared twice")
        functions[tool.function.name] = tool.function
    if isinstance(choice, api.NamedToolChoice):
        if choice.function.name not in functions:
            raise InvalidRequest(
                f"tool_choice names the function {choice.function.name!r}, which tools does not declare",
                hint="declared: " + ", ".join(functions),
            )
        return ToolPlan(functions, "name:" + choice.function.name, parallel, template_format(template))
    return ToolPlan(functions, choice or "auto", parallel, template_format(template))


def chat_messages(req: api.ChatRequest, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation as the chat template gets it: ours (api.chat_messages: the tools in the
    system message, calls and results written as text), or for a template with its own tool
    format OpenAI's messages as such templates read them: an assistant's `tool_calls` with the
    arguments as objects, and `tool` messages with their `tool_call_id`."""
    ours = api.chat_messages(req, plan.instructions() if plan is not None else None)  # checks them too
    if plan is None or plan.format is JSON_CALLS:
        return ours
    out: list[dict[str, Any]] = []
    for m, plain in zip(req.messages, ours, strict=True):
        message: dict[str, Any] = {
            "role": m.role if m.role == "tool" else plain["role"],
            "content": plain["content"],
        }
        if m.role == "tool":
            message.update(content=api._text(m.content), tool_call_id=m.tool_call_id)
        if m.tool_calls:
            message["content"] = api._text(m.content)
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": json.loads(api.call_text(c))}
                for c in m.tool_calls
            ]
        out.append(message)
    return out


# --- an engine whose server makes the calls (the openai engine's `tool_calls`) -----------------


def forwarded(plan: ToolPlan) -> ToolPlan:
    """The plan for an engine that passes the tools on: the upstream server shows them to its
    model and constrains the answer; its calls come back as a JSON array of our call objects."""
    return ToolPlan(plan.functions, plan.choice, parallel=True)


def tool_fields(req: api.ChatRequest) -> dict[str, Any]:
    """OpenAI's tool fields of the request, as an upstream server takes them."""
    out: dict[str, Any] = {"tools": [t.model_dump(exclude_none=True) for t in req.tools or []]}
    if req.tool_choice is not None:
        choice = req.tool_choice
        out["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out


def upstream_messages(req: api.ChatRequest) -> list[dict[str, Any]]:
    """OpenAI's messages as the client sent them (an assistant's tool_calls and the tool results
    included), for an upstream server that renders tools itself."""
    api.chat_messages(req)  # the same checks as for a local template
    return [m.model_dump(exclude_unset=True) for m in req.messages]
