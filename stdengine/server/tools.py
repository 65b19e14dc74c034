"""Structured output and tool calls on the server: a request's `response_format` (and llama-server's
`json_schema` and `grammar`) become the GenerateRequest's constraint, and `tools` become a prompt
and a constraint whose answer is parsed back into OpenAI's `tool_calls`.

Tool calls use one format for every model (spec/server.md, "Tool calls"): the tool list goes into
the system message as JSON, with the instruction to answer a call as one JSON object
`{"name": ..., "arguments": {...}}`, and the earlier turns' calls and results are written back in
that format. For `required` and a named function the output is constrained to that object (the
name one of the declared functions, the arguments valid for its parameters), so a call is valid by
construction; for `auto` the output is either such an object or text that does not start with `{`.
"""

from __future__ import annotations

import json
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
MAX_PARALLEL_CALLS = 8


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolPlan:
    """How a chat request with tools is answered: the functions the model may call, what the
    request's tool_choice allows ("auto", "required", or one function's name), and whether the
    answer may hold several calls (parallel_tool_calls)."""

    functions: dict[str, api.FunctionDef]
    choice: str  # "auto", "required" or "name:<function>"
    parallel: bool = True

    def callable(self) -> list[api.FunctionDef]:
        if self.choice.startswith("name:"):
            return [self.functions[self.choice[5:]]]
        return list(self.functions.values())

    def instructions(self) -> str:
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
        """A JSON Schema that only an answer of calls the request allows matches: one call, or
        (parallel) also an array of 1 to MAX_PARALLEL_CALLS calls."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f.name},
                    "arguments": f.parameters or NO_ARGUMENTS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.callable()
        ]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if not self.parallel:
            return one
        several = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        return {"anyOf": [one, several]}

    def openers(self) -> str:
        """The first characters of an answer that is a call."""
        return "{[" if self.parallel else "{"

    def constraint(self) -> Constraint:
        if self.choice != "auto":
            return _constraint("json_schema", self.call_schema())
        # either calls, or a text that cannot be mistaken for them: its first non-blank character
        # is not one a call starts with (so a text is never parsed as a call)
        schema = json.dumps(closed_objects(self.call_schema()), ensure_ascii=False)
        not_opener = "".join("\\" + c for c in self.openers())
        text = f"/\\s*([^{not_opener}\\s][\\s\\S]*)?/"
        return _constraint("lark", f"start: call | TEXT\ncall: %json {schema}\nTEXT: {text}\n")

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The answer's tool calls in OpenAI's shape (each one's `arguments` the model's own JSON
        text), or None when the answer is not calls (a text, or calls cut off by max_tokens)."""
        if not text.lstrip()[:1] or text.lstrip()[0] not in self.openers():
            return None
        try:
            value = json.loads(text)
        except ValueError:
            return None
        items = value if isinstance(value, list) and self.parallel else [value]
        names = {f.name for f in self.callable()}
        scanned = scan_calls(text)
        if (
            not items
            or len(scanned) != len(items)
            or any(
                not isinstance(c, dict)
                or c.get("name") not in names
                or not isinstance(c.get("arguments"), dict)
                for c in items
            )
        ):
            return None
        return [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c["name"], "arguments": s.arguments(text)},
            }
            for c, s in zip(items, scanned, strict=True)
        ]


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


def call_deltas(calls: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A stream's tool_calls deltas for whole calls: each call's id, type and name with empty
    arguments, then its arguments (a client joins the pieces, as with any streamed call)."""
    out: list[list[dict[str, Any]]] = []
    for i, call in enumerate(calls):
        head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
        out.append([{"index": i, **head}])
        out.append([{"index": i, "function": {"arguments": call["function"]["arguments"]}}])
    return out


class CallStream:
    """A streamed answer under a tool plan, as it is sent: each `feed` and the `end` return the
    chunks to send (keyword arguments of api.Reply.chunk: a text, or tool_calls deltas). An
    answer that may be a text (auto) is held until its first non-blank character says which it
    is; calls are sent when the answer ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.is_call: bool | None = True if plan.choice != "auto" else None

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.is_call is None:
            start = self.text.lstrip()[:1]
            if not start:
                return []
            self.is_call = start in self.plan.openers()
            return [] if self.is_call else [{"text": self.text}]
        return [] if self.is_call or not piece else [{"text": piece}]

    def end(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The last chunks, and the calls (None: the answer was a text)."""
        if self.is_call is False:
            return [], None
        calls = self.plan.parse(self.text)
        if calls:
            return [{"tool_calls": d} for d in call_deltas(calls)], calls
        return ([{"text": self.text}] if self.text else []), None


def tool_plan(req: api.ChatRequest, engine_name: str, capabilities: frozenset[str]) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none" (the model then answers in
    text, and the tools are not shown to it). Tools need the engine's `structured` capability."""
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
        return ToolPlan(functions, "name:" + choice.function.name, parallel)
    return ToolPlan(functions, choice or "auto", parallel)
