"""The canonical options: one table that the CLI flags, INFER_* variables, config files, the JSON
Schema and spec/options.md are all made from.

Each field's `json_schema_extra` carries its flags and group; the environment variable is
INFER_<NAME>. A default of None means "the engine decides" (e.g. threads = physical cores).

Sampling is declared here too, once: a field with `request=` names is a per-request sampling
setting, and its default and range (ge/le) are the ones SamplingParams, validate_sampling, the
server's request model and /props all use (`SAMPLING` is the table they read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]

GROUPS = {
    "load": "Model and load",
    "sampling": "Sampling",
    "prompt": "Prompt",
    "server": "Server and remote engines",
    "log": "Logging",
}


# The C cores' field widths (the reference engine's sampler: a 64-bit seed, 32-bit counts): a value
# past them is refused, not wrapped into another one.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def opt(
    default: Any,
    *flags: str,
    group: str,
    help: str,
    request: tuple[str, ...] = (),
    request_range: tuple[float, float] | None = None,
    **kw: Any,
) -> Any:
    """A canonical option. `request`: the names an OpenAI-style request sets it by (only sampling
    settings have them); `request_range`: narrower bounds a request must keep to, where the wire
    protocol has them (OpenAI's -2..2 for the penalties) but the option itself has none."""
    extra: dict[str, Any] = {"flags": list(flags), "group": group}
    if request:
        extra["request"] = list(request)
    if request_range is not None:
        extra["request_range"] = list(request_range)
    return Field(default, description=help, json_schema_extra=extra, **kw)


class Options(BaseModel):
    """Every canonical option. Unknown keys are errors (extra="forbid")."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- model and load -------------------------------------------------------------------
    model: str | None = opt(
        None,
        "-m",
        "--model",
        group="load",
        help="model: a .gguf path, a catalogue alias, or hf://owner/repo/file",
    )
    engine: str = opt("reference", "-e", "--engine", group="load", help="engine to run the model with")
    ctx_size: int = opt(
        4096,
        "-c",
        "--ctx-size",
        group="load",
        ge=0,
        help="context size in tokens (0 = the model's training context)",
    )
    threads: int | None = opt(
        None, "-t", "--threads", group="load", ge=1, help="threads for generation (default: physical cores)"
    )
    threads_batch: int | None = opt(
        None,
        "-tb",
        "--threads-batch",
        group="load",
        ge=1,
        help="threads for prompt processing (default: same as threads)",
    )
    batch_size: int = opt(
        2048,
        "-b",
        "--batch-size",
        group="load",
        ge=1,
        help="logical batch: most prompt tokens submitted per decode call",
    )
    ubatch_size: int = opt(
        512,
        "-ub",
        "--ubatch-size",
        group="load",
        ge=1,
        help="physical batch: most tokens evaluated in one forward pass",
    )
    n_gpu_layers: int = opt(
        0, "-ngl", "--n-gpu-layers", group="load", ge=-1, help="layers to offload to a GPU (-1 = all)"
    )
    device: str | None = opt(
        None,
        "--device",
        group="load",
        help="the GPU device -ngl offloads to: an index or a part of its name, as `infer engines` "
        "lists them (default: the first)",
    )
    cache_type_k: CacheType = opt("f16", "-ctk", "--cache-type-k", group="load", help="KV cache type for K")
    cache_type_v: CacheType = opt("f16", "-ctv", "--cache-type-v", group="load", help="KV cache type for V")
    flash_attn: bool = opt(False, "-fa", "--flash-attn", group="load", help="use flash attention")
    mmap: bool = opt(True, "--mmap", group="load", help="memory-map the model file (--no-mmap to read it)")
    mlock: bool = opt(False, "--mlock", group="load", help="lock the model in RAM")
    seed: int = opt(
        -1,
        "-s",
        "--seed",
        group="load",
        request=("seed",),
        ge=-1,
        le=INT64_MAX,
        help="random seed (-1 = random)",
    )

    # --- sampling --------------------------------------------------------------------------
    temp: float = opt(
        0.8, "--temp", group="sampling", request=("temperature",), ge=0.0, help="temperature (0 = greedy)"
    )
    top_k: int = opt(
        40,
        "--top-k",
        group="sampling",
        request=("top_k",),
        ge=0,
        le=INT32_MAX,
        help="top-k sampling (0 = off)",
    )
    top_p: float = opt(
        0.95,
        "--top-p",
        group="sampling",
        request=("top_p",),
        ge=0.0,
        le=1.0,
        help="top-p sampling (1.0 = off)",
    )
    min_p: float = opt(
        0.05,
        "--min-p",
        group="sampling",
        request=("min_p",),
        ge=0.0,
        le=1.0,
        help="min-p sampling (0.0 = off)",
    )
    repeat_penalty: float = opt(
        1.0,
        "--repeat-penalty",
        group="sampling",
        request=("repeat_penalty",),
        ge=0.0,
        help="penalty for repeated tokens (1.0 = off)",
    )
    repeat_last_n: int = opt(
        64,
        "--repeat-last-n",
        group="sampling",
        request=("repeat_last_n",),
        ge=-1,
        le=INT32_MAX,
        help="tokens considered by the penalties (0 = off, -1 = context)",
    )
    presence_penalty: float = opt(
        0.0,
        "--presence-penalty",
        group="sampling",
        request=("presence_penalty",),
        request_range=(-2.0, 2.0),
        help="presence penalty (0 = off)",
    )
    frequency_penalty: float = opt(
        0.0,
        "--frequency-penalty",
        group="sampling",
        request=("frequency_penalty",),
        request_range=(-2.0, 2.0),
        help="frequency penalty (0 = off)",
    )
    n_predict: int = opt(
        -1,
        "-n",
        "--n-predict",
        group="sampling",
        # max_completion_tokens is the chat route's newer name for max_tokens
        request=("max_tokens", "max_completion_tokens"),
        ge=-1,
        help="tokens to generate (-1 = until end of generation or a full context)",
    )
    stop: list[str] = opt(
        [],
        "--stop",
        group="sampling",
        request=("stop",),
        help="stop string (repeatable); generation ends before it",
    )

    # --- prompt ----------------------------------------------------------------------------
    prompt: str | None = opt(None, "-p", "--prompt", group="prompt", help="prompt text")
    file: str | None = opt(None, "-f", "--file", group="prompt", help="read the prompt from a file")
    system: str | None = opt(None, "-sys", "--system", group="prompt", help="system prompt for chat models")
    chat_template: str | None = opt(
        None, "--chat-template", group="prompt", help="Jinja chat template to use instead of the model's"
    )

    # --- server and remote engines ---------------------------------------------------------
    host: str = opt("127.0.0.1", "--host", group="server", help="address to listen on")
    port: int = opt(8080, "--port", group="server", ge=0, le=65535, help="port to listen on")
    api_key: str | None = opt(
        None, "--api-key", group="server", help="API key the server requires, or sends to a remote engine"
    )
    parallel: int = opt(1, "-np", "--parallel", group="server", ge=1, help="requests served at once")
    url: str | None = opt(None, "--url", group="server", help="base URL of an OpenAI-compatible engine")

    # --- logging ---------------------------------------------------------------------------
    log_format: Literal["text", "json"] = opt(
        "text", "--log-format", group="log", help="stderr log format: text or json (JSON Lines)"
    )
    log_file: str | None = opt(
        None, "--log-file", group="log", help="also write every event as JSON Lines here"
    )
    verbosity: int = opt(
        0, "-lv", "--verbosity", group="log", ge=0, help="log verbosity (0 = info, 1+ = debug); -v sets 1"
    )

    # --- engine-specific passthrough -------------------------------------------------------
    engine_args: dict[str, str] = Field(
        default_factory=dict,
        description="engine-specific settings, -E key=value (repeatable); the engine validates them",
        json_schema_extra={"flags": ["-E"], "group": "load"},
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic takes true as 1 for an int field; a config file's `threads = true` is a
        mistake to report, not one thread."""
        kind = cls.model_fields[info.field_name or ""].annotation
        if isinstance(value, bool) and kind in (int, float, int | None, float | None):
            raise ValueError("expected a number, not true or false")
        return value


class RecipeMatch(BaseModel):
    """A config file's [match] table: accepted and validated so that files written with one keep
    loading, but it selects nothing. Settings for one model on one machine are recipes, files of
    their own (stdengine.recipes, spec/recipes.md), chosen by model, engine and machine."""

    model_config = ConfigDict(extra="forbid")

    model_sha256: str | None = None
    architecture: str | None = None
    file_type: str | None = None
    cpu_flags: list[str] = []
    gpu: str | None = None


class ConfigFile(Options):
    """A config file: any canonical option at the top level, engine_args as a table, and an
    optional [match] table that is validated but selects nothing (recipes do that)."""

    match: RecipeMatch | None = None


OPTION_NAMES: tuple[str, ...] = tuple(Options.model_fields)

# Names other tools use for canonical options; only used to suggest the right name in errors.
# The request names of the sampling options (below) are added to it.
ALIASES: dict[str, str] = {
    "n_ctx": "ctx_size",
    "context_size": "ctx_size",
    "context_length": "ctx_size",
    "n_threads": "threads",
    "n_threads_batch": "threads_batch",
    "n_batch": "batch_size",
    "n_ubatch": "ubatch_size",
    "gpu_layers": "n_gpu_layers",
    "ngl": "n_gpu_layers",
    "repetition_penalty": "repeat_penalty",
    "system_prompt": "system",
    "stop_strings": "stop",
    "use_mmap": "mmap",
    "use_mlock": "mlock",
}


def env_var(name: str) -> str:
    return "INFER_" + name.upper()


def flags(name: str) -> list[str]:
    extra = Options.model_fields[name].json_schema_extra
    assert isinstance(extra, dict)
    return list(extra["flags"])  # type: ignore[arg-type]


def group(name: str) -> str:
    extra = Options.model_fields[name].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["group"])


DEFAULTS: dict[str, Any] = Options().model_dump()


@dataclass(frozen=True)
class SamplingOption:
    """One per-request sampling setting, as its Options field declares it.

    ge/le: the option's range (None = unbounded), checked by validate_sampling wherever a request
    comes from; request_ge/request_le: what an HTTP request may set (the option's range, narrowed
    where the wire protocol is stricter); request: the request field names that set it."""

    name: str
    annotation: Any
    default: Any
    ge: float | None
    le: float | None
    request_ge: float | None
    request_le: float | None
    request: tuple[str, ...]
    help: str


def _sampling_option(name: str) -> SamplingOption | None:
    field = Options.model_fields[name]
    extra = field.json_schema_extra
    assert isinstance(extra, dict)
    if "request" not in extra:
        return None
    bounds = {k: getattr(m, k) for m in field.metadata for k in ("ge", "le") if hasattr(m, k)}
    narrow: list[Any] = extra.get("request_range") or [bounds.get("ge"), bounds.get("le")]  # type: ignore[assignment]
    return SamplingOption(
        name=name,
        annotation=field.annotation,
        default=field.get_default(call_default_factory=True),
        ge=bounds.get("ge"),
        le=bounds.get("le"),
        request_ge=narrow[0],
        request_le=narrow[1],
        request=tuple(extra["request"]),  # type: ignore[arg-type]
        help=field.description or "",
    )


# option name -> its sampling declaration, in Options' field order: the one table of sampling
# settings (SamplingParams' fields, validate_sampling's ranges, the server's request fields and /props)
SAMPLING: dict[str, SamplingOption] = {
    name: o for name in OPTION_NAMES if (o := _sampling_option(name)) is not None
}

# request field name -> option name (e.g. "temperature" -> "temp", "max_tokens" -> "n_predict")
SAMPLING_REQUEST_NAMES: dict[str, str] = {r: o.name for o in SAMPLING.values() for r in o.request}

ALIASES.update({r: name for r, name in SAMPLING_REQUEST_NAMES.items() if r != name})
