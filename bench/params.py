"""infer-bench's command line: llama-bench's flags, list and range syntax, and its test instances.

Written by hand in llama-bench's style (not click): `-p 128,256 -p 512` appends, `-t 1-8*2`
expands, and a bad argument prints `error: invalid parameter for argument: <arg>`, the usage
text, and exits 1. spec/bench-record.md describes the flags and their meaning.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace

from stdengine import DEFAULT_MODEL

OUTPUT_FORMATS = ("csv", "json", "jsonl", "md", "sql")
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")

# llama-bench flags that infer-bench does not take: named in the error instead of "invalid".
NOT_SUPPORTED = (
    "-C",
    "--cpu-mask",
    "--cpu-strict",
    "--poll",
    "-ncmoe",
    "--n-cpu-moe",
    "-sm",
    "--split-mode",
    "-mg",
    "--main-gpu",
    "-nkvo",
    "--no-kv-offload",
    "-embd",
    "--embeddings",
    "-nopo",
    "--no-op-offload",
    "--no-host",
    "-dev",
    "--device",
    "-ts",
    "--tensor-split",
    "-ot",
    "--override-tensor",
    "--prio",
    "--numa",
    "--list-devices",
    "-rpc",
    "--rpc",
)


class ParamError(Exception):
    """A bad command line: `arg` is the argument llama-bench's message names."""

    def __init__(self, arg: str, detail: str | None = None) -> None:
        super().__init__(detail or arg)
        self.arg = arg
        self.detail = detail


def physical_cores() -> int:
    """llama-bench's default thread count: physical cores (from /proc/cpuinfo), else logical CPUs."""
    try:
        cores: set[tuple[str | None, str]] = set()
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            phys: str | None = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":", 1)[1].strip()
                elif line.startswith("core id"):
                    cores.add((phys, line.split(":", 1)[1].strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")
_RANGE_SIGNED = re.compile(r"^(-?\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")


def parse_int_range(text: str, allow_negative: bool = False) -> list[int]:
    """`first[-last[(+|*)step]]` for each comma item, inclusive, strictly increasing.

    `8-32+8` -> 8,16,24,32; `1-16*2` -> 1,2,4,8,16. A range that does not increase (last < first,
    a step of +0 or *1, 0*k) is `invalid range`; anything else malformed is `invalid range format`.
    """
    out: list[int] = []
    pattern = _RANGE_SIGNED if allow_negative else _RANGE
    for item in text.split(","):
        m = pattern.match(item)
        if not m:
            raise ValueError("invalid range format")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op = m.group(3) or "+"
        step = int(m.group(4)) if m.group(4) is not None else 1
        if last < first:
            raise ValueError("invalid range")
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise ValueError("invalid range")
            i = nxt
    return out


def _parse_bools(text: str) -> list[bool]:
    out = []
    for item in text.split(","):
        if item not in ("0", "1"):
            raise ValueError(f"expected 0 or 1, got {item!r}")
        out.append(item == "1")
    return out


@dataclass
class BenchParams:
    """The parsed command line. Lists keep the user's order; empty lists take the defaults."""

    models: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    n_prompt: list[int] = field(default_factory=list)
    n_gen: list[int] = field(default_factory=list)
    n_pg: list[tuple[int, int]] = field(default_factory=list)
    n_depth: list[int] = field(default_factory=list)
    n_batch: list[int] = field(default_factory=list)
    n_ubatch: list[int] = field(default_factory=list)
    type_k: list[str] = field(default_factory=list)
    type_v: list[str] = field(default_factory=list)
    n_threads: list[int] = field(default_factory=list)
    n_gpu_layers: list[int] = field(default_factory=list)
    flash_attn: list[bool] = field(default_factory=list)
    use_mmap: list[bool] = field(default_factory=list)
    reps: int = 5
    delay: int = 0
    output: str = "md"
    output_err: str = "none"
    progress: bool = False
    no_warmup: bool = False
    sample_gen: bool = False  # tg tokens sampled (greedy) by the engine's sampler, not only their logits
    no_extensions: bool = False  # server modes: send plain OpenAI requests (no min_tokens, ignore_eos)
    verbose: bool = False
    engine_args: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    api_key: str | None = None
    concurrency: int = 0  # > 0: server load test
    requests: int = 0
    # canonical option names the user set (they must be honoured or refused per engine)
    given: set[str] = field(default_factory=set)


DEFAULTS = BenchParams(
    models=[DEFAULT_MODEL],
    engines=["reference"],
    n_prompt=[512],
    n_gen=[128],
    n_depth=[0],
    n_batch=[2048],
    n_ubatch=[512],
    type_k=["f16"],
    type_v=["f16"],
    n_threads=[physical_cores()],
    n_gpu_layers=[0],
    flash_attn=[False],
    use_mmap=[True],
)

USAGE = f"""usage: infer-bench [options]
       infer-bench compare BASE CANDIDATE [--plot FILE.png] [-o md|csv|json]
       infer-bench vs-llamacpp [--reps N] [--out DIR] ...   (reference engine vs llama.cpp)
       infer-bench tune -m MODEL [-e ENGINE] [--budget 10m]  (tune, check, write a recipe)

options:
  -h, --help
  -m, --model <filename|alias>              (default: {DEFAULT_MODEL})
  -e, --engine <name>                       (default: reference)
  -p, --n-prompt <n>                        (default: 512)
  -n, --n-gen <n>                           (default: 128)
  -pg <pp,tg>                               (default: none)
  -d, --n-depth <n>                         (default: 0)
  -b, --batch-size <n>                      (default: 2048)
  -ub, --ubatch-size <n>                    (default: 512)
  -ctk, --cache-type-k <t>                  (default: f16)
  -ctv, --cache-type-v <t>                  (default: f16)
  -t, --threads <n>                         (default: {DEFAULTS.n_threads[0]})
  -ngl, --n-gpu-layers <n>                  (default: 0)
  -fa, --flash-attn <0|1>                   (default: 0)
  -mmp, --mmap <0|1>                        (default: 1)
  -E <key=value>                            engine-specific setting (repeatable)
  --url <url>                               base URL of an OpenAI-compatible server (-e openai)
  --api-key <key>                           API key sent to --url
  --recipe <path|name|none>                 recipe to use (default: the best that applies here)
  --concurrency <n>                         server load test: requests in flight (with --url)
  --requests <n>                            server load test: requests in all (default: 8 x concurrency)
  -r, --repetitions <n>                     (default: 5)
  --delay <0...N> (seconds)                 delay between each test (default: 0)
  -o, --output <csv|json|jsonl|md|sql>      (default: md)
  -oe, --output-err <csv|json|jsonl|md|sql> (default: none)
  --progress                                print test progress indicators
  --no-warmup                               skip the warm-up runs before benchmarking
  --sample-gen                              tg: sample each token (greedy, the engine's own sampler) instead
                                            of only computing its logits (llama-bench's tg); shows an
                                            engine that computes only what its sampler needs
                                            (reference: -E screen_head=on|off)
  --no-extensions                           server modes: omit min_tokens / ignore_eos (answers may end early)
  -v, --verbose                             verbose output (engine logs and events on stderr)

Multiple values can be given for each parameter by separating them with ','
or by specifying the parameter multiple times. Ranges can be given as
'first-last' or 'first-last+step' or 'first-last*mult'.
Engines (-e) are one more dimension: every engine runs every combination.
"""


# flag -> (field, canonical option name or None, kind)
_LIST_FLAGS: dict[str, tuple[str, str | None, str]] = {
    "-m": ("models", "model", "str"),
    "--model": ("models", "model", "str"),
    "-e": ("engines", None, "str"),
    "--engine": ("engines", None, "str"),
    "-p": ("n_prompt", None, "range"),
    "--n-prompt": ("n_prompt", None, "range"),
    "-n": ("n_gen", None, "range"),
    "--n-gen": ("n_gen", None, "range"),
    "-d": ("n_depth", None, "range"),
    "--n-depth": ("n_depth", None, "range"),
    "-b": ("n_batch", "batch_size", "range"),
    "--batch-size": ("n_batch", "batch_size", "range"),
    "-ub": ("n_ubatch", "ubatch_size", "range"),
    "--ubatch-size": ("n_ubatch", "ubatch_size", "range"),
    "-ctk": ("type_k", "cache_type_k", "type"),
    "--cache-type-k": ("type_k", "cache_type_k", "type"),
    "-ctv": ("type_v", "cache_type_v", "type"),
    "--cache-type-v": ("type_v", "cache_type_v", "type"),
    "-t": ("n_threads", "threads", "range"),
    "--threads": ("n_threads", "threads", "range"),
    "-ngl": ("n_gpu_layers", "n_gpu_layers", "srange"),
    "--n-gpu-layers": ("n_gpu_layers", "n_gpu_layers", "srange"),
    "-fa": ("flash_attn", "flash_attn", "bool"),
    "--flash-attn": ("flash_attn", "flash_attn", "bool"),
    "-mmp": ("use_mmap", "mmap", "bool"),
    "--mmap": ("use_mmap", "mmap", "bool"),
}


def _check_option(option: str, values: list[object]) -> None:
    """Each value within the range its Options field declares (-t 0 is refused here, with the
    usage, not when the engine loads)."""
    from pydantic import ValidationError

    from stdengine.options import Options

    for v in values:
        try:
            Options.model_validate({option: v})
        except ValidationError as e:
            raise ValueError(f"{v} is out of range ({e.errors()[0]['msg']})") from None


def parse_args(argv: list[str]) -> BenchParams:
    """The command line -> BenchParams with defaults filled in. Raises ParamError."""
    p = BenchParams()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            arg = arg.replace("_", "-")

        def value(flag: str = arg) -> str:
            nonlocal i
            i += 1
            if i >= len(argv):
                raise ParamError(flag)
            return argv[i]

        try:
            if arg in ("-h", "--help"):
                print(USAGE, end="")
                sys.exit(0)
            elif arg in _LIST_FLAGS:
                name, option, kind = _LIST_FLAGS[arg]
                text = value()
                items: list[object]
                if kind == "str":
                    items = [s for s in text.split(",") if s]
                    if not items:
                        raise ValueError("empty value")
                elif kind == "range":
                    items = list(parse_int_range(text))
                elif kind == "srange":
                    items = list(parse_int_range(text, allow_negative=True))
                elif kind == "bool":
                    items = list(_parse_bools(text))
                else:  # cache types
                    items = list(text.split(","))
                    bad = [t for t in items if t not in CACHE_TYPES]
                    if bad:
                        raise ValueError(
                            f"unknown cache type {bad[0]!r} (expected one of {', '.join(CACHE_TYPES)})"
                        )
                if option:
                    _check_option(option, items)
                    p.given.add(option)
                getattr(p, name).extend(items)
            elif arg == "-pg":
                parts = value().split(",")
                if len(parts) != 2 or not all(s.isdigit() for s in parts):
                    raise ParamError(arg)
                p.n_pg.append((int(parts[0]), int(parts[1])))
            elif arg in ("-r", "--repetitions"):
                p.reps = _positive(value(), minimum=1)
            elif arg == "--delay":
                p.delay = _positive(value(), minimum=0)
            elif arg in ("-o", "--output"):
                p.output = value()
                if p.output not in OUTPUT_FORMATS:
                    raise ParamError(arg)
            elif arg in ("-oe", "--output-err"):
                p.output_err = value()
                if p.output_err not in (*OUTPUT_FORMATS, "none"):
                    raise ParamError(arg)
            elif arg == "-E":
                key, sep, val = value().partition("=")
                if not sep or not key.strip():
                    raise ValueError("-E expects key=value")
                p.engine_args[key.strip()] = val
                p.given.add("engine_args")
            elif arg == "--url":
                p.url = value()
                p.given.add("url")
            elif arg == "--api-key":
                p.api_key = value()
                p.given.add("api_key")
            elif arg == "--concurrency":
                p.concurrency = _positive(value(), minimum=1)
            elif arg == "--requests":
                p.requests = _positive(value(), minimum=1)
            elif arg == "--progress":
                p.progress = True
            elif arg == "--no-warmup":
                p.no_warmup = True
            elif arg == "--sample-gen":
                p.sample_gen = True
            elif arg == "--no-extensions":
                p.no_extensions = True
            elif arg in ("-v", "--verbose"):
                p.verbose = True
            elif arg in NOT_SUPPORTED:
                raise ParamError(arg, f"llama-bench's {arg} is not supported by infer-bench")
            else:
                raise ParamError(arg)
        except ValueError as e:
            raise ParamError(arg, str(e)) from e
        i += 1
    if p.requests and not p.concurrency:
        p.concurrency = 1
    if p.concurrency and not p.requests:
        p.requests = 8 * p.concurrency
    return with_defaults(p)


def _positive(text: str, minimum: int) -> int:
    if not re.fullmatch(r"\d+", text) or int(text) < minimum:
        raise ValueError(f"expected an integer >= {minimum}, got {text!r}")
    return int(text)


def with_defaults(p: BenchParams) -> BenchParams:
    """Empty lists take llama-bench's defaults (and stdengine's for -e, -m and -ngl)."""
    filled = replace(p)
    for name in (
        "models",
        "engines",
        "n_prompt",
        "n_gen",
        "n_depth",
        "n_batch",
        "n_ubatch",
        "type_k",
        "type_v",
        "n_threads",
        "n_gpu_layers",
        "flash_attn",
        "use_mmap",
    ):
        if not getattr(filled, name):
            setattr(filled, name, list(getattr(DEFAULTS, name)))
    return filled


@dataclass(frozen=True)
class Instance:
    """One test: a point of the cartesian product and its shape (pp, tg or pp+tg)."""

    model: str
    engine: str
    n_gpu_layers: int
    use_mmap: bool
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    flash_attn: bool
    n_threads: int
    n_depth: int
    n_prompt: int
    n_gen: int

    def load_key(self) -> tuple[object, ...]:
        """What a loaded engine depends on (everything but the test's shape and depth)."""
        return (
            self.model,
            self.engine,
            self.n_gpu_layers,
            self.use_mmap,
            self.n_batch,
            self.n_ubatch,
            self.type_k,
            self.type_v,
            self.flash_attn,
            self.n_threads,
        )

    @property
    def n_ctx(self) -> int:
        return self.n_prompt + self.n_gen + self.n_depth


def instances(p: BenchParams) -> list[Instance]:
    """llama-bench's order, outermost first: model, engine, ngl, mmap, n_batch, n_ubatch, type_k,
    type_v, fa, threads, n_depth; inside each, the pp tests, then the tg tests, then the pg pairs."""
    out: list[Instance] = []
    for model in p.models:
        for engine in p.engines:
            for ngl in p.n_gpu_layers:
                for mmap in p.use_mmap:
                    for nb in p.n_batch:
                        for nub in p.n_ubatch:
                            for tk in p.type_k:
                                for tv in p.type_v:
                                    for fa in p.flash_attn:
                                        for nt in p.n_threads:
                                            for nd in p.n_depth:
                                                base = (model, engine, ngl, mmap, nb, nub, tk, tv, fa, nt, nd)
                                                for n_prompt in p.n_prompt:
                                                    if n_prompt:
                                                        out.append(Instance(*base, n_prompt, 0))
                                                for n_gen in p.n_gen:
                                                    if n_gen:
                                                        out.append(Instance(*base, 0, n_gen))
                                                for pp, tg in p.n_pg:
                                                    if pp or tg:
                                                        out.append(Instance(*base, pp, tg))
    return out
