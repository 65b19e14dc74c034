"""The adapter interface: what an engine implements to get the CLI, server, benchmarker and
conformance suite for free.

An engine is a subclass of `Engine` registered under the entry-point group `stdengine.engines`.
It declares what it can do (`capabilities`) and which canonical options it honours
(`honoured_options`, with `option_map` saying what each becomes in the engine); the core refuses
an option the engine does not honour before the engine sees it. spec/adapter.md is the prose.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from stdengine.options import SAMPLING

if TYPE_CHECKING:
    import numpy as np

    from stdengine.events import Emitter
    from stdengine.options import Options
    from stdengine.structured import Constraint

# What an engine can declare. A check or feature that needs a capability the engine does not
# declare is reported as not supported, never as a failure.
CAPABILITIES: dict[str, str] = {
    "stream": "generate() yields tokens as they are produced",
    "logits": "decode(tokens) returns next-token logits",
    "tokenize": "tokenize() and detokenize() with the model's own vocabulary",
    "chat_template": "renders the model's chat template for a list of messages",
    "seed": "a seed makes sampling reproducible",
    "embeddings": "returns embeddings for a text",
    "batch": "evaluates a prompt in batches of batch_size / ubatch_size tokens",
    "gpu": "can offload layers to a GPU (n_gpu_layers)",
    "logprobs": "log-probabilities: generate() fills them when asked, score() rates a token sequence",
    "structured": "generate() honours GenerateRequest.constraint (JSON Schema, regex, grammar) by masking tokens",
    "batch_decode": "LocalEngine._evaluate_batch evaluates several contexts' tokens in shared forward passes",
    "tool_calls": "generate() passes GenerateRequest.tool_fields to a server that makes the calls itself",
}

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs / logprobs; the server refuses more
SCORE_CHUNK = 64  # score() decodes this many tokens at a time: all-token logits stay small

FinishReason = Literal["stop", "length"]


def _default(name: str) -> Any:
    """The Options field's default: SamplingParams restates no value (stdengine.options.SAMPLING)."""
    return SAMPLING[name].default


@dataclass
class SamplingParams:
    """Sampling semantics are specified once (spec/adapter.md) and shared by every engine. The
    fields are the options of stdengine.options.SAMPLING, with the Options fields' defaults (a
    test checks that the two name the same settings)."""

    temp: float = _default("temp")
    top_k: int = _default("top_k")
    top_p: float = _default("top_p")
    min_p: float = _default("min_p")
    repeat_penalty: float = _default("repeat_penalty")
    repeat_last_n: int = _default("repeat_last_n")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    seed: int = _default("seed")  # -1: a random seed
    n_predict: int = _default("n_predict")  # -1: until an end-of-generation token or the context is full
    stop: list[str] = field(default_factory=lambda: list(_default("stop")))

    @classmethod
    def from_options(cls, options: Options) -> SamplingParams:
        """The sampling settings of a set of canonical options (the CLI's flags, a server's
        defaults, a remote engine's load options)."""
        values = {name: getattr(options, name) for name in SAMPLING}
        values["stop"] = list(values["stop"])
        return cls(**values)


@dataclass
class GenerateRequest:
    """Exactly one of `prompt` (raw completion), `prompt_tokens` (raw completion of these token
    ids; only for engines with takes_prompt_tokens) or `messages` (chat, rendered by the template).

    logprobs: None = no log-probabilities; n >= 0 (at most MAX_TOP_LOGPROBS) = every TokenEvent
    carries the chosen token's log-probability and the n most likely tokens (engines that declare
    the `logprobs` capability).

    constraint: what the output must match (stdengine.structured.Constraint), for engines that
    declare the `structured` capability; others refuse it (UnsupportedOption).

    ignore_eos: an end-of-generation token never ends generation (its logits are masked);
    min_tokens: neither an end-of-generation token nor a stop string ends generation before this
    many tokens (llama-server's and vLLM's extensions; engines with `eog_controls`).

    tool_fields: chat with tools, for an engine with the `tool_calls` capability (a client of a
    server that makes calls itself): OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`,
    passed on as they are; the answer's calls come back as text in the server's call format, a
    JSON array of `{"name", "arguments"}` objects (stdengine.server.tools reads it)."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_tokens: list[int] | None = None
    logprobs: int | None = None
    constraint: Constraint | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # chat: OpenAI's tool list for a chat template that renders tools itself (its `tools`
    # variable; stdengine.server.tools decides when), passed to apply_chat_template
    tools: list[dict[str, Any]] | None = None
    tool_fields: dict[str, Any] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """llama.cpp's timing vocabulary (llama-server's `timings` object)."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        def per(n: int, ms: float) -> tuple[float, float]:
            return (ms / n if n else 0.0, 1e3 * n / ms if ms > 0 else 0.0)

        p_tok, p_sec = per(self.prompt_n, self.prompt_ms)
        g_tok, g_sec = per(self.predicted_n, self.predicted_ms)
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": g_tok,
            "predicted_per_second": g_sec,
        }


@dataclass
class TopLogprob:
    """A token and its log-probability under the model's distribution: log_softmax of the raw
    logits, before temperature, penalties and truncation (what OpenAI and llama-server report).
    `id` is -1 when the engine cannot say; `piece` is the token's bytes when the engine knows them
    (a token may be part of a UTF-8 character: `token` then shows U+FFFD)."""

    token: str
    logprob: float
    id: int = -1
    piece: bytes | None = None

    def utf8(self) -> bytes:
        """The token's bytes: its piece, else its text's."""
        return self.piece if self.piece is not None else self.token.encode("utf-8")


@dataclass
class TokenEvent:
    """One generated token and the text it completes (may be empty while UTF-8 or a possible
    stop string is held back). With GenerateRequest.logprobs set, `logprob` is the token's
    log-probability (`token` its text and bytes), and `top_logprobs` the n most likely tokens at
    that step, most likely first."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    token: TopLogprob | None = None


@dataclass
class PromptLogprobs:
    """What score_prompt() says about a token sequence t0..tT-1. `tokens[t]` is token t (its text
    and id) with its log-probability after tokens[:t] (NaN for the first: nothing comes before
    it); `top[t]` is the top_n most likely tokens after tokens[:t+1] (T rows: the last is the
    distribution of the token after the whole sequence)."""

    tokens: list[TopLogprob]
    top: list[list[TopLogprob]]


@dataclass
class DoneEvent:
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop: str | None = None  # the stop string that matched, if any


GenerationEvent = TokenEvent | DoneEvent


@dataclass
class EngineInfo:
    name: str
    version: str
    build: str = ""
    backend: str = "CPU"
    # the device layers run on ("" on the CPU): llama-bench's gpu_info
    gpu_info: str = ""
    model: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Engine(ABC):
    """Base class of every engine adapter. Subclasses set the class attributes and implement the
    abstract methods; everything else has a default that may be overridden."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    # canonical option name -> what it becomes in this engine (written into spec/options.md)
    option_map: ClassVar[dict[str, str]] = {}
    # options honoured only at these values (e.g. {"n_gpu_layers": (0,)} for a CPU-only engine)
    accepted_values: ClassVar[dict[str, tuple[Any, ...]]] = {}
    # the engine's own settings (-E key=value): key -> what it does and takes (`infer engines`)
    engine_args: ClassVar[dict[str, str]] = {}
    # False for engines that take no model file (e.g. a remote server named by --url)
    needs_model_file: ClassVar[bool] = True
    # True for engines whose generate() takes GenerateRequest.prompt_tokens (a prompt of token ids)
    takes_prompt_tokens: ClassVar[bool] = False
    # True for engines whose generate() honours GenerateRequest.ignore_eos and min_tokens
    eog_controls: ClassVar[bool] = False

    @classmethod
    def version(cls) -> str:
        return "0"

    @classmethod
    def honoured_options(cls) -> frozenset[str]:
        return frozenset(cls.option_map)

    @classmethod
    def availability(cls) -> tuple[bool, str | None]:
        """Whether the engine can load here, and why not (e.g. an extra that is not installed)."""
        return True, None

    @classmethod
    def decided_defaults(cls, options: Options) -> dict[str, Any]:
        """The values this engine will use for options left at a null default ("the engine
        decides"), shown by `infer config show`; options not named here stay null. The default:
        the catalogue's default model, for engines that load a model file."""
        if cls.needs_model_file and options.model is None:
            from stdengine import DEFAULT_MODEL

            return {"model": DEFAULT_MODEL}
        return {}

    @classmethod
    def build_info(cls) -> str:
        """A short line saying which build of the engine this machine runs (e.g. the SIMD path or
        the CPU features a library was compiled with), shown by `infer engines`; "" when there is
        nothing to say. Called only when availability() is true; it must not load a model."""
        return ""

    @classmethod
    def devices(cls) -> list[str]:
        """The GPU devices this engine can offload layers to on this machine, one line each (shown
        by `infer engines`, which then lists the `gpu` capability); [] for none. Called only when
        availability() is true; it must not load a model."""
        return []

    @classmethod
    @abstractmethod
    def load(cls, options: Options, events: Emitter) -> Engine:
        """Load the model named by options.model (already resolved to a local path for file engines)."""

    @abstractmethod
    def info(self) -> EngineInfo: ...

    @abstractmethod
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str: ...

    @abstractmethod
    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the context (llama_decode's role) and return the logits of the last
        token, shape (n_vocab,), or of every token, shape (len(tokens), n_vocab). The array
        belongs to the caller: no later call changes it (never return a view of an engine buffer
        that the next decode() overwrites)."""

    @abstractmethod
    def reset(self) -> None:
        """Clear the context (KV cache)."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> Iterator[GenerationEvent]:
        """Yield TokenEvents, then exactly one DoneEvent."""

    def n_ctx(self) -> int:
        raise NotImplementedError

    def partial_timings(self) -> Timings | None:
        """Optional: the timings of the generation in progress, or of the last one if it was cut
        short (Ctrl-C): the prompt once it is evaluated, the tokens generated so far. None when
        the engine cannot say (the caller then counts what it received)."""
        return None

    def has_chat_template(self) -> bool:
        return False

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """variables: more of the template's variables (`tools`)."""
        raise NotImplementedError

    def new_context(self) -> Engine | None:
        """Optional: another instance on the same loaded model with its own context (KV cache,
        sampler state), so that `infer serve -np N` serves N requests at once without loading the
        weights N times. Each instance is used by one thread at a time; different instances may
        run at the same time. close() on such an instance releases only its context. The default
        returns None: the engine has one context, and the server serialises requests on it."""
        return None

    def score(self, tokens: Sequence[int], top_n: int) -> list[list[TopLogprob]]:
        """For engines that declare `logprobs`: for each position t, the top_n most likely next
        tokens after tokens[:t+1], most likely first (row t of decode(tokens, all_logits=True))."""
        return self.score_prompt(tokens, top_n).top

    def score_prompt(self, tokens: Sequence[int], top_n: int) -> PromptLogprobs:
        """score() and the log-probability of each next token of the sequence (what an echoed
        completion reports). The default decodes with all_logits, from an empty context which it
        leaves empty, for engines that declare `logits`; an engine without logits overrides it."""
        if "logits" not in self.capabilities:
            raise NotImplementedError(f"engine '{self.name}' cannot score tokens (no logits)")
        self.reset()
        try:
            return score_by_decode(self, tokens, top_n)
        finally:
            self.reset()

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token's text (special tokens rendered), for log-probabilities. The
        default detokenizes it alone, which loses a partial UTF-8 character."""
        return self.detokenize([token]).encode("utf-8")

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Optional, for engines that declare the `embeddings` capability: one vector per text."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model; the default does nothing."""


def now_ms() -> float:
    return time.perf_counter() * 1e3


def check_engine_args(cls: type[Engine], options: Options) -> dict[str, str]:
    """The -E settings, each key one the engine declares (cls.engine_args); an unknown key is an
    error (an engine-specific setting is never silently dropped)."""
    unknown = sorted(set(options.engine_args) - set(cls.engine_args))
    if unknown:
        from stdengine.errors import UnsupportedOption

        valid = "; ".join(f"{k}: {v}" for k, v in cls.engine_args.items())
        raise UnsupportedOption(
            f"engine '{cls.name}' takes no -E settings, got: {', '.join(unknown)}"
            if not cls.engine_args
            else f"engine '{cls.name}' has no -E setting {', '.join(unknown)}",
            hint=f"valid -E keys: {valid}"
            if valid
            else "remove the -E flags (and any [engine_args] table of the config file); "
            f"the {cls.name} engine's settings are the canonical options (`infer engines`)",
            options=unknown,
        )
    return dict(options.engine_args)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, in float64."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


def top_logprobs(engine: Engine, logprobs: np.ndarray, n: int) -> list[TopLogprob]:
    """The n most likely tokens of one row of log-probabilities, most likely first (ties: the
    lower id first)."""
    import numpy as np

    n = min(n, logprobs.shape[-1])
    if n <= 0:
        return []
    ids = np.argpartition(-logprobs, n - 1)[:n]
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return [token_logprob(engine, int(i), float(logprobs[i])) for i in ids]


def token_logprob(engine: Engine, token: int, logprob: float) -> TopLogprob:
    piece = engine.token_bytes(token)
    return TopLogprob(piece.decode("utf-8", errors="replace"), logprob, token, piece)


def score_by_decode(engine: Engine, tokens: Sequence[int], top_n: int) -> PromptLogprobs:
    """score_prompt() from decode(all_logits=True), appended to the engine's context, a chunk of
    tokens at a time so that the logits of a long sequence are never all held at once."""
    from stdengine.errors import InvalidRequest

    ids = [int(t) for t in tokens]
    if not ids:
        raise InvalidRequest("nothing to score: the token list is empty")
    out = PromptLogprobs([token_logprob(engine, ids[0], math.nan)], [])
    for start in range(0, len(ids), SCORE_CHUNK):
        rows = log_softmax(engine.decode(ids[start : start + SCORE_CHUNK], all_logits=True))
        for i, row in enumerate(rows):
            t = start + i
            if t + 1 < len(ids):
                out.tokens.append(token_logprob(engine, ids[t + 1], float(row[ids[t + 1]])))
            out.top.append(top_logprobs(engine, row, top_n))
    return out


def check_logprobs(n: int | None) -> int | None:
    """A request's `logprobs`: None, or 0..MAX_TOP_LOGPROBS (else InvalidRequest)."""
    from stdengine.errors import InvalidRequest

    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {n}")
    return n


def check_token_ids(tokens: Sequence[int], n_vocab: int) -> list[int]:
    """The ids as ints, or InvalidRequest naming the first one outside [0, n_vocab) (a negative id
    must never index from the end of a table)."""
    from stdengine.errors import InvalidRequest

    ids = [int(t) for t in tokens]
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    return ids
