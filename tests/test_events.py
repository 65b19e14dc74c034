"""The emitter: JSON Lines that validate against the published schema, the text view, the log file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jsonschema

from stdengine.events import Emitter

SCHEMA = json.loads((Path(__file__).parent.parent / "spec" / "schema" / "event.schema.json").read_text())


def test_json_lines_validate_against_the_schema():
    out = io.StringIO()
    em = Emitter(log_format="json", stream=out, engine="reference", model="m.gguf")
    em.info("model.loaded", n_params=134515008, load_ms=12.5)
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
    em.debug("config.resolved", a=1)
    em.info("run.start", command="run")
    em.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["config.resolved", "run.start"]
    for r in records:
        jsonschema.validate(r, SCHEMA)
