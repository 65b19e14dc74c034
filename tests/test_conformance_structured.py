"""The structured-output checks (conformance/structured.py): they pass for the engines that do
constrained decoding (reference and llamacpp, both catalogue models), are core for an engine that
declares `structured` and not_supported for one that does not, and fail the broken engines of
tests/broken_engines.py that name them. The answers are judged by `jsonschema` and Python's `re`,
never by the constraint library the engines use.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from broken_engines import STRUCTURED_FAULTS, Faulty, IgnoresConstraint
from stdengine.conformance import structured
from stdengine.conformance.runner import find_golden, plan, run_suite
from stdengine.conformance.suite import Context, Outcome, exit_status
from stdengine.reference.adapter import ReferenceEngine

from stdengine.events import null_emitter
from stdengine.options import Options

ONLY = "structured.*"
# a check per schema, json_object, a check per regex and per grammar syntax, a check per golden
# case of the unchanged check
N_CHECKS = (
    len(structured.SCHEMAS)
    + 1
    + len(structured.REGEXES)
    + len(structured.GRAMMARS)
    + len(structured.UNCHANGED_CASES)
)


def run(cls: type, path: Path, alias: str, threads: int = 2) -> dict[str, Any]:
    engine = cls.load(Options(model=str(path), ctx_size=2048, threads=threads), null_emitter())
    try:
        golden, note = find_golden(alias, path)
        ctx = Context(engine=engine, golden=golden, golden_note=note, model=alias, model_path=path)
        results = run_suite(ctx, level="core", only=ONLY)
    finally:
        engine.close()
    return {r.id: r for r in results}


def llamacpp_cls() -> type:
    pytest.importorskip("llama_cpp")
    from stdengine.engines.llamacpp import LlamaCppEngine

    return LlamaCppEngine


# --- the schema set and the judging, without a model -------------------------------------------
def test_every_schema_is_a_valid_json_schema_with_bounded_answers() -> None:
    for case in structured.SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(case.schema)
    for tool in structured.TOOLS:
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])


def test_judge_json() -> None:
    schema = next(c.schema for c in structured.SCHEMAS if c.name == "numbers")
    cases = [
        ('{"age": 30, "weight": 70.5, "temperature": 20}', "pass"),
        ('{"age": 3, "weight": 70.5, "temperature": 20}', "fail"),  # below the minimum
        ('{"age": 30, "weight": 70.5}', "fail"),  # a required field missing
        ('{"age": 30, "weight": 70.5, "temperature": 20', "fail"),  # cut off
        ('{"age": 30, "weight": 70.5, "temperature": 60}', "fail"),  # the exclusive maximum
    ]
    for text, want in cases:
        out = Outcome()
        structured.judge_json(out, text, schema, "t")
        assert out.status == want, (text, out.items)
    for text, want in [("{}", "pass"), ("[1]", "fail"), ("Paris", "fail")]:
        out = Outcome()
        structured.judge_json(out, text, None, "t")
        assert out.status == want, (text, out.items)


def test_shape_regex_admits_its_text_and_other_texts() -> None:
    for text in [" 13, 14, 15,", " (東京), 🌧️ rain in Paris,\n\tand [x] {y} $z^ a.b|c?", ""]:
        pattern = structured.shape_regex(text)
        assert re.fullmatch(pattern, text), (pattern, text)
    assert re.fullmatch(structured.shape_regex(" 13, 14,"), " 7, 99999,")
    assert not re.fullmatch(structured.shape_regex(" 13, 14,"), " 13 14,")


def test_structured_checks_are_core_only_for_an_engine_that_declares_the_capability() -> None:
    class Plain:
        capabilities = frozenset({"stream"})

    class Structured:
        capabilities = frozenset({"stream", "structured"})

    for engine, level in ((Plain(), "optional"), (Structured(), "core")):
        checks = [c for c in plan(Context(engine=engine)) if c.group == "structured"]
        assert len(checks) == N_CHECKS
        assert {c.level for c in checks} == {level}
        assert all(c.needs == {"structured"} for c in checks)


# --- real engines -------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["reference", "llamacpp"])
@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_the_checks_pass_for_the_engines_that_constrain(
    engine: str, alias: str, smollm2_path: Path, gemma3_path: Path
) -> None:
    cls = ReferenceEngine if engine == "reference" else llamacpp_cls()
    path = smollm2_path if alias.startswith("smollm2") else gemma3_path
    # one llama.cpp thread: no spin-waiting pool fighting other processes for the machine's cores
    results = run(cls, path, alias, threads=2 if engine == "reference" else 1)
    assert len(results) == N_CHECKS
    assert all(r.level == "core" for r in results.values())
    bad = {i: (r.status, r.message, r.details) for i, r in results.items() if r.status != "pass"}
    assert not bad, bad
    # the validator's verdict, checked once more here on the answers themselves
    for case in structured.SCHEMAS:
        text = results[f"structured.json_schema:schema={case.name}"].details["text"]
        jsonschema.validate(json.loads(text), case.schema)


def test_an_engine_without_the_capability_is_not_supported(smollm2_path: Path) -> None:
    class Unconstrained(ReferenceEngine):
        capabilities = ReferenceEngine.capabilities - {"structured"}

    engine = Unconstrained.load(Options(model=str(smollm2_path), ctx_size=2048, threads=2), null_emitter())
    try:
        ctx = Context(engine=engine, model="smollm2-135m-instruct")
        assert run_suite(ctx, level="core", only=ONLY) == []  # optional for it: not in a core run
        results = run_suite(ctx, level="optional", only=ONLY)
    finally:
        engine.close()
    assert results and {r.status for r in results} == {"not_supported"}
    assert exit_status(results) == 0


@pytest.mark.parametrize("fault", STRUCTURED_FAULTS, ids=lambda c: c.__name__)
def test_the_checks_fail_each_broken_engine(fault: type[Faulty], smollm2_path: Path) -> None:
    results = run(fault, smollm2_path, "smollm2-135m-instruct")
    failed = {i for i, r in results.items() if r.status == "fail"}
    for glob in fault.fails:
        ids = [i for i in results if fnmatch.fnmatchcase(i, glob)]
        assert ids, f"no check matches {glob}"
        assert set(ids) & failed, {i: (results[i].status, results[i].message) for i in ids}
    assert exit_status(list(results.values())) == 1


# --- over HTTP: infer serve's response_format and tools -----------------------------------------
def run_served(engine: str | type, path: Path) -> dict[str, Any]:
    from served import KEY, InProcessServer

    server = InProcessServer(engine, path)
    try:
        ctx = Context(url=server.url, api_key=KEY, model="smollm2-135m-instruct")
        results = run_suite(ctx, level="optional", only="http.structured.*")
    finally:
        server.stop()
    return {r.id: r for r in results}


def test_the_http_checks_pass_against_infer_serve(smollm2_path: Path) -> None:
    results = run_served("reference", smollm2_path)
    assert len(results) == len(structured.SCHEMAS) + 1 + 3
    assert all(r.level == "optional" for r in results.values())
    bad = {i: (r.status, r.message) for i, r in results.items() if r.status != "pass"}
    assert not bad, bad


def test_the_http_checks_fail_an_engine_that_ignores_the_constraint(smollm2_path: Path) -> None:
    results = run_served(IgnoresConstraint, smollm2_path)
    failed = {i for i, r in results.items() if r.status == "fail"}
    for glob in IgnoresConstraint.fails_served:
        ids = [i for i in results if fnmatch.fnmatchcase(i, glob)]
        assert ids and set(ids) & failed, {i: (results[i].status, results[i].message) for i in ids}
