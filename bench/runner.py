"""llama-bench's measurement through the adapter interface, for any engine with `decode`.

Per test: clear the context (engine.reset()), warm up (the whole prompt if n_prompt > 0, one
generated token if n_gen > 0; untimed), then per repetition: clear, prefill n_depth tokens
untimed, and time the prompt (random tokens, BOS first when the model adds one, decoded in chunks
of n_batch) followed by n_gen single-token decodes of random tokens (no sampling; with --sample-gen
each decode is followed by a greedy sample of the engine's own sampler, as `infer run --temp 0`
makes a token, and the random token is still the next one fed). The engine is
loaded once per distinct load configuration, with n_ctx the largest n_prompt + n_gen + n_depth of
the tests that share it.
"""

from __future__ import annotations

import io
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stdengine.bench.params import BenchParams, Instance, instances
from stdengine.bench.record import FIXED, build_of, cpu_info, finish, model_fields, utc_now

from stdengine.adapter import SamplingParams
from stdengine.errors import EngineFailure, InferError, UnsupportedOption


class Decoder(Protocol):
    def decode(self, tokens: Sequence[int], all_logits: bool = False) -> Any: ...

    def reset(self) -> None: ...


class Progress(Protocol):
    def step(self, index: int, total: int, what: str) -> None: ...

    def advance(self) -> None: ...


class NoProgress:
    def step(self, index: int, total: int, what: str) -> None:
        pass

    def advance(self) -> None:
        pass


@dataclass
class TokenSource:
    """llama-bench's tokens: uniformly random ids below n_vocab, BOS first when the model adds one."""

    n_vocab: int
    bos: int | None
    rng: random.Random = field(default_factory=lambda: random.Random(1))

    def random(self) -> int:
        return self.rng.randrange(self.n_vocab)


def run_prompt(engine: Decoder, n_tokens: int, n_batch: int, src: TokenSource) -> None:
    """Decode n_tokens in chunks of n_batch; the first token of the first chunk is BOS if any."""
    done = 0
    while done < n_tokens:
        n = min(n_tokens - done, n_batch)
        chunk = [src.bos if done == 0 and src.bos is not None else src.random()]
        chunk += [src.random() for _ in range(n - 1)]
        engine.decode(chunk)
        done += n


GREEDY = SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0)


def run_gen(engine: Decoder, n_gen: int, src: TokenSource, sample: bool = False) -> None:
    """n_gen single-token decodes; the first token is BOS if the model adds one, then random ones.
    sample: each token's evaluation is followed by a greedy sample (an in-process engine's
    _evaluate and _sample_tokens, LocalEngine's generation loop) instead of returning its logits."""
    token = src.bos if src.bos is not None else src.random()
    if not sample:
        for _ in range(n_gen):
            engine.decode([token])
            token = src.random()
        return
    local: Any = engine
    samples = local._sample_tokens(GREEDY)
    try:
        for _ in range(n_gen):
            local._evaluate([token])
            next(samples)
            token = src.random()
    finally:
        samples.close()


def measure(
    engine: Decoder,
    inst: Instance,
    reps: int,
    warmup: bool,
    src: TokenSource,
    progress: Progress | None = None,
    index: int = 1,
    total: int = 1,
    delay: int = 0,
    sample: bool = False,
) -> list[int]:
    """One test: its samples_ns (one per repetition)."""
    progress = progress or NoProgress()
    engine.reset()
    if delay:
        time.sleep(delay)
    if warmup:
        if inst.n_prompt > 0:
            progress.step(index, total, "warmup prompt run")
            run_prompt(engine, inst.n_prompt, inst.n_batch, src)
        if inst.n_gen > 0:
            progress.step(index, total, "warmup generation run")
            run_gen(engine, 1, src, sample)
        progress.advance()
    samples: list[int] = []
    for i in range(reps):
        engine.reset()
        if inst.n_depth > 0:
            progress.step(index, total, f"depth run {i + 1}/{reps}")
            run_prompt(engine, inst.n_depth, inst.n_batch, src)
        t0 = time.perf_counter_ns()
        if inst.n_prompt > 0:
            progress.step(index, total, f"prompt run {i + 1}/{reps}")
            run_prompt(engine, inst.n_prompt, inst.n_batch, src)
        if inst.n_gen > 0:
            progress.step(index, total, f"generation run {i + 1}/{reps}")
            run_gen(engine, inst.n_gen, src, sample)
        samples.append(time.perf_counter_ns() - t0)
        progress.advance()
    return samples


# --- loading -------------------------------------------------------------------------------


def bench_emitter(params: BenchParams) -> Any:
    """infer-bench's log: events on stderr (text) only with -v, as llama-bench prints nothing else."""
    from stdengine.events import Emitter

    return Emitter(verbosity=1 if params.verbose else 0, stream=None if params.verbose else io.StringIO())


def options_for(inst: Instance, cls: Any, params: BenchParams, n_ctx: int) -> tuple[dict[str, Any], set[str]]:
    """The canonical options to load `inst` with, and those the user set (which the engine must
    honour or refuse). infer-bench's own choices (n_ctx, threads) are passed only to engines that
    honour them."""
    honoured = cls.honoured_options()
    values: dict[str, Any] = {
        "model": inst.model,
        "engine": inst.engine,
        "batch_size": inst.n_batch,
        "ubatch_size": inst.n_ubatch,
        "n_gpu_layers": inst.n_gpu_layers,
        "cache_type_k": inst.type_k,
        "cache_type_v": inst.type_v,
        "flash_attn": inst.flash_attn,
        "mmap": inst.use_mmap,
        "engine_args": dict(params.engine_args),
        "url": params.url,
        "api_key": params.api_key,
        "verbosity": 1 if params.verbose else 0,
    }
    if "ctx_size" in honoured:
        values["ctx_size"] = n_ctx
    if "threads" in honoured or "threads" in params.given:
        values["threads"] = inst.n_threads
    if "threads_batch" in honoured:
        values["threads_batch"] = inst.n_threads
    given = set(params.given) - {"model"}
    return values, given


# Instance field -> the canonical option it is (what a recipe may set on a test).
INSTANCE_OPTIONS = {
    "n_batch": "batch_size",
    "n_ubatch": "ubatch_size",
    "n_threads": "threads",
    "type_k": "cache_type_k",
    "type_v": "cache_type_v",
    "n_gpu_layers": "n_gpu_layers",
    "flash_attn": "flash_attn",
    "use_mmap": "mmap",
}
# Options a recipe may set that a test has no field for, passed to the engine as they are.
RECIPE_EXTRAS = ("threads_batch", "engine_args")


def recipe_for(
    group: Group, cls: Any, params: BenchParams, ref: str | None, warn: Callable[[str], None]
) -> tuple[Group, dict[str, Any], str]:
    """The group with the recipe for its engine and model applied to what the command line did
    not set (spec/recipes.md): its tests, the options without a test field, the recipe's name."""
    from dataclasses import replace

    from stdengine import recipes

    first = group.tests[0][1]
    chosen = recipes.select(ref, first.engine, first.model)
    if chosen is None:
        return group, {}, ""
    for w in chosen.warnings:
        warn(f"warning: {w}")
    fields: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for name, value in chosen.recipe.set_options().items():
        # -t sets both thread counts, as llama-bench's does
        if name in params.given or (name == "threads_batch" and "threads" in params.given):
            continue
        if not recipes.honoured(cls, name, value):
            continue
        field_name = next((f for f, o in INSTANCE_OPTIONS.items() if o == name), None)
        if field_name is not None:
            fields[field_name] = value
        elif name in RECIPE_EXTRAS:
            extras[name] = value
    shown = " ".join(f"{k}={v}" for k, v in {**fields, **extras}.items())
    warn(f"infer-bench: recipe {chosen.recipe.name} ({chosen.path}): {shown or 'nothing to apply'}")
    tests = [(i, replace(inst, **fields)) for i, inst in group.tests]
    return Group(tests[0][1].load_key(), tests), extras, chosen.recipe.name


@dataclass
class Group:
    """Consecutive tests that share a load configuration."""

    key: tuple[object, ...]
    tests: list[tuple[int, Instance]]

    @property
    def n_ctx(self) -> int:
        return max(inst.n_ctx for _, inst in self.tests)


def groups(insts: list[Instance]) -> list[Group]:
    out: list[Group] = []
    for i, inst in enumerate(insts, 1):
        if out and out[-1].key == inst.load_key():
            out[-1].tests.append((i, inst))
        else:
            out.append(Group(inst.load_key(), [(i, inst)]))
    return out


def describe_refusal(e: UnsupportedOption, values: dict[str, Any]) -> str:
    opts = e.details.get("options") or []
    shown = ", ".join(f"{o}={_flag_value(values.get(o))}" for o in opts) or e.message
    return shown


def _flag_value(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def bos_token(engine: Any) -> int | None:
    """The BOS id if the model adds one: what the engine's own tokenizer puts before an empty text."""
    if "tokenize" not in engine.capabilities:
        return None
    try:
        ids = engine.tokenize("", add_special=True, parse_special=True)
    except Exception:
        return None
    return int(ids[0]) if ids else None


def run(
    params: BenchParams,
    on_record: Callable[[dict[str, Any]], None],
    events: Any,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
    on_start: Callable[[], None] | None = None,
    recipe: str | None = None,
) -> int:
    """Run every test; each finished record goes to on_record. Returns the exit status: 0, or the
    status of the last error (an engine that failed to load or run is reported and skipped).
    `recipe`: the recipe to use (a file or name; "none": no recipe), else the best that applies."""
    from stdengine import registry
    from stdengine.options import Options
    from stdengine.store import resolve_model

    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    progress = progress or NoProgress()

    # Fail fast on what is wrong for every test: an unknown engine, a model that does not exist.
    classes = {name: registry.engine_class(name) for name in params.engines}
    for cls in classes.values():
        ok, reason = cls.availability()
        if not ok:
            from stdengine.errors import EngineUnavailable

            raise EngineUnavailable(f"engine '{cls.name}' cannot load here: {reason}")
    # Before anything loads, the classes' declarations are all there is to go by (fail fast); a
    # loaded engine's own capabilities are read from the instance (bos_token).
    no_decode = [name for name, cls in classes.items() if "logits" not in cls.capabilities]
    if no_decode:
        raise UnsupportedOption(
            f"engine{'s' if len(no_decode) > 1 else ''} {', '.join(no_decode)} cannot decode in-process "
            "(no 'logits' capability), which llama-bench's measurement needs",
            hint="benchmark a server alone in server mode: -e openai --url URL (spec/bench-record.md §6)",
        )
    paths: dict[str, str] = {}
    if any(getattr(cls, "needs_model_file", True) for cls in classes.values()):
        for ref in params.models:
            paths[ref] = str(resolve_model(ref, events=events))

    if on_start is not None:
        on_start()
    insts = instances(params)
    total = len(insts)
    status = 0
    for group in groups(insts):
        cls = classes[group.tests[0][1].engine]
        group, extras, recipe_name = recipe_for(group, cls, params, recipe, warn)
        first = group.tests[0][1]
        model_path = paths.get(first.model, first.model)
        inst0 = _with_model(first, model_path)
        values, given = options_for(inst0, cls, params, group.n_ctx)
        if "engine_args" in extras:  # -E keys win over the recipe's
            extras["engine_args"] = {**extras["engine_args"], **values["engine_args"]}
        values.update(extras)
        try:
            registry.check_options(cls, given, values)
        except UnsupportedOption as e:
            n = len(group.tests)
            warn(
                f"warning: engine '{cls.name}' cannot honour {describe_refusal(e, values)}; "
                f"skipping {n} test{'s' if n != 1 else ''} with these settings"
            )
            for _ in range(n * ((0 if params.no_warmup else 1) + params.reps)):
                progress.advance()
            continue
        try:
            engine = registry.load(Options.model_validate(values), events, given).engine
        except Exception as e:  # reported, and the other engines still run
            warn(f"error: engine '{cls.name}' failed to load {model_path}: {_message(e)}")
            if isinstance(e, InferError) and e.hint:
                warn(f"hint: {e.hint}")
            status = e.exit_status if isinstance(e, InferError) else EngineFailure.exit_status
            continue
        try:
            status = (
                _run_group(
                    engine,
                    cls,
                    group,
                    params,
                    model_path,
                    on_record,
                    events,
                    progress,
                    total,
                    warn,
                    recipe_name,
                )
                or status
            )
        finally:
            engine.close()
    return status


def _message(e: Exception) -> str:
    return e.message if isinstance(e, InferError) else f"{type(e).__name__}: {e}"


def _with_model(inst: Instance, path: str) -> Instance:
    from dataclasses import replace

    return replace(inst, model=path)


def _run_group(
    engine: Any,
    cls: Any,
    group: Group,
    params: BenchParams,
    model_path: str,
    on_record: Callable[[dict[str, Any]], None],
    events: Any,
    progress: Progress,
    total: int,
    warn: Callable[[str], None],
    recipe_name: str = "",
) -> int:
    info = engine.info()
    commit, number = build_of(cls.name, info.build, info.version)
    try:
        mf = model_fields(model_path)
    except InferError:
        mf = {
            "model_type": str(info.model.get("architecture", "unknown")) + " ?B unknown",
            "model_size": 0,
            "model_n_params": int(info.model.get("n_params", 0) or 0),
            "n_vocab": None,
        }
    n_vocab = info.model.get("n_vocab") or mf["n_vocab"]
    if not n_vocab:
        warn(f"error: engine '{cls.name}' does not report the vocabulary size; cannot make random tokens")
        return 1
    if params.sample_gen and not hasattr(engine, "_sample_tokens"):
        warn(f"error: --sample-gen needs an engine that samples in process; '{cls.name}' does not")
        return 2
    src = TokenSource(int(n_vocab), bos_token(engine))
    try:
        n_ctx = int(engine.n_ctx())
    except NotImplementedError:
        n_ctx = group.n_ctx
    for index, inst in group.tests:
        progress.step(index, total, "starting")
        test_time = utc_now()
        try:
            samples = measure(
                engine,
                inst,
                params.reps,
                not params.no_warmup,
                src,
                progress,
                index,
                total,
                params.delay,
                params.sample_gen,
            )
        except Exception as e:
            warn(f"error: engine '{cls.name}' failed in test {index}/{total}: {_message(e)}")
            return e.exit_status if isinstance(e, InferError) else EngineFailure.exit_status
        rec: dict[str, Any] = {
            "build_commit": commit,
            "build_number": number,
            "cpu_info": cpu_info(),
            "gpu_info": info.gpu_info or ("" if info.backend == "CPU" else info.backend),
            "backends": info.backend or "CPU",
            "model_filename": model_path,
            "model_type": mf["model_type"],
            "model_size": mf["model_size"],
            "model_n_params": mf["model_n_params"],
            "n_batch": inst.n_batch,
            "n_ubatch": inst.n_ubatch,
            "n_threads": inst.n_threads,
            **FIXED,
            "type_k": inst.type_k,
            "type_v": inst.type_v,
            "n_gpu_layers": inst.n_gpu_layers,
            "flash_attn": inst.flash_attn,
            "use_mmap": inst.use_mmap,
            "n_prompt": inst.n_prompt,
            "n_gen": inst.n_gen,
            "n_depth": inst.n_depth,
            "test_time": test_time,
            "engine": cls.name,
            "engine_version": info.version,
            "engine_build": info.build,
            "n_ctx": n_ctx,
            "recipe": recipe_name,
            "engine_args": ",".join(f"{k}={v}" for k, v in sorted(params.engine_args.items())),
            "gen_sampled": params.sample_gen and inst.n_gen > 0,
        }
        finish(rec, samples)
        events.info(
            "bench.result",
            **{k: v for k, v in rec.items() if k != "samples_ns"},
            samples_ns=rec["samples_ns"],
        )
        on_record(rec)
    return 0
