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


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolPlan:
    """How a chat request with tools is answered: the functions the model may call and what the
    request's tool_choice allows ("auto", "required", or one function's name)."""

    functions: dict[str, api.FunctionDef]
    choice: str  # "auto", "required" or "name:<function>"

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
        return (
            "You can call these functions (each with a JSON Schema of its arguments):\n"
            + json.dumps(listing, ensure_ascii=False)
            + '\nTo call one, answer with only a JSON object {"name": <function name>, "arguments": '
            + "<an object of its arguments>}. "
            + when
        )

    def call_schema(self) -> dict[str, Any]:
        """A JSON Schema that only a call of a function the request allows matches."""
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
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def constraint(self) -> Constraint:
        if self.choice != "auto":
            return _constraint("json_schema", self.call_schema())
        # either a call, or a text that cannot be mistaken for one (it does not start with "{")
        schema = json.dumps(closed_objects(self.call_schema()), ensure_ascii=False)
        return _constraint("lark", f"start: call | TEXT\ncall: %json {schema}\nTEXT: /[^{{][\\s\\S]*/\n")

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The answer's tool calls in OpenAI's shape, or None when the answer is not a call (a
        text, or a call cut off by max_tokens)."""
        if not text.lstrip().startswith("{"):
            return None
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if (
            not isinstance(call, dict)
            or call.get("name") not in {f.name for f in self.callable()}
            or not isinstance(call.get("arguments"), dict)
        ):
            return None
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        return [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        ]


def call_deltas(calls: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A stream's tool_calls deltas for whole calls: each call's id, type and name with empty
    arguments, then its arguments (a client joins the pieces, as with any streamed call)."""
    out: list[list[dict[str, Any]]] = []
    for i, call in enumerate(calls):
        head = {**call, "function": {"name": call["function"]["name"], "arguments": ""}}
        out.append([{"index": i, **head}])
        out.append([{"index": i, "function": {"arguments": call["function"]["arguments"]}}])
    return out


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
        return ToolPlan(functions, "name:" + choice.function.name)
    return ToolPlan(functions, choice or "auto")
