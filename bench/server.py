"""Server mode: benchmarking an OpenAI-compatible server (`-e openai --url URL`) over HTTP.

llama-bench's tests (pp, tg, pp+tg at each depth) through streaming `/v1/completions` requests
sent only to --url, measured llama-benchy's way: a fresh random prompt per request (so that no
prompt cache can answer it), the depth sent first as its own untimed request so that a server with
a prompt cache holds it, then the timed request. `--concurrency N --requests M` runs the load test
instead (bench/load.py); the HTTP client is bench/client.py. run_server_cli is the entry the bench
CLI calls. spec/bench-record.md defines every metric by a formula. A recipe for the engine and the
served model sets the tests' request options (its sampling), as it does for `infer run -e openai`
(spec/recipes.md).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from stdengine.bench.client import (
    Prompts,
    Stream,
    Target,
    check_extensions,
    completion_body,
    measure_latency,
    served_model,
    stream_completion,
)
from stdengine.bench.load import load_metrics, percentile, render_load, run_load_test
from stdengine.bench.params import BenchParams
from stdengine.bench.record import FIXED, cpu_info, finish, utc_now

from stdengine.errors import EngineFailure, UnsupportedOption, UsageError

__all__ = [
    "Stream",
    "load_metrics",
    "percentile",
    "recipe_fields",
    "run_server_cli",
    "run_tests",
    "server_md",
]


# --- the recipe's request options ------------------------------------------------------------

# Request options a test leaves alone: it fixes the length itself (max_tokens, min_tokens,
# ignore_eos), and a stop string would cut the generation it times.
NOT_SENT = ("n_predict", "stop")


def recipe_fields(
    ref: str | None, engine: str, model: str, extensions: bool, warn: Callable[[str], None]
) -> tuple[dict[str, Any], str]:
    """The request fields the recipe for this engine and served model sets (its sampling
    options, by their OpenAI/llama.cpp request names), and the recipe's name ("" for none).
    llama.cpp's extra fields (top_k, min_p, repeat_penalty, repeat_last_n) are sent only with
    the benchmark's extensions: --no-extensions asks for plain OpenAI requests."""
    from stdengine import recipes
    from stdengine.engines.openai import DIALECT_EXTRAS
    from stdengine.options import SAMPLING

    chosen = recipes.select(ref, engine, model)
    if chosen is None:
        return {}, ""
    for w in chosen.warnings:
        warn(f"warning: {w}")
    _, cls = recipes.engine_version(engine)
    fields: dict[str, Any] = {}
    applied: dict[str, Any] = {}
    ignored: list[str] = []
    for name, value in chosen.recipe.set_options().items():
        sent = (
            name in SAMPLING
            and name not in NOT_SENT
            and recipes.honoured(cls, name, value)
            and (extensions or name not in DIALECT_EXTRAS["llama.cpp"])
            and not (name == "seed" and value < 0)  # -1: no seed
        )
        if sent:
            fields[SAMPLING[name].request[0]] = value
            applied[name] = value
        else:
            ignored.append(name)
    shown = " ".join(f"{k}={v}" for k, v in applied.items()) or "nothing to apply"
    if ignored:
        shown += f" (not sent: {', '.join(ignored)})"
    warn(f"infer-bench: recipe {chosen.recipe.name} ({chosen.path}): {shown}")
    return fields, chosen.recipe.name


# --- llama-bench's tests over HTTP -------------------------------------------------------------


def run_tests(
    params: BenchParams,
    on_record: Callable[[dict[str, Any]], None],
    warn: Callable[[str], None] | None = None,
    progress: Any = None,
    recipe: str | None = None,
) -> int:
    """llama-bench's tests against the server; `recipe`: the recipe to use (a file or name;
    "none": no recipe), else the best that applies to the engine and the served model."""
    target = Target.of(params)
    api = target.api
    warn = warn or (lambda m: print(m, file=sys.stderr, flush=True))
    engine = params.engines[0] if params.engines else "openai"
    with target.client() as client:
        latency = measure_latency(client, api)
        model = served_model(client, api, params)
        fields, recipe_name = recipe_fields(recipe, engine, model, not params.no_extensions, warn)
        prompts = Prompts(client, target.root, model)
        if prompts.route is None:
            warn(
                "warning: the server has no tokenize endpoint; prompt sizes are estimates (one token per word)"
            )
        tests = [(pp, 0) for pp in params.n_prompt if pp] + [(0, tg) for tg in params.n_gen if tg]
        tests += [(pp, tg) for pp, tg in params.n_pg if pp or tg]
        total = len(tests) * len(params.n_depth)
        index = 0
        for depth in params.n_depth:
            for n_prompt, n_gen in tests:
                index += 1
                if progress:
                    progress.step(index, total, "starting")
                rec = _one_test(
                    client,
                    api,
                    model,
                    prompts,
                    params,
                    n_prompt,
                    n_gen,
                    depth,
                    latency,
                    warn,
                    index,
                    total,
                    progress,
                    fields,
                )
                if rec is None:
                    return EngineFailure.exit_status
                rec.update(engine=engine, url=params.url, recipe=recipe_name)
                on_record(rec)
    return 0


def _one_test(
    client: Any,
    api: str,
    model: str,
    prompts: Prompts,
    params: BenchParams,
    n_prompt: int,
    n_gen: int,
    depth: int,
    latency: float,
    warn: Callable[[str], None],
    index: int,
    total: int,
    progress: Any,
    fields: dict[str, Any],
) -> dict[str, Any] | None:
    def request(prompt: str, max_tokens: int) -> Stream | None:
        body = completion_body(model, prompt, max_tokens, not params.no_extensions)
        s = stream_completion(client, api, {**body, **fields})  # the recipe's sampling, if any
        check_extensions(s)
        if s.error:
            warn(f"error: test {index}/{total}: {s.error}")
            return None
        return s

    def step(what: str) -> None:
        if progress:
            progress.step(index, total, what)

    if params.delay:
        time.sleep(params.delay)
    if not params.no_warmup:
        step("warmup run")
        if request(prompts.words(8), 2) is None:
            return None
    samples_ns: list[int] = []
    ttfr, ppt, ttft, sent = [], [], [], []
    for rep in range(params.reps):
        context = ""
        if depth:
            step(f"depth run {rep + 1}/{params.reps}")
            context, _ = prompts.make(depth)
            if request(context, 1) is None:
                return None
            context += " "
        step(f"{'prompt' if n_prompt else 'generation'} run {rep + 1}/{params.reps}")
        body_prompt, n_sent = prompts.make(n_prompt) if n_prompt else (prompts.words(4), None)
        s = request(context + body_prompt, max(n_gen, 1))
        if s is None:
            return None
        est_ppt = max(s.ttfr - latency, 1e-9)
        n_eval = s.server_prompt_n if s.server_prompt_n is not None else (n_sent or n_prompt)
        if n_prompt and not n_gen:
            seconds = est_ppt * n_prompt / max(n_eval, 1)  # time per requested token count
        elif n_gen and not n_prompt:
            n_out = len(s.content_times)
            if n_out < 2:
                warn(f"error: test {index}/{total}: the server streamed {n_out} token(s); tg needs 2 or more")
                return None
            # llama-benchy's decode rate: (n - 1) / (t_last - t_first), scaled to n_gen tokens
            seconds = (s.content_times[-1] - s.content_times[0]) * n_gen / (n_out - 1)
        else:
            seconds = max(s.e2e - latency, 1e-9)
        samples_ns.append(max(1, int(seconds * 1e9)))
        ttfr.append(s.ttfr * 1e3)
        ppt.append(est_ppt * 1e3)
        ttft.append(s.ttft * 1e3)
        sent.append(n_sent or 0)
        if progress:
            progress.advance()
    rec: dict[str, Any] = {
        "build_commit": "unknown",
        "build_number": 0,
        "cpu_info": cpu_info(),
        "gpu_info": "",
        "backends": "HTTP",
        "model_filename": model,
        "model_type": model.replace("\\", "/").rsplit("/", 1)[-1],  # a served path: its file name
        "model_size": 0,
        "model_n_params": 0,
        "n_batch": params.n_batch[0],
        "n_ubatch": params.n_ubatch[0],
        "n_threads": 0,
        **FIXED,
        "type_k": params.type_k[0],
        "type_v": params.type_v[0],
        "n_gpu_layers": 0,
        "flash_attn": False,
        "use_mmap": True,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": depth,
        "test_time": utc_now(),
        "engine_version": "",
        "engine_build": "",
        "n_ctx": 0,
        "recipe": "",
        "engine_args": "",
        "gen_sampled": False,
        "latency_ms": latency * 1e3,
        "ttfr_ms": statistics.fmean(ttfr),
        "est_ppt_ms": statistics.fmean(ppt),
        "e2e_ttft_ms": statistics.fmean(ttft),
        "n_prompt_sent": round(statistics.fmean(sent)),
    }
    return finish(rec, samples_ns)


SERVER_MD_COLUMNS = (
    ("model", -30),
    ("engine", -10),
    ("test", 15),
    ("t/s", 20),
    ("ttfr (ms)", 12),
    ("est_ppt (ms)", 12),
    ("e2e_ttft (ms)", 13),
)


def server_md(records: list[dict[str, Any]]) -> str:
    """llama-benchy's table: model | engine | test | t/s | ttfr | est_ppt | e2e_ttft (means)."""
    from stdengine.bench.printers import md_cell, test_name

    out = ["|" + "".join(md_cell(name, w) for name, w in SERVER_MD_COLUMNS)]
    out.append(
        "|" + "".join(" " + "-" * (abs(w) - 1) + (":" if w > 0 else "-") + " |" for _, w in SERVER_MD_COLUMNS)
    )
    for r in records:
        cells = [
            r["model_type"],
            r["engine"],
            test_name(r["n_prompt"], r["n_gen"], r["n_depth"]),
            f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
            f"{r['ttfr_ms']:.2f}",
            f"{r['est_ppt_ms']:.2f}",
            f"{r['e2e_ttft_ms']:.2f}",
        ]
        out.append("|" + "".join(md_cell(c, w) for c, (_, w) in zip(cells, SERVER_MD_COLUMNS, strict=False)))
    return "\n".join(out) + "\n"


def run_server_cli(params: BenchParams, recipe: str | None = None) -> int:
    from stdengine.bench.printers import make_printer

    if not params.url:
        raise UsageError("server mode needs --url", hint="for example: -e openai --url http://127.0.0.1:8080")
    refused = sorted(params.given - {"url", "api_key", "model"})
    if refused:
        raise UnsupportedOption(
            f"server mode cannot honour {', '.join(refused)}: the server was started with its own settings",
            hint="remove these flags, or set them where the server is started",
            options=refused,
        )
    if params.output_err != "none":
        raise UsageError("server mode writes its results to stdout only (-o); -oe is not supported there")
    if params.concurrency:
        if params.output not in ("md", "json", "jsonl"):
            raise UsageError(f"the load test writes md, json or jsonl, not {params.output}")
        result = run_load_test(params)
        sys.stdout.write(render_load(result, params.output))
        return 0 if result["completed"] else EngineFailure.exit_status
    records: list[dict[str, Any]] = []
    printer = None if params.output == "md" else make_printer(params.output, sys.stdout, params)
    if printer:
        printer.header()

    def on_record(rec: dict[str, Any]) -> None:
        records.append(rec)
        if printer:
            printer.record(rec)

    progress = None
    if params.progress:
        from stdengine.bench.progress import LineProgress

        progress = LineProgress()
    status = run_tests(params, on_record, progress=progress, recipe=recipe)
    if printer:
        printer.footer()
    elif records:
        sys.stdout.write(server_md(records))
    return status
