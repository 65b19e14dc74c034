"""One emitter for every part: JSON Lines or a readable console view of the same events.

Events go to stderr (results go to stdout, so `infer ... | jq` works) and, with --log-file, to a
file as JSON Lines at every level. Each line is {ts, level, event, run_id, engine, model, ...fields};
spec/events.md lists the events and spec/schema/event.schema.json validates a line.
"""

from __future__ import annotations

import json
import sys
import uuid
from datetime import datetime, timezone
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict

Level = Literal["debug", "info", "warn", "error"]
LEVELS: dict[str, int] = {"debug": 10, "info": 20, "warn": 30, "error": 40}

# The events every engine run may emit, with what they mean (spec/events.md is made from this).
KNOWN_EVENTS: dict[str, str] = {
    "run.start": "a command started (command, argv)",
    "config.resolved": "the effective options and where each came from",
    "recipe.applied": "a recipe set options for this run (name, path, applied, overridden, ignored; "
    "level `warn` with `warnings` when it was made for another machine, engine or model)",
    "model.pull": "a catalogue model is being fetched (name, step, package, bytes; step `progress`: "
    "bytes of total downloaded, one per tenth of a wheel, at info level in the JSON log format)",
    "model.loaded": "a model is loaded (path, architecture, n_params, load_ms; the engine's build: "
    "the reference engine's `isa`, llama.cpp's `build`; `chat_template`: the template runs use, "
    "`model file`, `--chat-template`, `built-in 'NAME'`, or `none`; the reference engine's "
    "`tied_output`: true when the file has no output.weight and the token embedding is the output "
    "head, and its `device` (the OpenCL device with `-ngl`, else null) and `n_gpu_layers` (layers "
    "offloaded, the output head counting as one, as llama.cpp counts it)); level `warn` when the file has "
    "no template and a built-in one stands in (a base model may not follow it: `--raw`)",
    "prompt.evaluated": "a prompt was processed (prompt_n, prompt_ms, prompt_per_second)",
    "generation.done": "a generation ended (finish_reason, timings); after Ctrl-C in `infer run`, "
    "finish_reason `interrupted` and the timings of what was generated so far",
    "request.start": "the server accepted a request (method, route)",
    "request.done": "the server answered a request (status, tokens, ttft_ms, duration_ms)",
    "server.stop": "`infer serve` stopped listening and answered the requests in flight (url, signal)",
    "bench.result": "one benchmark test finished (a benchmark record)",
    "conformance.check": "one conformance check finished (id, level, status)",
    "error": "an error ended the command (code, message, hint)",
}


# The fields each event always carries, after the fixed ones (the event schema requires them).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "run.start": ("command",),
    "config.resolved": ("options", "sources"),
    "recipe.applied": ("name", "path", "applied"),
    "model.pull": ("name", "step"),
    "model.loaded": ("path",),
    "prompt.evaluated": ("prompt_n", "prompt_ms", "prompt_per_second"),
    "generation.done": ("finish_reason", "timings"),
    "request.start": ("method", "route"),
    "request.done": ("method", "route", "status", "duration_ms"),
    "server.stop": ("url", "signal"),
    "bench.result": ("model_type", "n_prompt", "n_gen", "avg_ts", "engine"),
    "conformance.check": ("id", "check_level", "status"),
    "error": ("code", "message"),
}


class LogEvent(BaseModel):
    """The shape of one JSON log line; event-specific fields follow the fixed ones."""

    model_config = ConfigDict(extra="allow")

    ts: str
    level: Level
    event: str
    run_id: str
    engine: str | None = None
    model: str | None = None


class Emitter:
    def __init__(
        self,
        *,
        log_format: Literal["text", "json"] = "text",
        verbosity: int = 0,
        log_file: str | None = None,
        stream: IO[str] | None = None,
        engine: str | None = None,
        model: str | None = None,
    ) -> None:
        self.log_format = log_format
        self.threshold = LEVELS["debug"] if verbosity > 0 else LEVELS["info"]
        self.stream = stream if stream is not None else sys.stderr
        self.file: IO[str] | None = open(log_file, "a", encoding="utf-8") if log_file else None  # noqa: SIM115
        self.log_file = log_file
        self.run_id = uuid.uuid4().hex[:12]
        self.engine = engine
        self.model = model
        global _last
        _last = self

    def emit(self, event: str, level: Level = "info", **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": level,
            "event": event,
            "run_id": self.run_id,
            "engine": self.engine,
            "model": self.model,
            **fields,
        }
        line = json.dumps(record, default=str, ensure_ascii=False)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()
        if LEVELS[level] >= self.threshold:
            self.stream.write((line if self.log_format == "json" else _text(record)) + "\n")
            self.stream.flush()
        return record

    def debug(self, event: str, **fields: Any) -> None:
        self.emit(event, "debug", **fields)

    def info(self, event: str, **fields: Any) -> None:
        self.emit(event, "info", **fields)

    def warn(self, event: str, **fields: Any) -> None:
        self.emit(event, "warn", **fields)

    def error(self, fields: dict[str, Any], *, console: bool) -> None:
        """The `error` event that ends a command (code, message, hint...): to the log file, and to
        the console when `console` (the CLI prints its own plain lines in the text format). Works
        after close(): a command's cleanup closes the log before its error reaches the CLI."""
        reopened = False
        if self.file is None and self.log_file is not None:
            self.file = open(self.log_file, "a", encoding="utf-8")  # noqa: SIM115
            reopened = True
        stream = self.stream
        if not console:
            import io

            self.stream = io.StringIO()
        try:
            self.emit("error", "error", **fields)
        finally:
            self.stream = stream
            if reopened:
                self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _text(record: dict[str, Any]) -> str:
    """The console view: `HH:MM:SS level event key=value ...`."""
    mark = {"debug": "D", "info": "I", "warn": "W", "error": "E"}[record["level"]]
    head = f"{record['ts'][11:19]} {mark} {record['event']:<18} "
    if "summary" in record:  # an event that carries its own one-line reading
        return head + str(record["summary"])
    skip = {"ts", "level", "event", "run_id", "engine", "model"}
    parts = [f"{k}={_short(v)}" for k, v in record.items() if k not in skip and v is not None]
    return head + " ".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, default=str, ensure_ascii=False)
        return text if len(text) <= 200 else text[:197] + "..."
    return str(value)


_last: Emitter | None = None


def last_emitter() -> Emitter | None:
    """The emitter made last in this process (the CLI reports a command's error through it)."""
    return _last


def forget_emitters() -> None:
    global _last
    _last = None


# A quiet emitter for library use where no CLI set one up.
def null_emitter() -> Emitter:
    import io

    return Emitter(stream=io.StringIO())
