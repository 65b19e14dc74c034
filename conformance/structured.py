"""The structured-output checks: constrained decoding in process (group `structured`) and through an
OpenAI-compatible server's `response_format` and `tools` (`http.structured.*`).

Every answer is judged by an independent validator (`jsonschema`, Python's `re`), never by the
constraint library the engine uses. The schemas bound every string, integer and array, so that a
correct engine's greedy answer ends well within the token budget on the catalogue models.
spec/conformance.md describes each check; keep the two in step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stdengine.conformance.cases import find_case, first_difference
from stdengine.conformance.checks import greedy, run_generate
from stdengine.conformance.http import model_id, request
from stdengine.conformance.suite import Check, Context, Level, NotSupported, Outcome

from stdengine.adapter import GenerateRequest
from stdengine.openai_wire import DONE, parse_chunk

N_PREDICT = 128  # tokens for one structured answer: each schema's answer needs far fewer


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: dict[str, Any]


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _str(max_length: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length}


# One schema per feature a validator must get right. The prompts invite values the schema
# forbids (a newborn's age under a minimum of 18, a lowercase code), so a constraint that is
# ignored shows.
SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "nested",
        "A person record in JSON, with the name and the address (city and postcode):\n",
        _obj(
            {
                "name": _str(24),
                "address": _obj(
                    {"city": _str(24), "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    ["city", "postcode"],
                ),
            },
            ["name", "address"],
        ),
    ),
    SchemaCase(
        "array",
        "The first prime numbers, and three colours, in JSON:\n",
        _obj(
            {
                "primes": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "minItems": 2,
                    "maxItems": 6,
                },
                "colours": {"type": "array", "items": _str(12), "minItems": 3, "maxItems": 3},
            },
            ["primes", "colours"],
        ),
    ),
    SchemaCase(
        "enum",
        "Classify the review 'I loved this film' in JSON:\n",
        _obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "stars": {"enum": [1, 2, 3, 4, 5]},
            },
            ["sentiment", "stars"],
        ),
    ),
    SchemaCase(
        "numbers",
        "A newborn baby's record in JSON (age in years, weight in kg, temperature in Celsius):\n",
        _obj(
            {
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "weight": {"type": "number", "minimum": 40, "maximum": 150},
                # an integer: a number's fraction is unbounded, and Gemma writes 30.000… to the end
                "temperature": {"type": "integer", "exclusiveMinimum": -50, "exclusiveMaximum": 60},
            },
            ["age", "weight", "temperature"],
        ),
    ),
    SchemaCase(
        "required",
        "A to-do item in JSON:\n",
        _obj(
            {
                "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                "title": _str(32),
                "done": {"type": "boolean"},
                "note": _str(16),
            },
            ["id", "title", "done"],  # "note" may be left out
        ),
    ),
    SchemaCase(
        "pattern",
        "A flight booking in JSON, with the date and the flight code:\n",
        _obj(
            {
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
            },
            ["date", "code"],
        ),
    ),
)

# a question with a short answer: any JSON object may go on for ever, and a small model's often does
JSON_OBJECT_PROMPT = (
    "The answer as a JSON object with the keys city and country. Where is the Eiffel Tower?\n"
)

# Regular expressions in the syntax both Python's re and the common constraint libraries read
# the same way: ASCII classes, bounded repeats.
REGEXES: dict[str, tuple[str, str]] = {
    "phone": ("My phone number is ", "[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    "words": ("Three fruits, lowercase, separated by commas: ", "[a-z]{1,12}(, [a-z]{1,12}){2}"),
}


# Grammars (llama.cpp's GBNF and llguidance's Lark), each with a Python regular expression that
# accepts the same language, the independent judge. Both are regular and finite, so an answer ends
# within the budget whatever the model does: the GBNF has several rules, a bounded repeat of a
# rule, an optional sign and character classes; the Lark one rule alternatives and regex terminals.
GRAMMARS: dict[str, tuple[str, str, str]] = {
    # syntax: (prompt, grammar, its language as a Python regex)
    "gbnf": (
        "Three variables and their integer values:\n",
        'root ::= "Answer: " item ("; " item){0,2} "."\n'
        'item ::= name " = " number\n'
        "name ::= [a-z] [a-z0-9_]{0,9}\n"
        'number ::= "-"? [0-9]{1,4}\n',
        r"Answer: [a-z][a-z0-9_]{0,9} = -?[0-9]{1,4}(; [a-z][a-z0-9_]{0,9} = -?[0-9]{1,4}){0,2}\.",
    ),
    "lark": (
        "A greeting for a new colleague, with her name and age:\n",
        'start: greeting ", " NAME "! You are " AGE " years old."\n'
        'greeting: "Hello" | "Hi" | "Dear"\n'
        "NAME: /[A-Z][a-z]{1,11}/\n"
        "AGE: /[1-9][0-9]?/\n",
        r"(Hello|Hi|Dear), [A-Z][a-z]{1,11}! You are [1-9][0-9]? years old\.",
    ),
}


# --- judging (shared by the in-process and the HTTP checks) ------------------------------------
def judge_json(out: Outcome, text: str, schema: dict[str, Any] | None, what: str) -> Any:
    """The text parses as JSON and, with a schema, validates against it (any JSON object without
    one). Returns the value, or None when it does not parse."""
    import jsonschema  # the independent validator

    try:
        value = json.loads(text)
    except ValueError as e:
        out.add("fail", f"NOT MET: {what}: the answer is not JSON ({e}): {text[:200]!r}")
        return None
    if schema is None:
        out.expect(
            isinstance(value, dict),
            f"{what}: a JSON object"
            if isinstance(value, dict)
            else f"{what}: a JSON {type(value).__name__}, not an object: {text[:200]!r}",
        )
        return value
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    out.expect(
        not errors,
        f"{what}: valid against the schema"
        if not errors
        else f"{what}: invalid against the schema: {errors[0].message} at {list(errors[0].path)} in {text[:200]!r}",
    )
    return value


def judge_regex(out: Outcome, text: str, pattern: str, what: str) -> None:
    ok = re.fullmatch(pattern, text) is not None
    out.expect(
        ok,
        f"{what}: {text!r} matches {pattern!r} in full"
        if ok
        else f"{what}: {text!r} does not match {pattern!r} in full",
    )


def shape_regex(text: str) -> str:
    """A regular expression that admits text and much else: each run of ASCII letters becomes
    `[A-Za-z]+`, each run of digits `[0-9]+`, every other character itself (escaped). Greedy
    decoding under it must give text back: the text's tokens are always allowed, so the mask never
    removes the argmax."""
    parts = []
    for m in re.finditer(r"[A-Za-z]+|[0-9]+|.", text, re.DOTALL):
        s = m.group()
        if s[0].isascii() and s[0].isalpha():
            parts.append("[A-Za-z]+")
        elif s[0].isascii() and s[0].isdigit():
            parts.append("[0-9]+")
        elif s.isascii() and not s.isprintable():
            parts.append(f"\\x{ord(s):02x}")  # newline, tab: a hex escape reads the same everywhere
        elif s.isascii() and not s.isalnum() and s != " ":
            parts.append("\\" + s)  # ASCII punctuation may be escaped in every regex dialect
        else:
            parts.append(s)
    return "".join(parts)


# --- in-process checks (group "structured") ----------------------------------------------------
def _constrained(ctx: Context, prompt: str, constraint: Any, n: int = N_PREDICT) -> tuple[str, Any]:
    """Greedy generation of prompt under constraint: the text and the DoneEvent."""
    _, text, done = run_generate(
        ctx.engine, GenerateRequest(prompt=prompt, sampling=greedy(n), constraint=constraint)
    )
    return text, done


def _expect_finished(out: Outcome, text: str, done: Any, what: str) -> None:
    """A constrained answer must end by itself (the constraint complete, or an end-of-generation
    token it accepts) within the budget: one cut off at n_predict need not be valid."""
    out.expect(
        done.finish_reason == "stop",
        f"{what}: ended by itself (finish reason {done.finish_reason!r})"
        if done.finish_reason == "stop"
        else f"{what}: did not end within {N_PREDICT} tokens (finish reason {done.finish_reason!r}): {text[:200]!r}",
    )


def json_schema_check(case: SchemaCase) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        from stdengine.structured import Constraint

        text, done = _constrained(ctx, case.prompt, Constraint.json_schema(case.schema))
        out.details.update(schema=case.schema, text=text)
        _expect_finished(out, text, done, f"schema {case.name}")
        judge_json(out, text, case.schema, f"schema {case.name}")

    return check


def json_object_check(ctx: Context, out: Outcome) -> None:
    from stdengine.structured import Constraint

    text, done = _constrained(ctx, JSON_OBJECT_PROMPT, Constraint.json_object())
    out.details["text"] = text
    _expect_finished(out, text, done, "json_object")
    judge_json(out, text, None, "json_object")


def regex_check(name: str) -> Callable[[Context, Outcome], None]:
    prompt, pattern = REGEXES[name]

    def check(ctx: Context, out: Outcome) -> None:
        from stdengine.structured import Constraint

        text, done = _constrained(ctx, prompt, Constraint.regex(pattern))
        out.details.update(pattern=pattern, text=text)
        _expect_finished(out, text, done, f"regex {name}")
        judge_regex(out, text, pattern, f"regex {name}")

    return check


def grammar_check(syntax: str) -> Callable[[Context, Outcome], None]:
    prompt, grammar, language = GRAMMARS[syntax]

    def check(ctx: Context, out: Outcome) -> None:
        from stdengine.structured import Constraint

        text, done = _constrained(ctx, prompt, Constraint.grammar(grammar, syntax))  # type: ignore[arg-type]
        out.details.update(grammar=grammar, language=language, text=text)
        _expect_finished(out, text, done, f"{syntax} grammar")
        judge_regex(out, text, language, f"{syntax} grammar")

    return check


UNCHANGED_CASES = ("raw:count", "raw:emoji")  # digits and punctuation; words, emoji and CJK


def unchanged_check(name: str) -> Callable[[Context, Outcome], None]:
    """A constraint that admits the model's own greedy text leaves it unchanged: the mask only
    removes tokens, never moves the argmax among those it keeps. The prompts are golden raw cases
    (no near ties on their greedy paths); the text compared with is the engine's own unconstrained
    greedy text (the golden checks compare that with the exact reference)."""

    def check(ctx: Context, out: Outcome) -> None:
        from stdengine.structured import Constraint

        case = find_case(ctx, name)
        n = len(case["ids"])
        _, want, _ = run_generate(ctx.engine, GenerateRequest(prompt=case["prompt"], sampling=greedy(n)))
        pattern = shape_regex(want)
        if re.fullmatch(pattern, want) is None:  # cannot happen: shape_regex admits its text
            raise AssertionError(f"the shape regex {pattern!r} does not admit the greedy text {want!r}")
        got, _ = _constrained(ctx, case["prompt"], Constraint.regex(pattern), n)
        out.details.update(pattern=pattern, greedy=want, constrained=got)
        out.expect(
            got == want,
            f"greedy under a regex that admits the greedy text gives it unchanged ({len(want)} characters)"
            if got == want
            else f"greedy under a regex that admits the greedy text changed it: {first_difference(got, want)}",
        )

    return check


def plan_structured(ctx: Context) -> list[Check]:
    """Optional checks; core for an engine that declares the `structured` capability (it then
    promises constrained decoding, and these checks hold it to it)."""
    level: Level = "core" if "structured" in ctx.capabilities else "optional"
    needs = frozenset({"structured"})
    checks = [
        Check(
            f"structured.json_schema:schema={c.name}",
            level,
            json_schema_check(c),
            needs,
            True,
            "greedy output under a JSON Schema parses and validates",
        )
        for c in SCHEMAS
    ]
    checks.append(
        Check(
            "structured.json_object",
            level,
            json_object_check,
            needs,
            True,
            "greedy output under json_object is a JSON object",
        )
    )
    checks += [
        Check(
            f"structured.regex:pattern={name}",
            level,
            regex_check(name),
            needs,
            True,
            "greedy output under a regex matches it in full",
        )
        for name in REGEXES
    ]
    checks += [
        Check(
            f"structured.grammar:syntax={syntax}",
            level,
            grammar_check(syntax),
            needs,
            True,
            "greedy output under a grammar is in its language",
        )
        for syntax in GRAMMARS
    ]
    checks += [
        Check(
            f"structured.unchanged:case={name}",
            level,
            unchanged_check(name),
            needs,
            True,
            "a regex that admits the greedy text leaves it unchanged",
        )
        for name in UNCHANGED_CASES
    ]
    return checks


# --- HTTP checks (http.structured.*) ------------------------------------------------------------
# A server that refuses a field answers 400 (422 from some frameworks' validation): not_supported,
# as the in-process checks are for an engine without the capability. A server that answers 200 and
# ignores the field fails: its answer is not what the client asked for.
REFUSED = (400, 422)
HTTP_MAX_TOKENS = 160  # a few more than N_PREDICT: a chat template's answer may open with a space

TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": _obj(
                {"city": _str(24), "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]
            ),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a time zone",
            "parameters": _obj({"timezone": _str(32)}, ["timezone"]),
        },
    },
)
TOOL_PROMPT = "What is the weather like in Paris today?"


def _post_chat(ctx: Context, out: Outcome, prompt: str, what: str, **extra: Any) -> Any:
    """POST a chat completion at temperature 0 with extra fields: the Reply when it is a 200, else
    None (a failure recorded). A refusal of the fields is not_supported."""
    body = {
        "model": model_id(ctx),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": HTTP_MAX_TOKENS,
        "temperature": 0,
        **extra,
    }
    r = request(ctx, "POST", "/v1/chat/completions", body)
    if r.status in REFUSED:
        raise NotSupported(f"the server refuses {what}: HTTP {r.status}: {r.body[:200]!r}")
    ok = r.status == 200
    return r if out.expect(ok, f"{what}: HTTP {r.status}" + ("" if ok else f": {r.body[:200]!r}")) else None


def _chat(ctx: Context, out: Outcome, prompt: str, what: str, **extra: Any) -> dict[str, Any] | None:
    """The first choice of a chat completion (_post_chat), or None."""
    r = _post_chat(ctx, out, prompt, what, **extra)
    if r is None:
        return None
    choice = (r.json().get("choices") or [{}])[0]
    return choice if isinstance(choice, dict) else {}


def _content(out: Outcome, choice: dict[str, Any], what: str) -> str | None:
    content = (choice.get("message") or {}).get("content")
    if not out.expect(isinstance(content, str), f"{what}: choices[0].message.content is a string"):
        return None
    out.expect(
        choice.get("finish_reason") == "stop",
        f"{what}: finish reason {choice.get('finish_reason')!r} (want 'stop': the answer ended by itself)",
    )
    return str(content)


def http_json_schema(case: SchemaCase) -> Callable[[Context, Outcome], None]:
    def check(ctx: Context, out: Outcome) -> None:
        what = f"response_format json_schema {case.name}"
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
        }
        choice = _chat(ctx, out, case.prompt.strip(), what, response_format=fmt)
        text = _content(out, choice, what) if choice is not None else None
        if text is not None:
            out.details["content"] = text
            judge_json(out, text, case.schema, what)

    return check


def http_json_object(ctx: Context, out: Outcome) -> None:
    what = "response_format json_object"
    choice = _chat(ctx, out, JSON_OBJECT_PROMPT.strip(), what, response_format={"type": "json_object"})
    text = _content(out, choice, what) if choice is not None else None
    if text is not None:
        out.details["content"] = text
        judge_json(out, text, None, what)


def _tool_choice(mode: str) -> Any:
    return "required" if mode == "required" else {"type": "function", "function": {"name": mode}}


def judge_tool_calls(out: Outcome, what: str, calls: Any, finish_reason: Any, mode: str) -> None:
    """OpenAI's tool_calls: each an id, type function, a declared function's name (the named one
    for a named tool_choice) and arguments that are a JSON string valid for its parameters."""
    names = [t["function"]["name"] for t in TOOLS]
    wanted = names if mode == "required" else [mode]
    out.details["tool_calls"] = calls
    if not isinstance(calls, list) or not calls:
        out.add("fail", f"NOT MET: {what}: tool_calls is a non-empty list: {calls!r}")
        return
    out.expect(finish_reason == "tool_calls", f"{what}: finish reason {finish_reason!r} (want 'tool_calls')")
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        out.expect(
            isinstance(call, dict) and call.get("type") == "function" and isinstance(call.get("id"), str),
            f"{what}: tool_calls[{i}] has an id and type 'function'",
        )
        name = fn.get("name")
        if not out.expect(name in wanted, f"{what}: tool_calls[{i}] names {name!r} (want one of {wanted})"):
            continue
        args = fn.get("arguments")
        if out.expect(isinstance(args, str), f"{what}: tool_calls[{i}].function.arguments is a JSON string"):
            params = TOOLS[names.index(str(name))]["function"]["parameters"]
            judge_json(out, str(args), params, f"{what}: the arguments of {name}")


def http_tool_call(mode: str) -> Callable[[Context, Outcome], None]:
    """tool_choice `required` (either declared function) or a named function (that one)."""

    def check(ctx: Context, out: Outcome) -> None:
        what = f"tools with tool_choice {mode}"
        choice = _chat(ctx, out, TOOL_PROMPT, what, tools=list(TOOLS), tool_choice=_tool_choice(mode))
        if choice is not None:
            calls = (choice.get("message") or {}).get("tool_calls")
            judge_tool_calls(out, what, calls, choice.get("finish_reason"), mode)

    return check


def http_tool_call_stream(ctx: Context, out: Outcome) -> None:
    """The same request streamed: the `delta.tool_calls` pieces, joined by their index (the id,
    type and name come once, the arguments in pieces), make a valid call; one finish reason."""
    what, mode = "streamed tools with tool_choice required", "required"
    r = _post_chat(
        ctx, out, TOOL_PROMPT, what, stream=True, tools=list(TOOLS), tool_choice=_tool_choice(mode)
    )
    if r is None:
        return
    calls: dict[int, dict[str, Any]] = {}
    finishes = []
    for data in r.sse():
        if data == DONE:
            continue
        for ch in parse_chunk(data).get("choices") or []:
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
            for piece in (ch.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(int(piece.get("index", 0)), {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    if piece.get(key) is not None:
                        call[key] = piece[key]
                fn = piece.get("function") or {}
                if fn.get("name") is not None:
                    call["function"]["name"] = fn["name"]
                call["function"]["arguments"] += fn.get("arguments") or ""
    out.expect(len(finishes) == 1, f"{what}: exactly one finish reason ({finishes})")
    judge_tool_calls(out, what, [calls[i] for i in sorted(calls)], finishes[-1] if finishes else None, mode)


def plan_http(ctx: Context) -> list[Check]:
    """Optional: a server declares nothing, and OpenAI-compatible servers differ in what they offer."""
    if not ctx.url:
        return []
    checks = [
        Check(
            f"http.structured.json_schema:schema={c.name}",
            "optional",
            http_json_schema(c),
            frozenset(),
            False,
            "response_format json_schema: the content parses and validates",
        )
        for c in SCHEMAS
    ]
    checks.append(
        Check(
            "http.structured.json_object",
            "optional",
            http_json_object,
            frozenset(),
            False,
            "response_format json_object: the content is a JSON object",
        )
    )
    for mode in ("required", "get_time"):
        checks.append(
            Check(
                f"http.structured.tool_call:tool_choice={mode}",
                "optional",
                http_tool_call(mode),
                frozenset(),
                False,
                "a tool call names a declared function with arguments valid for its parameters",
            )
        )
    checks.append(
        Check(
            "http.structured.tool_call.stream",
            "optional",
            http_tool_call_stream,
            frozenset(),
            False,
            "streamed delta.tool_calls join into a valid call",
        )
    )
    return checks
