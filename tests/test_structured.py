"""Constrained decoding (stdengine.structured, LocalEngine's mask): outputs are checked by
independent means (the jsonschema package, Python's re, json), never by the code under test."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import pytest

from stdengine.adapter import DoneEvent, GenerateRequest, SamplingParams, TokenEvent
from stdengine.errors import InvalidRequest, UnsupportedOption
from stdengine.events import Emitter
from stdengine.options import Options
from stdengine.structured import Constraint, check_constraint, load_grammar, load_json_schema

jsonschema = pytest.importorskip("jsonschema")

# A set of schemas: nested objects, arrays, enums, bounded numbers, required fields, string
# patterns. Bounded lengths keep every output short enough to finish within n_predict.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "country": {"type": "string", "enum": ["FR", "DE", "JP"]},
                },
                "required": ["name", "country"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["city", "ok"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -10, "maximum": 40},
            "level": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["temperature", "level"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}
PROMPT = "Answer in JSON: describe a city, a person, colors, the weather or a product code."

COMBOS = [("reference", "smollm2"), ("reference", "gemma3"), ("llamacpp", "smollm2"), ("llamacpp", "gemma3")]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{e}-{m}" for e, m in COMBOS])
def engine(request: pytest.FixtureRequest, smollm2_path: Any, gemma3_path: Any) -> Any:
    from stdengine import registry

    name, model = request.param
    cls = registry.engine_class(name)
    ok, why = cls.availability()
    if not ok:
        pytest.skip(why or "")
    path = smollm2_path if model == "smollm2" else gemma3_path
    e = cls.load(
        Options(model=str(path), ctx_size=256, threads=2), Emitter(log_format="json", stream=io.StringIO())
    )
    yield e
    e.close()


def generate(
    engine: Any, prompt: str, constraint: Constraint | None, **sampling: Any
) -> tuple[str, DoneEvent]:
    sampling.setdefault("temp", 0)
    sampling.setdefault("n_predict", 96)
    request = GenerateRequest(
        messages=[{"role": "user", "content": prompt}],
        sampling=SamplingParams(**sampling),
        constraint=constraint,
    )
    events = list(engine.generate(request))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return "".join(e.text for e in events if isinstance(e, TokenEvent)), done


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_outputs_validate(engine: Any, name: str) -> None:
    schema = SCHEMAS[name]
    runs = [{"temp": 0}, {"temp": 0.9, "seed": 1}, {"temp": 0.9, "seed": 2}]
    for sampling in runs:
        text, done = generate(engine, PROMPT, Constraint.json_schema(schema), **sampling)
        assert done.finish_reason == "stop", (sampling, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_gives_an_object(engine: Any) -> None:
    text, done = generate(
        engine, 'Reply with the JSON object {"ok": true} and nothing else.', Constraint.json_object()
    )
    # an object from the first token; a small model may not close it within n_predict
    assert text.startswith("{"), text
    if done.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_and_gbnf_grammar(engine: Any) -> None:
    text, done = generate(engine, "Is the sky blue? Answer yes or no.", Constraint.regex(r"(yes|no)"))
    assert text in ("yes", "no") and done.finish_reason == "stop"
    grammar = 'root ::= "The answer is " [0-9]{1,3} "."'
    text, done = generate(engine, "What is 6 times 7?", Constraint.grammar(grammar, "gbnf"))
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text) and done.finish_reason == "stop"
    lark = 'start: ("red" | "green") " " NUM\nNUM: /[0-9]+/'
    text, _ = generate(engine, "Name a color and a number.", Constraint.grammar(lark, "lark"), n_predict=12)
    assert re.fullmatch(r"(red|green) [0-9]+", text)


def test_a_constraint_the_greedy_text_satisfies_leaves_it_unchanged(engine: Any) -> None:
    prompt = "Write one sentence about the sea."
    free, _ = generate(engine, prompt, None, n_predict=16)
    # a Lark grammar: the free text as a literal (JSON string escapes), then anything
    lark = f"start: {json.dumps(free)} REST\nREST: /(.|\\n)*/"
    constrained, _ = generate(engine, prompt, Constraint.grammar(lark, "lark"), n_predict=16)
    assert constrained == free


def test_bad_constraints_are_refused() -> None:
    for make in (
        lambda: Constraint.json_schema({"type": "nonsense"}),
        lambda: Constraint.json_schema([1, 2]),  # type: ignore[arg-type]
        lambda: Constraint.regex("[a-"),
        lambda: Constraint.grammar("root ::= undefined-rule", "gbnf"),
        lambda: Constraint.grammar("start: (", "lark"),
        lambda: Constraint.grammar('root ::= "a"', "ebnf"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidRequest):
            make()


def test_cli_arguments(tmp_path: Any) -> None:
    assert load_json_schema('{"type": "object"}') == {"type": "object"}
    f = tmp_path / "s.json"
    f.write_text('{"type": "integer"}')
    assert load_json_schema(str(f)) == {"type": "integer"}
    for bad, why in (
        ("{not json", "not valid JSON"),
        (str(tmp_path / "missing.json"), "no such file"),
        ("[1]", "must be a JSON object"),
        (str(tmp_path), "it is a directory"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            load_json_schema(bad)
    f.write_bytes(b'{"type": "\xff"}')
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        load_json_schema(str(f))
    g = tmp_path / "g.gbnf"
    g.write_text('root ::= "x"')
    assert load_grammar(str(g)).syntax == "gbnf"
    with pytest.raises(InvalidRequest):
        load_grammar(str(tmp_path / "g.txt"))
    with pytest.raises(InvalidRequest):
        load_grammar(str(tmp_path / "missing.lark"))
    g.write_bytes(b'root ::= "\xe9"')
    with pytest.raises(InvalidRequest, match="not valid UTF-8"):
        load_grammar(str(g))


def test_an_engine_without_the_capability_refuses() -> None:
    class NoStructured:
        name = "plain"
        capabilities = frozenset({"stream"})

    request = GenerateRequest(prompt="x", constraint=Constraint.json_object())
    with pytest.raises(UnsupportedOption, match="structured"):
        check_constraint(NoStructured(), request)  # type: ignore[arg-type]
    check_constraint(NoStructured(), GenerateRequest(prompt="x"))  # type: ignore[arg-type]


class _Owner:  # what the byte vocabulary's compiled tokenizer is cached on
    pass


_BYTES = _Owner()


def test_the_mask_sets_exactly_the_forbidden_logits_to_minus_infinity() -> None:
    """On a byte vocabulary (token i = byte i, 256 = end of generation) the allowed tokens of
    each step of the regex '[ab]c' are known by hand: the mask leaves their logits as they were
    and every other one -inf, past the vocabulary too (a longer buffer), at every step."""
    import numpy as np

    from stdengine.structured import Matcher, Vocabulary, tokenizer_for

    vocab = Vocabulary([bytes([i]) for i in range(256)] + [b"<eos>"], [256], [256], list)
    n = len(vocab.pieces)
    matcher = Matcher(tokenizer_for(_BYTES, lambda: vocab), Constraint.regex("[ab]c"), n)
    raw = np.arange(n + 3, dtype=np.float32) - 100.0  # distinct values, a few negative
    for token, allowed in ((ord("b"), {ord("a"), ord("b")}), (ord("c"), {ord("c")}), (None, {256})):
        logits = raw.copy()
        matcher.apply(logits)
        want = np.full_like(raw, -np.inf)
        want[sorted(allowed)] = raw[sorted(allowed)]
        np.testing.assert_array_equal(logits, want)
        if token is not None:
            matcher.consume(token)
    assert matcher.done


def test_a_constraint_the_matcher_cannot_follow_is_the_requests_fault() -> None:
    """A schema that only refers to itself fails at the first mask, a pattern past the lexer's
    limits after its first token: both are InvalidRequest (HTTP 400), the first raised as the
    matcher starts, before any token. A token the mask forbade is the engine's fault."""
    import numpy as np

    from stdengine.errors import EngineFailure
    from stdengine.structured import Matcher, Vocabulary, tokenizer_for

    vocab = Vocabulary([bytes([i]) for i in range(256)] + [b"<eos>"], [256], [256], list)
    tok = tokenizer_for(_BYTES, lambda: vocab)
    with pytest.raises(InvalidRequest, match="cannot be followed"):
        Matcher(tok, Constraint.json_schema({"$ref": "#"}), len(vocab.pieces))

    huge = Matcher(tok, Constraint.json_schema({"type": "string", "pattern": "^(a{1000}){1000}$"}), 257)
    huge.apply(np.zeros(257, dtype=np.float32))
    with pytest.raises(InvalidRequest, match="too many expressions"):
        huge.consume(ord('"'))

    digits = Matcher(tok, Constraint.regex("[0-9]"), 257)
    digits.apply(np.zeros(257, dtype=np.float32))
    with pytest.raises(EngineFailure, match="forbade"):
        digits.consume(ord("x"))
