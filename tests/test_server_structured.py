"""Structured output and tool calls through `infer serve` (issue 19), with real clients: the
`openai` client's `chat.completions.parse` with a pydantic model, a tool-call round trip (whole
and streamed), llama-server's `json_schema` field, and the `llm` CLI's `--schema`.

Validity is checked independently of the code under test: by pydantic (the client's own parse),
by `jsonschema`, and by json.loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import llguidance
import openai
import pytest
from pydantic import BaseModel, Field
from test_server_engines import RealServer, engine_ready

from stdengine.errors import InvalidRequest, UnsupportedOption
from stdengine.server import api, tools
from stdengine.structured import Constraint, Vocabulary, tokenizer_for

# --- request parsing, without a model -------------------------------------------------------------


def chat_request(**fields: Any) -> api.ChatRequest:
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    return api.parse(api.ChatRequest, body)


def test_response_format_needs_the_structured_capability() -> None:
    rf = {"type": "json_object"}
    with pytest.raises(UnsupportedOption, match="response_format .*'structured' capability"):
        tools.constraint_for(chat_request(response_format=rf), "toy", frozenset({"stream"}))
    with pytest.raises(UnsupportedOption, match="grammar"):
        completion = api.parse(api.CompletionRequest, {"prompt": "x", "grammar": 'root ::= "a"'})
        tools.constraint_for(completion, "toy", frozenset())
    with pytest.raises(UnsupportedOption, match="tools"):
        tools.tool_plan(chat_request(tools=[WEATHER]), "toy", frozenset())
    # text is no constraint, and tool_choice none leaves the tools out: any engine answers
    assert tools.constraint_for(chat_request(response_format={"type": "text"}), "toy", frozenset()) is None
    assert tools.tool_plan(chat_request(tools=[WEATHER], tool_choice="none"), "toy", frozenset()) is None


def test_bad_structured_requests_are_400s() -> None:
    caps = frozenset({"structured"})
    with pytest.raises(InvalidRequest, match="response_format.type"):
        chat_request(response_format={"type": "xml"})
    with pytest.raises(InvalidRequest, match="json_schema.schema"):
        tools.constraint_for(
            chat_request(response_format={"type": "json_schema", "json_schema": {"name": "a"}}), "e", caps
        )
    with pytest.raises(InvalidRequest, match="both constrain"):
        tools.constraint_for(
            chat_request(response_format={"type": "json_object"}, grammar='root ::= "a"'), "e", caps
        )
    for kind in ("json_object", "text"):  # a schema that would be ignored
        schema = {"name": "a", "schema": {"type": "integer"}}
        with pytest.raises(InvalidRequest, match=f"type {kind} takes no json_schema"):
            tools.constraint_for(
                chat_request(response_format={"type": kind, "json_schema": schema}), "e", caps
            )
    with pytest.raises(InvalidRequest, match="'nope', which tools does not declare"):
        tools.tool_plan(
            chat_request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "e",
            caps,
        )
    with pytest.raises(UnsupportedOption, match="together with tools"):
        tools.tool_plan(chat_request(tools=[WEATHER], grammar='root ::= "a"'), "e", caps)
    with pytest.raises(UnsupportedOption, match="together with tools"):
        tools.tool_plan(chat_request(tools=[WEATHER], response_format={"type": "json_object"}), "e", caps)
    with pytest.raises(InvalidRequest, match="tool_choice needs tools"):
        tools.tool_plan(chat_request(tool_choice="required"), "e", caps)
    with pytest.raises(InvalidRequest, match="tools.0.function.name"):
        chat_request(tools=[{"type": "function", "function": {"name": "bad name"}}])
    with pytest.raises(InvalidRequest):  # the library's message: the schema cannot be compiled
        tools.constraint_for(chat_request(json_schema={"type": "object", "minProperties": "x"}), "e", caps)
    with pytest.raises(UnsupportedOption, match="functions"):
        api.refuse_unsupported(chat_request(functions=[{"name": "f"}]))


# a conversation with an earlier call and its result
HISTORY = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
]


def test_tool_history_is_written_back_in_the_call_format() -> None:
    req = chat_request(
        messages=HISTORY,
        tools=[WEATHER],
    )
    plan = tools.tool_plan(req, "e", frozenset({"structured"}))
    assert plan is not None
    messages = api.chat_messages(req, plan.instructions())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "get_weather" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert messages[3]["content"] == "Result of get_weather: rain"


def test_closed_objects_follows_llama_server() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "$defs": {"d": {"properties": {}}},
        "anyOf": [{"properties": {}}, {"properties": {}, "additionalProperties": True}],
    }
    closed = tools.closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False  # a field named "properties"
    assert "additionalProperties" not in closed["properties"]  # the map of fields is no schema
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert [s["additionalProperties"] for s in closed["anyOf"]] == [False, True]
    # integers without bounds are kept to the range every JSON parser holds exactly
    age = tools.closed_objects({"type": "integer", "minimum": 0})
    assert age == {"type": "integer", "minimum": 0, "maximum": 2**53 - 1}


# --- parallel tool calls: the constraint and the parsing, on a byte vocabulary ----------------------


class _Owner:  # what a byte vocabulary's compiled tokenizer is cached on
    pass


_BYTES = _Owner()


def accepts(constraint: Constraint, text: str) -> bool:
    """Whether the constraint lets a generation produce exactly this text and end (each byte one
    token, the end-of-generation token 256)."""
    vocab = Vocabulary([bytes([i]) for i in range(256)] + [b"<eos>"], [256], [256], list)
    matcher = llguidance.LLMatcher(tokenizer_for(_BYTES, lambda: vocab), constraint.compiled, log_level=0)
    data = list(text.encode())
    if matcher.validate_tokens(data) != len(data):
        return False
    matcher.consume_tokens(data)
    return bool(matcher.is_accepting())


def plan_for(**fields: Any) -> tools.ToolPlan:
    plan = tools.tool_plan(chat_request(tools=[WEATHER, ADD], **fields), "e", frozenset({"structured"}))
    assert plan is not None
    return plan


OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
ADD_1_2 = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("parallel", [True, False])
def test_parameters_with_their_own_definitions(choice: str, parallel: bool) -> None:
    """The openai client's tool from a pydantic model with a nested one: its parameters keep the
    nested model in $defs and refer to it as "#/$defs/Pet"; the calls' constraint follows them."""
    tool: Any = openai.pydantic_function_tool(Person, name="person")
    assert '"#/$defs/Pet"' in json.dumps(tool)
    request = chat_request(tools=[tool, ADD], tool_choice=choice, parallel_tool_calls=parallel)
    plan = tools.tool_plan(request, "e", frozenset({"structured"}))
    assert plan is not None
    good = '{"name": "person", "arguments": {"name": "Ann", "age": 3, "pets": [{"kind": "cat", "legs": 4}]}}'
    bad = '{"name": "person", "arguments": {"name": "Ann", "age": 3, "pets": [{"kind": "cow", "legs": 4}]}}'
    assert accepts(plan.constraint(), good) and accepts(plan.constraint(), ADD_1_2)
    assert not accepts(plan.constraint(), bad)  # the Pet's kind is checked through the reference
    # without parallel calls an array is refused, or under auto a text like any other
    assert accepts(plan.constraint(), f"[{good}, {ADD_1_2}]") == (parallel or choice == "auto")


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_parallel_calls_are_an_array_of_calls(choice: str) -> None:
    """parallel_tool_calls (OpenAI's default true): the answer may be one call or an array of
    calls; false: exactly one call. Under auto a text stays possible, but never one that starts
    like a call."""
    two = f"[{OSLO}, {ADD_1_2}]"
    parallel, single = plan_for(tool_choice=choice), plan_for(tool_choice=choice, parallel_tool_calls=False)
    assert accepts(parallel.constraint(), OSLO) and accepts(single.constraint(), OSLO)
    assert accepts(parallel.constraint(), two)
    # without parallel calls an array is no call: refused, or under auto a text like any other
    assert accepts(single.constraint(), two) == (choice == "auto")
    assert not accepts(parallel.constraint(), "[]")  # an array holds at least one call
    bound = tools.MAX_PARALLEL_CALLS
    assert accepts(parallel.constraint(), "[" + ", ".join([OSLO] * bound) + "]")
    assert not accepts(parallel.constraint(), "[" + ", ".join([OSLO] * (bound + 1)) + "]")
    bad = '[{"name": "add", "arguments": {"a": 1, "b": 20}}]'  # b above its maximum
    assert not accepts(parallel.constraint(), bad)
    assert accepts(parallel.constraint(), "Hello.") == (choice == "auto")
    assert not accepts(parallel.constraint(), " " + two)  # blank, then a call: neither text nor call

    calls = tools.answer_calls(parallel, two)
    assert calls is not None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Oslo", "unit": "celsius"},
        {"a": 1, "b": 2},
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    if choice == "auto":
        assert tools.answer_calls(single, two) is None  # without parallel calls an array is a text
        assert tools.answer_calls(parallel, "Hello.") is None
    assert "You must call one of them" in plan_for(tool_choice="required").instructions()
    assert "JSON array" in parallel.instructions() and "JSON array" not in single.instructions()


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_call_arguments_stream_as_they_are_generated(choice: str, step: int) -> None:
    """Fed in pieces of `step` characters: each call's id, type and name come first, once its
    name is complete, then its arguments in pieces as they grow, before the answer ends; joined
    by index they are the whole answer's calls. A call cut off by max_tokens keeps what came."""
    plan = plan_for(tool_choice=choice)
    answer = f" [{OSLO},\n {ADD_1_2}]" if choice == "required" else f"[{OSLO}, {ADD_1_2}]"
    stream = tools.CallStream(plan)
    joined: dict[int, dict[str, str]] = {}
    pieces_before_end = 0
    for k in range(0, len(answer), step):
        for chunk in stream.feed(answer[k : k + step]):
            assert "text" not in chunk
            (delta,) = chunk["tool_calls"]
            call = joined.setdefault(delta["index"], {"name": "", "arguments": ""})
            if "id" in delta:  # the head: first, once
                assert call == {"name": "", "arguments": ""} and delta["type"] == "function"
                call["id"] = delta["id"]
            assert "id" in call  # nothing of a call before its head
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"]["arguments"]
            pieces_before_end += 1
    last, calls = stream.end()
    assert last == [] and calls is not None and pieces_before_end > 4
    assert [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ] == [joined[i] for i in range(len(joined))]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Oslo", "unit": "celsius"},
        {"a": 1, "b": 2},
    ]
    cut = tools.answer_calls(plan, answer[: answer.index('"b"')])  # max_tokens ends it here
    assert cut is not None and [c["function"]["arguments"] for c in cut] == [
        '{"city": "Oslo", "unit": "celsius"}',
        '{"a": 1, ',
    ]
    assert tools.answer_calls(plan, answer[: answer.index("get_weather") + 3]) is None  # no name yet


def test_finish_reason_of_calls() -> None:
    """tool_calls only for calls the constraint ended; cut-off calls keep the generation's reason."""
    from stdengine.adapter import DoneEvent, Timings, Usage

    def done(reason: Any, stop: str | None = None) -> DoneEvent:
        return DoneEvent(reason, Usage(), Timings(), stop=stop)

    calls = [{"id": "call_1"}]
    assert api.finish_reason(done("stop"), calls) == "tool_calls"
    assert api.finish_reason(done("length"), calls) == "length"
    assert api.finish_reason(done("stop", stop="}"), calls) == "stop"  # a stop string cut it
    assert api.finish_reason(done("stop"), None) == "stop"


def test_a_text_streams_as_text() -> None:
    stream = tools.CallStream(plan_for(tool_choice="auto"))
    assert stream.feed(" \n") == [] and stream.feed("Hi") == [{"text": " \nHi"}]
    assert stream.feed(" {x}") == [{"text": " {x}"}] and stream.end() == ([], None)
    empty = tools.CallStream(plan_for(tool_choice="auto"))
    assert empty.feed("") == [] and empty.end() == ([], None)


# A toy chat template in the Hermes / Qwen 2.5 tool format (written for this test): the tools in
# <tools>, each call in <tool_call> tags, results in <tool_response> (ChatML turns).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}You may call functions, listed in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with a JSON object in <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}{% if not (tools and loop.first and m.role == 'system') %}
<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}
<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
LLAMA3_LIKE = """{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of
argument name and its value}.{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"""


def test_template_tool_formats_are_known_by_their_markers() -> None:
    assert tools.template_format(HERMES_TEMPLATE) is tools.HERMES_CALLS
    assert tools.template_format(LLAMA3_LIKE) is tools.LLAMA3_CALLS
    # no tools variable, or a format not recognised (Mistral's [TOOL_CALLS]): ours
    assert tools.template_format("{% for m in messages %}{{ m.content }}{% endfor %}") is tools.JSON_CALLS
    assert tools.template_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") is tools.JSON_CALLS
    assert tools.template_format(None) is tools.JSON_CALLS


def test_hermes_template_renders_the_tools_and_its_calls_come_back() -> None:
    from stdengine.generation import render_chat_template

    req = chat_request(
        messages=HISTORY,
        tools=[WEATHER, ADD],
        tool_choice="required",
    )
    plan = tools.tool_plan(req, "e", frozenset({"structured"}), HERMES_TEMPLATE)
    assert plan is not None and plan.format is tools.HERMES_CALLS and plan.instructions() is None
    listed = plan.template_tools()
    assert listed is not None and [t["function"]["name"] for t in listed] == ["get_weather", "add"]
    text = render_chat_template(HERMES_TEMPLATE, tools.chat_messages(req, plan), tools=listed)
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]  # the template listed the tools
    earlier = text.split("weather?")[1].split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    assert json.loads(earlier) == {"name": "get_weather", "arguments": {"city": "Oslo"}}  # the earlier call
    assert "<tool_response>\nrain\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")

    one = "<tool_call>\n" + OSLO + "\n</tool_call>"
    two = one + "\n<tool_call>\n" + ADD_1_2 + "\n</tool_call>"
    assert accepts(plan.constraint(), one) and accepts(plan.constraint(), two)
    assert not accepts(plan.constraint(), OSLO)  # the template's format, not ours
    calls = tools.answer_calls(plan, two)
    assert calls is not None and [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("add", {"a": 1, "b": 2}),
    ]
    auto = tools.tool_plan(chat_request(tools=[WEATHER]), "e", frozenset({"structured"}), HERMES_TEMPLATE)
    assert auto is not None
    assert accepts(auto.constraint(), "Hello.") and accepts(auto.constraint(), one)
    assert not accepts(auto.constraint(), "<b>Hello</b>")  # a text cannot start like a call
    assert tools.answer_calls(auto, "Hello.") is None


def test_llama3_format_has_one_call_with_parameters() -> None:
    plan = tools.tool_plan(
        chat_request(tools=[WEATHER, ADD], tool_choice="required"),
        "e",
        frozenset({"structured"}),
        LLAMA3_LIKE,
    )
    assert plan is not None and not plan.parallel  # one call per answer in this format
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert accepts(plan.constraint(), call) and not accepts(plan.constraint(), ADD_1_2)
    calls = tools.answer_calls(plan, call)
    assert calls is not None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


def test_several_earlier_calls_are_written_back_as_an_array() -> None:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": f'{{"a": {i}, "b": 1}}'}}
        for i in (1, 2)
    ]
    req = chat_request(
        messages=[
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c2", "content": "3"},
        ],
        tools=[ADD],
    )
    messages = api.chat_messages(req)
    assert json.loads(messages[1]["content"]) == [
        {"name": "add", "arguments": {"a": 1, "b": 1}},
        {"name": "add", "arguments": {"a": 2, "b": 1}},
    ]
    assert messages[2]["content"] == "Result of add: 3"


# --- end to end, on both catalogue models ---------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"],
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}  # type: ignore[index]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str
    age: int
    pets: list[Pet] = Field(max_length=3)


# both engines that declare the `structured` capability (LocalEngine applies the mask), on both
# catalogue models
@pytest.fixture(
    scope="module",
    params=[(e, m) for e in ("reference", "llamacpp") for m in ("smollm2", "gemma3")],
    ids=lambda p: "-".join(p),
)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    engine, alias = request.param
    model: Path = request.getfixturevalue(f"{alias}_path")
    why = engine_ready(engine, model)
    if why is not None:
        pytest.skip(why)
    # the tool instructions need more than RealServer's 256 positions
    server = RealServer(engine, model, tmp_path_factory.mktemp("serve-structured"), "-c", "1024")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(served: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, seed: int | None) -> None:
    sampling: Any = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    r = client.chat.completions.parse(
        model=model_id(client),
        messages=[{"role": "user", "content": "Describe a person and their pets as JSON."}],
        response_format=Person,
        max_tokens=200,
        **sampling,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content  # complete, not cut off
    assert isinstance(choice.message.parsed, Person)  # the client validated it with pydantic


# a few-shot prompt: with any object allowed, the model must also want to end one
PROMPT = 'A person as JSON: {"name": "Bob", "colors": ["red", "blue"]}\nAnother person as JSON: '


def test_json_object_and_llama_server_json_schema_on_completions(served: RealServer) -> None:
    schema = {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]+$"},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["colors"],
    }
    with httpx.Client(base_url=served.url, timeout=300) as http:
        for extra, check in (
            ({"response_format": {"type": "json_object"}}, lambda v: isinstance(v, dict)),
            ({"json_schema": schema}, lambda v: jsonschema.validate(v, schema) is None),
        ):
            r = http.post(
                "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 120, "temperature": 0, **extra},
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop" and check(json.loads(choice["text"])), choice


def test_a_schema_the_matcher_cannot_follow_is_a_400(served: RealServer) -> None:
    """A schema that refers only to itself compiles, but no output can start: refused before any
    token, whole or streamed, as the client's mistake (not a 500)."""
    with httpx.Client(base_url=served.url, timeout=300) as http:
        for stream in (False, True):
            body = {"prompt": PROMPT, "max_tokens": 8, "json_schema": {"$ref": "#"}, "stream": stream}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and "cannot be followed" in error["message"], (
                error
            )
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    model = model_id(client)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    named: Any = {"type": "function", "function": {"name": "add"}}
    for choice in ("required", named):
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER, ADD],
            tool_choice=choice,
            parallel_tool_calls=False,  # one call: a small model may repeat calls until max_tokens
            max_tokens=80,
            temperature=0,  # type: ignore[list-item]
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        name = call.function.name  # type: ignore[union-attr]
        assert name == "add" if choice == named else name in PARAMETERS
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[name])  # type: ignore[union-attr]
    # the call and its result go back; the model answers in text
    messages += [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, ADD],
        tool_choice="none",
        max_tokens=10,
        temperature=0,  # type: ignore[list-item]
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_parallel_tool_calls(client: openai.OpenAI) -> None:
    """OpenAI's default parallel_tool_calls: the answer may hold several calls, each valid, each
    with its own id; MAX_PARALLEL_CALLS bounds them, so the answer completes (the catalogue
    models, greedy, answer one call or fill the bound here)."""
    r = client.chat.completions.create(
        model=model_id(client),
        messages=[{"role": "user", "content": "What is the weather in Paris and in Rome?"}],
        tools=[WEATHER, ADD],
        tool_choice="required",
        max_tokens=300,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = c.message.tool_calls or []
    assert 1 <= len(calls) <= tools.MAX_PARALLEL_CALLS
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        name = call.function.name  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[name])  # type: ignore[union-attr]


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_tool_calls_are_the_whole_answer(client: openai.OpenAI, choice: str) -> None:
    """Greedy: the stream's content, or its delta.tool_calls joined by index, is the whole
    answer's (under auto the model may answer either way; both are checked)."""
    for prompt in ("Add 2 and 3.", "Say hello."):
        args: Any = {
            "model": model_id(client),
            "messages": [{"role": "user", "content": prompt}],
            "tools": [WEATHER, ADD],
            "tool_choice": choice,
            "max_tokens": 200 if choice == "required" else 40,  # room for several calls
            "temperature": 0,
        }
        whole = client.chat.completions.create(**args).choices[0]
        content, finish = "", None
        calls: dict[int, dict[str, str]] = {}  # index -> id, name, arguments joined
        for chunk in client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += d.function.name or "" if d.function else ""
                call["arguments"] += d.function.arguments or "" if d.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason
        if whole.message.tool_calls is None:
            assert content == whole.message.content and not calls
            if choice == "auto":
                assert not content.lstrip().startswith(("{", "["))  # auto's grammar: text, or calls
            continue
        assert not content
        assert sorted(calls) == list(range(len(whole.message.tool_calls)))
        assert len({c["id"] for c in calls.values()}) == len(calls)
        for i, call in enumerate(whole.message.tool_calls):
            function = call.function  # type: ignore[union-attr]
            assert (calls[i]["name"], calls[i]["arguments"]) == (function.name, function.arguments)
            if finish == "tool_calls":  # complete (not cut off by max_tokens)
                jsonschema.validate(json.loads(function.arguments), PARAMETERS[function.name])
        # the openai client's stream helper assembles the deltas into the same calls
        with client.chat.completions.stream(**args) as helper:
            final = helper.get_final_completion().choices[0]
        assert final.finish_reason == whole.finish_reason
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []] == [  # type: ignore[union-attr]
            (c.function.name, c.function.arguments)  # type: ignore[union-attr]
            for c in whole.message.tool_calls
        ]


def test_a_template_with_its_own_tool_format(smollm2_path: Path, tmp_path: Path) -> None:
    """infer serve with a chat template that renders tools (HERMES_TEMPLATE via --chat-template):
    the model is shown the template's tool list and answers in its <tool_call> format, which comes
    back as OpenAI's tool_calls, whole and streamed alike."""
    why = engine_ready("llamacpp", smollm2_path)
    if why is not None:
        pytest.skip(why)
    server = RealServer("llamacpp", smollm2_path, tmp_path, "-c", "1024", "--chat-template", HERMES_TEMPLATE)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        args: Any = {
            "model": model_id(client),
            "messages": [{"role": "user", "content": "Add 2 and 3."}],
            "tools": [WEATHER, ADD],
            "tool_choice": "required",
            "max_tokens": 200,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**args).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        calls = whole.message.tool_calls or []
        for call in calls:
            function = call.function  # type: ignore[union-attr]
            jsonschema.validate(json.loads(function.arguments), PARAMETERS[function.name])
        with client.chat.completions.stream(**args) as helper:
            streamed = helper.get_final_completion().choices[0]
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == [  # type: ignore[union-attr]
            (c.function.name, c.function.arguments)  # type: ignore[union-attr]
            for c in calls
        ]
    finally:
        assert server.stop() == 0


def test_llm_cli_schema(served: RealServer, client: openai.OpenAI, tmp_path: Path) -> None:
    """simonw's llm pointed at infer serve through its extra-openai-models.yaml (an api_base
    entry), with `--schema 'name, age int'` (llm's concise schema syntax)."""
    llm = shutil.which("llm", path=str(Path(sys.executable).parent))
    if llm is None:
        pytest.skip("llm is not installed (pip install 'stdengine[dev]')")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: infer\n  model_name: {model_id(client)}\n  api_base: {served.url}/v1\n  supports_schema: true\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "none"}
    out = subprocess.run(
        [
            llm,
            "-m",
            "infer",
            "--schema",
            "name, age int",
            "Invent a person.",
            "-o",
            "temperature",
            "0",
            "--no-log",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    value = json.loads(out.stdout)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)


# --- the openai engine passes constraints on ------------------------------------------------------


def test_openai_engine_sends_constraints_upstream() -> None:
    from http.server import ThreadingHTTPServer

    from test_openai_adapter import LlamaServerLike, load, run

    from stdengine.adapter import GenerateRequest, SamplingParams
    from stdengine.structured import Constraint

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), LlamaServerLike)
    httpd.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        engine = load(f"http://127.0.0.1:{httpd.server_address[1]}/v1")
        assert "structured" in engine.capabilities
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        grammar = 'root ::= "Hello"'
        for constraint, sent in (
            (Constraint.json_object(), {"response_format": {"type": "json_object"}}),
            (
                Constraint.json_schema(schema),
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "output", "schema": schema, "strict": True},
                    }
                },
            ),
            (Constraint.grammar(grammar, "gbnf"), {"grammar": grammar}),
        ):
            run(
                engine,
                GenerateRequest(prompt="hi", sampling=SamplingParams(n_predict=2), constraint=constraint),
            )
            body = httpd.bodies[-1]  # type: ignore[attr-defined]
            assert {k: body[k] for k in sent} == sent
        with pytest.raises(UnsupportedOption, match="cannot pass the regular expression"):
            run(engine, GenerateRequest(prompt="hi", constraint=Constraint.regex("a+")))
        engine.close()
    finally:
        httpd.shutdown()
