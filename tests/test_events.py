"""The emitter: JSON Lines that validate against the published schema, the text view, the log file."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from stdengine.events import Emitter

SCHEMA = json.loads((Path(__file__).parent.parent / "spec" / "schema" / "event.schema.json").read_text())


def test_json_lines_validate_against_the_schema():
    out = io.StringIO()
    em = Emitter(log_format="json", stream=out, engine="reference", model="m.gguf")
    em.info("model.loaded", path="m.gguf", n_params=134515008, load_ms=12.5)
    em.emit("error", "error", code="bad_model_file", message="x")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    for line in lines:
        record = json.loads(line)
        jsonschema.validate(record, SCHEMA)
        assert record["run_id"] == em.run_id and record["engine"] == "reference"
    assert json.loads(lines[0])["n_params"] == 134515008


def test_levels_and_verbosity():
    out = io.StringIO()
    Emitter(log_format="json", stream=out).debug("config.resolved", x=1)
    assert out.getvalue() == ""
    Emitter(log_format="json", stream=out, verbosity=1).debug("config.resolved", x=1)
    assert json.loads(out.getvalue())["level"] == "debug"


def test_text_view_is_readable():
    out = io.StringIO()
    Emitter(stream=out).info("generation.done", summary="prompt: 3 tokens")
    line = out.getvalue()
    assert " I generation.done" in line and line.rstrip().endswith("prompt: 3 tokens")
    assert not line.startswith("{")


def test_log_file_gets_every_level_as_json(tmp_path):
    path = tmp_path / "log.jsonl"
    em = Emitter(stream=io.StringIO(), log_file=str(path))
    em.debug("config.resolved", options={"threads": 2}, sources={"threads": "flag"})
    em.info("run.start", command="run")
    em.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["config.resolved", "run.start"]
    for r in records:
        jsonschema.validate(r, SCHEMA)


# --- every event of the spec, emitted by a real command -------------------------------------------

ROOT = Path(__file__).parent.parent


def spec_events() -> list[str]:
    """The event names of spec/events.md's table (what the standard promises)."""
    text = (ROOT / "spec" / "events.md").read_text(encoding="utf-8")
    table = text.split("<!-- BEGIN GENERATED: events-table -->")[1].split("<!-- END GENERATED")[0]
    return [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]


def read_log(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []
    )


def infer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.models
def test_every_event_in_the_spec_is_emitted_and_validates(tmp_path, smollm2_path):
    """run, a failing run, models pull, conformance, serve (with a request and a shutdown) and
    infer-bench, each with --log-file: together they emit every event spec/events.md lists, and
    every line validates against spec/schema/event.schema.json (with each event's fields)."""
    from test_server_toy import toy_server

    logs: dict[str, list[dict]] = {}
    model = str(smollm2_path)

    # with a recipe (named, so it applies on any machine): recipe.applied
    from stdengine import recipes

    recipe = recipes.Recipe.model_validate(
        {
            "name": "events",
            "date": "2026-11-30T12:00:00Z",
            "applies_to": {"engine": "reference"},
            "options": {"threads": 1},
        }
    )
    recipe_path = recipes.save(recipe, tmp_path / "events.toml")
    log = tmp_path / "run.jsonl"
    r = infer(
        "run", "-m", model, "-n", "2", "--temp", "0", "-p", "hi", "--log-file", str(log),
        env={"INFER_RECIPE": str(recipe_path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    logs["run"] = read_log(log)

    # an error: on stderr as a JSON line with --log-format json, and in the log file
    log = tmp_path / "error.jsonl"
    missing = str(tmp_path / "missing.gguf")
    r = infer("run", "-m", missing, "-p", "hi", "--log-format", "json", "--log-file", str(log))
    assert r.returncode == 3
    stderr_events = [json.loads(line) for line in r.stderr.splitlines()]
    assert [e["event"] for e in stderr_events] == ["error"]  # JSON Lines only, no plain "error:" line
    assert stderr_events[0]["code"] == "model_not_found" and missing in stderr_events[0]["message"]
    logs["error"] = read_log(log)
    assert [e for e in logs["error"] if e["event"] == "error"] == stderr_events

    log = tmp_path / "pull.jsonl"
    r = infer("models", "pull", "smollm2-135m-instruct", "--log-file", str(log))
    assert r.returncode == 0, r.stderr
    logs["pull"] = read_log(log)

    log = tmp_path / "conformance.jsonl"
    only = "tokenizer.roundtrip:case=plain"
    r = infer("conformance", "-e", "reference", "-m", model, "--only", only, "--log-file", str(log))
    assert r.returncode == 0, r.stderr
    logs["conformance"] = read_log(log)

    log = tmp_path / "serve.jsonl"
    server = toy_server(tmp_path, "--log-file", str(log))
    try:
        import httpx

        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        assert server.stop() == 0
    logs["serve"] = read_log(log)

    # infer-bench logs to stderr in the text view only (-v); its emitter is pointed at a log file
    log = tmp_path / "bench.jsonl"
    code = (
        "import io, sys\nfrom stdengine.bench import runner\nfrom stdengine.cli import bench\nfrom stdengine.events import Emitter\n"
        "runner.bench_emitter = lambda params: Emitter(log_file=sys.argv[1], stream=io.StringIO())\n"
        "bench.main(sys.argv[2:])\n"
    )
    argv = [str(log), "-m", model, "-p", "8", "-n", "0", "-r", "1", "-o", "jsonl"]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    logs["bench"] = read_log(log)

    seen: dict[str, str] = {}
    for command, records in logs.items():
        for record in records:
            jsonschema.validate(record, SCHEMA)
            seen.setdefault(record["event"], command)
    missing_events = [name for name in spec_events() if name not in seen]
    assert not missing_events, f"never emitted: {missing_events} (seen: {seen})"
    (evaluated,) = [e for e in logs["run"] if e["event"] == "prompt.evaluated"]
    (done,) = [e for e in logs["run"] if e["event"] == "generation.done"]
    assert evaluated["prompt_n"] == done["timings"]["prompt_n"] > 0
