"""Structured output: constraints that restrict what a generation may produce (a JSON Schema, any
JSON object, a regular expression, a GBNF or Lark grammar), applied as a token mask at each step.

The constraint languages and the per-step mask come from llguidance (a Rust core with Python
bindings, tokenizer-agnostic): a Constraint is compiled to its grammar when it is built (so a bad
schema is refused before any model is involved), and against an engine's vocabulary when a
generation starts. LocalEngine's loop asks a Matcher to mask the logits before each sample and
feeds it the sampled token; spec/structured.md is the prose.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stdengine.errors import EngineFailure, InvalidRequest, UnsupportedOption, read_text_file

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from stdengine.adapter import Engine, GenerateRequest

Kind = Literal["json_schema", "json_object", "regex", "grammar"]
Syntax = Literal["gbnf", "lark"]

# JSON's whitespace between tokens, bounded: with the library's default (any amount) a small
# model can pad an object with newlines until n_predict runs out.
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


@dataclass(frozen=True)
class Constraint:
    """What a generation must produce. Build it with one of the constructors, which check it:
    a bad schema, regex or grammar raises InvalidRequest."""

    kind: Kind
    schema: dict[str, Any] | None = None  # json_schema
    pattern: str | None = None  # regex
    text: str | None = None  # grammar: its source text
    syntax: Syntax | None = None  # grammar: "gbnf" (llama.cpp's) or "lark"
    compiled: str = field(default="", repr=False, compare=False)  # llguidance's grammar text

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        if not isinstance(schema, dict):
            raise InvalidRequest(f"a JSON schema must be a JSON object, not {type(schema).__name__}")
        return cls("json_schema", schema=schema, compiled=_compile("json_schema", schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", compiled=_compile("json_schema", {"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        if not isinstance(pattern, str):
            raise InvalidRequest(f"a regular expression must be a string, not {type(pattern).__name__}")
        return cls("regex", pattern=pattern, compiled=_compile("regex", pattern))

    @classmethod
    def grammar(cls, text: str, syntax: Syntax = "gbnf") -> Constraint:
        if not isinstance(text, str):
            raise InvalidRequest(f"a grammar must be a string, not {type(text).__name__}")
        if syntax not in ("gbnf", "lark"):
            raise InvalidRequest(f"unknown grammar syntax {syntax!r}", hint="use 'gbnf' or 'lark'")
        return cls("grammar", text=text, syntax=syntax, compiled=_compile(syntax, text))

    def describe(self) -> str:
        if self.kind == "json_schema":
            return "a JSON schema"
        if self.kind == "json_object":
            return "any JSON object"
        if self.kind == "regex":
            return f"the regular expression {self.pattern!r}"
        return f"a {self.syntax} grammar"


def _compile(fmt: str, source: Any) -> str:
    """llguidance's grammar for a constraint, checked (InvalidRequest with its message)."""
    import llguidance

    try:
        if fmt == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        else:
            grammar = llguidance.grammar_from(fmt, source)  # type: ignore[arg-type]
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"bad {_NAMES[fmt]}: {e}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise InvalidRequest(f"bad {_NAMES[fmt]}: {messages[0].strip()}")
    return grammar


_NAMES = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "gbnf": "GBNF grammar",
    "lark": "Lark grammar",
}


def check_constraint(engine: Engine, request: GenerateRequest) -> None:
    """UnsupportedOption when the request has a constraint the engine cannot honour."""
    if request.constraint is not None:
        require_structured("a structured-output constraint", engine.name, engine.capabilities)


def require_structured(what: str, engine_name: str, capabilities: frozenset[str]) -> None:
    """UnsupportedOption naming `what` (a constraint, a request field) when the engine's loaded
    instance does not declare the 'structured' capability."""
    if "structured" not in capabilities:
        raise UnsupportedOption(
            f"engine '{engine_name}' cannot honour {what} (needs the 'structured' capability)",
            hint="use an engine that declares it (reference, llamacpp), or remove it",
        )


@dataclass
class Vocabulary:
    """What the mask needs of a model's vocabulary: each token's bytes (special tokens rendered),
    which ids are special (control tokens, never produced by the grammar's text), the ids that end
    a generation, and the model's tokenizer (bytes -> ids, no special tokens added or parsed)."""

    pieces: list[bytes]
    special: list[int]
    eog: list[int]
    encode: Callable[[bytes], list[int]]


class _Wrapped:
    """The tokenizer object llguidance.TokenizerWrapper reads (attributes and a call)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.eos_token_id = vocab.eog[0] if vocab.eog else None
        self.bos_token_id = None
        self.tokens = vocab.pieces
        self.special_token_ids = vocab.special
        self._encode = vocab.encode

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text)


# The compiled tokenizer of each vocabulary (building one takes up to ~2 s for a 262k-token
# vocabulary), kept as long as the object that owns the vocabulary lives.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def tokenizer_for(owner: Any, vocabulary: Callable[[], Vocabulary]) -> Any:
    """The llguidance tokenizer of a vocabulary, built once per owner (an engine's tokenizer)."""
    tok = _TOKENIZERS.get(owner)
    if tok is None:
        import llguidance

        vocab = vocabulary()
        if not vocab.eog:
            raise EngineFailure("the model has no end-of-generation token: a constraint cannot end")
        wrapper = llguidance.TokenizerWrapper(_Wrapped(vocab))
        tok = llguidance.LLTokenizer(wrapper, n_vocab=len(vocab.pieces), eos_token=vocab.eog)
        _TOKENIZERS[owner] = tok
    return tok


class Matcher:
    """One generation's state under a constraint: the allowed-token mask at each step.

    A constraint that the matcher cannot follow (a schema that refers only to itself, a pattern
    past llguidance's lexer limits) shows as the matcher's error, at the first mask or later: the
    request's fault, so InvalidRequest. The first mask is computed here, before any token, so that
    most such constraints are refused before the generation's first event (an HTTP 400)."""

    def __init__(self, tokenizer: Any, constraint: Constraint, n_vocab: int) -> None:
        import llguidance
        import numpy as np

        self.constraint = constraint
        # verbose_errors=False: the error is one line, not a dump of the parser's state
        limits = llguidance.LLParserLimits(verbose_errors=False)
        self._m = llguidance.LLMatcher(tokenizer, constraint.compiled, log_level=0, limits=limits)
        self._fail_if_error()
        self.n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # llguidance's: 1 = allowed
        self._forbidden = np.empty_like(self._bits)  # its complement, reused
        self._compute_mask()
        self._fresh = True  # _bits is the mask for the next token

    def _compute_mask(self) -> None:
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._fail_if_error()

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of the tokens the constraint forbids now to -inf, in place."""
        import numpy as np

        if not self._fresh:
            self._compute_mask()
        self._fresh = False
        # Whole-array passes, no index arrays: the complemented bits unpacked to a byte a token
        # and read as the boolean `where` of one copyto (~40 us on a 262k vocabulary; the index
        # arrays of np.flatnonzero cost ~20x that). spec/structured.md, "Cost".
        np.invert(self._bits, out=self._forbidden)
        forbidden = np.unpackbits(self._forbidden.view(np.uint8), count=self.n_vocab, bitorder="little")
        np.copyto(logits[: self.n_vocab], -np.inf, where=forbidden.view(np.bool_))
        logits[self.n_vocab :] = -np.inf

    def consume(self, token: int) -> None:
        """The sampled token (never an end-of-generation one: those end the loop), which the last
        mask allowed: a token it forbade is the engine's fault."""
        if not (0 <= token < self.n_vocab and (int(self._bits[token >> 5]) >> (token & 31)) & 1):
            raise EngineFailure(f"the engine sampled token {token}, which the constraint's mask forbade")
        self._m.consume_token(token)
        self._fail_if_error()

    @property
    def done(self) -> bool:
        """Nothing more can follow: the output is complete."""
        return bool(self._m.is_stopped())

    def _fail_if_error(self) -> None:
        if self._m.is_error():
            error = self._m.get_error().replace("<non-verbose/>", "").strip()
            raise InvalidRequest(
                f"the constraint ({self.constraint.describe()}) cannot be followed: {error}",
                hint="simplify the constraint (a schema that refers only to itself, or a pattern "
                "with large repetition counts, goes past the matcher's limits)",
            )


def load_json_schema(value: str) -> dict[str, Any]:
    """A --json-schema argument: a file's path or the JSON text itself (InvalidRequest if it is
    neither an existing file nor JSON, or not an object)."""
    text = value
    if value.lstrip()[:1] not in ("{", "["):  # else JSON text, an object or not
        if not Path(value).exists():
            raise InvalidRequest(f"--json-schema: no such file, and not JSON: {value}")
        text = read_text_file(value, "the --json-schema file", InvalidRequest)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"--json-schema: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InvalidRequest("--json-schema: a schema must be a JSON object")
    return schema


def load_grammar(path: str) -> Constraint:
    """A --grammar FILE: GBNF for .gbnf, Lark for .lark."""
    p = Path(path)
    syntax: Syntax
    if p.suffix == ".gbnf":
        syntax = "gbnf"
    elif p.suffix == ".lark":
        syntax = "lark"
    else:
        raise InvalidRequest(f"--grammar: {path}: the file name must end in .gbnf or .lark")
    if not p.exists():
        raise InvalidRequest(f"--grammar: no such file: {path}")
    return Constraint.grammar(read_text_file(p, "the --grammar file", InvalidRequest), syntax)
