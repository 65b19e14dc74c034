"""The error hierarchy: one stable code per kind, each with a CLI exit status and an HTTP status.

The table is the single source for spec/errors.md (generated) and for the server's OpenAI error
envelope. Raise the most specific class, with a message that says what was wrong and a hint that
says what to do.
"""

from __future__ import annotations

from typing import Any, ClassVar


class InferError(Exception):
    """Base of every error stdengine reports to a user."""

    code: ClassVar[str] = "internal_error"
    exit_status: ClassVar[int] = 1
    http_status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"
    summary: ClassVar[str] = "an unexpected failure inside stdengine or an engine"

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.hint:
            out["hint"] = self.hint
        out.update(self.details)
        return out

    def openai_envelope(self) -> dict[str, Any]:
        """The OpenAI error body: {"error": {"message", "type", "code", ...details}}."""
        body: dict[str, Any] = {"message": self.message, "type": self.openai_type, "code": self.http_status}
        body.update(self.details)
        return {"error": body}


class UsageError(InferError):
    code = "invalid_usage"
    exit_status = 2
    http_status = 400
    openai_type = "invalid_request_error"
    summary = "a flag or argument is missing, unknown or malformed"


class ConfigError(UsageError):
    code = "invalid_config"
    summary = "a config file or INFER_* variable has an unknown key or a value of the wrong type"


class UnsupportedOption(UsageError):
    code = "unsupported_option"
    summary = "the chosen engine cannot honour an option that was set"


class InvalidRequest(UsageError):
    code = "invalid_request"
    summary = "a request is malformed (empty prompt, bad JSON, out-of-range value)"


class RequestTooLarge(InvalidRequest):
    code = "request_too_large"
    http_status = 413
    summary = "a request body is larger than the server accepts (`infer serve --max-body`)"


class Unauthorized(UsageError):
    code = "unauthorized"
    http_status = 401
    openai_type = "authentication_error"
    summary = "a request to a server started with --api-key lacks that key"


class NotSupported(UsageError):
    code = "not_supported"
    http_status = 501
    openai_type = "not_supported_error"
    summary = "a server route needs a capability the loaded engine does not have (tokenize, embeddings)"


class ModelNotFound(InferError):
    code = "model_not_found"
    exit_status = 3
    http_status = 404
    openai_type = "not_found_error"
    summary = "no model file, catalogue alias or served model has that name"


class BadModelFile(InferError):
    code = "bad_model_file"
    exit_status = 4
    http_status = 400
    openai_type = "invalid_request_error"
    summary = "the model file is not GGUF, is truncated, or is inconsistent"


class UnsupportedArchitecture(BadModelFile):
    code = "unsupported_architecture"
    summary = "the engine does not implement the model's architecture or a tensor type it uses"


class ContextOverflow(InferError):
    code = "context_overflow"
    exit_status = 5
    http_status = 400
    openai_type = "exceed_context_size_error"
    summary = "the prompt (plus what must be generated) does not fit the context size"


class EngineUnavailable(InferError):
    code = "engine_unavailable"
    exit_status = 6
    http_status = 503
    openai_type = "unavailable_error"
    summary = "the engine is not installed, cannot load here, or its server cannot be reached"


class ServerBusy(EngineUnavailable):
    code = "server_busy"
    summary = "every slot of the server is busy and its queue is full; retry later"


class EngineFailure(InferError):
    code = "engine_failure"
    exit_status = 7
    http_status = 500
    openai_type = "server_error"
    summary = "the engine failed while running (a crash, a malformed reply from a server)"


class FetchError(InferError):
    code = "fetch_failed"
    exit_status = 8
    http_status = 502
    openai_type = "server_error"
    summary = "a model could not be downloaded or failed verification"


class NotImplementedYet(InferError):
    code = "not_implemented"
    exit_status = 9
    http_status = 501
    openai_type = "not_supported_error"
    summary = "the feature is specified but not built yet in this version"


class Interrupted(InferError):
    code = "interrupted"
    exit_status = 130
    http_status = 499
    openai_type = "server_error"
    summary = "the user interrupted the run (Ctrl-C)"


def all_error_classes() -> list[type[InferError]]:
    """Every error class, base first, in declaration order (for spec/errors.md)."""
    seen: list[type[InferError]] = []

    def walk(cls: type[InferError]) -> None:
        seen.append(cls)
        for sub in cls.__subclasses__():
            walk(sub)

    walk(InferError)
    return seen


def decode_utf8(raw: bytes, what: str, error: type[InferError]) -> str:
    """raw as UTF-8, or `error` naming `what` and the first byte that is not (text is refused,
    never guessed at or replaced)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{what} is not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r})",
            hint="convert it to UTF-8 first, e.g. iconv -f LATIN1 -t UTF-8",
        ) from None


def read_text_file(path: Any, what: str, error: type[InferError]) -> str:
    """A user's text file (a schema, a grammar, a config, a recipe) as UTF-8, or `error` saying
    what it is and why it cannot be read: missing, a directory, unreadable, or not UTF-8."""
    from pathlib import Path

    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        why = "it is a directory" if p.is_dir() else (e.strerror or str(e)).lower()
        raise error(f"cannot read {what} {path}: {why}", hint="give the path of a text file") from None
    return decode_utf8(raw, f"{what} {path}", error)
