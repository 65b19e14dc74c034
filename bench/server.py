"""Server mode: benchmarking an OpenAI-compatible server (`-e openai --url URL`) over HTTP.

Two measurements, both through streaming `/v1/completions` requests sent only to --url:

* llama-bench's tests (pp, tg, pp+tg at each depth), measured llama-benchy's way: a fresh random
  prompt per request (so that no prompt cache can answer it), the depth sent first as its own
  untimed request so that a server with a prompt cache holds it, then the timed request.
* a load test (`--concurrency N --requests M`): M requests of -p prompt tokens and -n output tokens,
  at most N in flight, reporting TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99),
  request and token throughput and the error count.

spec/bench-record.md defines every metric by a formula.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from stdengine.bench.params import BenchParams
from stdengine.bench.record import FIXED, cpu_info, finish, utc_now

from stdengine.errors import EngineFailure, EngineUnavailable, UnsupportedOption, UsageError

# Plain English words; prompts are random sequences of them, fresh for every request.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death experience effect "
    "class control care field development role effort rate heart drug show leader light voice wife police "
    "mind price report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official matter "
    "center couple site project activity star table need court oil situation cost industry figure street "
    "image phone data picture practice piece land product doctor wall patient worker news test movie north "
    "love support technology step baby computer type attention film tree source organization hair window "
    "evidence population truth song river garden stone bread cloud summer winter apple table bridge"
).split()


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as e:
        raise EngineUnavailable(
            "server mode needs httpx", hint="pip install httpx (or 'stdengine[dev]')"
        ) from e
    return httpx


def api_base(url: str) -> tuple[str, str]:
    """--url -> (the server's root, its OpenAI API base ending in /v1)."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url must be an http:// or https:// URL, got {url!r}")
    if url.endswith("/v1"):
        return url[:-3], url
    return url, url + "/v1"


@dataclass
class Stream:
    """What one streamed completion looked like from the client."""

    t_start: float
    t_first_chunk: float | None = None
    t_end: float | None = None
    content_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None  # from usage, when the server sends it
    completion_tokens: int | None = None
    server_prompt_n: int | None = None  # llama-server's timings.prompt_n: prompt tokens it evaluated
    error: str | None = None

    @property
    def n_out(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.content_times)

    @property
    def ttfr(self) -> float:
        return (self.t_first_chunk or math.nan) - self.t_start

    @property
    def ttft(self) -> float:
        return (self.content_times[0] if self.content_times else math.nan) - self.t_start

    @property
    def e2e(self) -> float:
        return (self.t_end or math.nan) - self.t_start


def _absorb(s: Stream, payload: str, now: float) -> None:
    if s.t_first_chunk is None:
        s.t_first_chunk = now
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        s.error = f"malformed stream chunk: {payload[:80]!r}"
        return
    if isinstance(obj, dict) and "error" in obj:
        s.error = str(obj["error"])[:200]
        return
    for choice in obj.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            s.content_times.append(now)
            s.text += text
    usage = obj.get("usage")
    if isinstance(usage, dict):
        s.prompt_tokens = usage.get("prompt_tokens", s.prompt_tokens)
        s.completion_tokens = usage.get("completion_tokens", s.completion_tokens)
    timings = obj.get("timings")
    if isinstance(timings, dict) and "prompt_n" in timings:
        s.server_prompt_n = int(timings["prompt_n"])


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed completion that generates exactly max_tokens tokens where the server allows it
    (min_tokens: llama-cpp-python, vLLM; ignore_eos: llama-server, vLLM), greedily."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_completion(
    client: Any,
    api: str,
    body: dict[str, Any],
    clock: Callable[[], float] = time.perf_counter,
) -> Stream:
    s = Stream(t_start=clock())
    try:
        with client.stream("POST", f"{api}/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {r.read().decode('utf-8', 'replace')[:200]}"
                return s
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                _absorb(s, payload, clock())
    except Exception as e:  # a refused connection, a timeout, a dropped stream: an error, counted
        s.error = f"{type(e).__name__}: {e}"
    s.t_end = clock()
    if s.error is None and not s.content_times and s.n_out == 0:
        s.error = "the stream carried no content"
    return s


class Prompts:
    """Random word prompts of about n tokens, counted with the server's tokenizer when it has a
    tokenize endpoint (llama-server /tokenize, llama-cpp-python /extras/tokenize)."""

    def __init__(self, client: Any, root: str, rng: random.Random | None = None) -> None:
        self.client = client
        self.root = root
        self.rng = rng or random.Random()
        self.endpoint: tuple[str, str] | None = None
        for path, key in (("/tokenize", "content"), ("/extras/tokenize", "input")):
            try:
                r = client.post(root + path, json={key: "hello world", "add_special": True})
                if r.status_code == 200 and isinstance(r.json().get("tokens"), list):
                    self.endpoint = (path, key)
                    break
            except Exception:
                continue
        self.tokens_per_word = 1.0
        if self.endpoint is not None:
            sample = self.words(200)
            n = self.count(sample)
            if n:
                self.tokens_per_word = max(0.2, n / 200)

    def words(self, k: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, k)))

    def count(self, text: str) -> int | None:
        if self.endpoint is None:
            return None
        path, key = self.endpoint
        r = self.client.post(self.root + path, json={key: text, "add_special": True})
        return len(r.json()["tokens"]) if r.status_code == 200 else None

    def make(self, n_tokens: int) -> tuple[str, int | None]:
        """A fresh prompt of about n_tokens tokens, and its exact count when the server can tell."""
        k = max(1, round(n_tokens / self.tokens_per_word))
        text = self.words(k)
        n = self.count(text)
        for _ in range(4):  # adjust to the server's own count
            if n is None or n == n_tokens:
                break
            k = max(1, k + (round((n_tokens - n) / self.tokens_per_word) or (1 if n < n_tokens else -1)))
            text = self.words(k)
            n = self.count(text)
        return text, n


def measure_latency(client: Any, api: str, tries: int = 3) -> float:
    """llama-benchy's `api` latency: the time to the response headers of GET /v1/models (median)."""
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        try:
            r = client.get(f"{api}/models")
        except Exception as e:
            raise EngineUnavailable(
                f"cannot reach {api}/models: {type(e).__name__}: {e}", hint="start the server, or fix --url"
            ) from e
        times.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise EngineUnavailable(
                f"{api}/models answered HTTP {r.status_code}", hint="is --url an OpenAI-compatible server?"
            )
    return statistics.median(times)


def served_model(client: Any, api: str, params: BenchParams) -> str:
    if "model" in params.given:
        return params.models[0]
    data = client.get(f"{api}/models").json().get("data") or []
    if not data:
        raise EngineFailure(f"{api}/models lists no model", hint="name one with -m")
    return str(data[0].get("id"))


# --- llama-bench's tests over HTTP -------------------------------------------------------------


def run_tests(
    params: BenchParams,
    on_record: Callable[[dict[str, Any]], None],
    warn: Callable[[str], None] | None = None,
    progress: Any = None,
) -> int:
    httpx = _httpx()
    assert params.url
    root, api = api_base(params.url)
    warn = warn or (lambda m: print(m, file=sys.stderr, flush=True))
    headers = {"Authorization": f"Bearer {params.api_key}"} if params.api_key else {}
    engine = params.engines[0] if params.engines else "openai"
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), headers=headers) as client:
        latency = measure_latency(client, api)
        model = served_model(client, api, params)
        prompts = Prompts(client, root)
        if prompts.endpoint is None:
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
                )
                if rec is None:
                    return EngineFailure.exit_status
                rec.update(engine=engine, url=params.url)
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
) -> dict[str, Any] | None:
    def request(prompt: str, max_tokens: int) -> Stream | None:
        s = stream_completion(client, api, completion_body(model, prompt, max_tokens))
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
        "latency_ms": latency * 1e3,
        "ttfr_ms": statistics.fmean(ttfr),
        "est_ppt_ms": statistics.fmean(ppt),
        "e2e_ttft_ms": statistics.fmean(ttft),
        "n_prompt_sent": round(statistics.fmean(sent)),
    }
    return finish(rec, samples_ns)


# --- the load test -------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: Iterable[float]) -> dict[str, float]:
    v = [x for x in xs if not math.isnan(x)]
    if not v:
        return {"mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan}
    return {
        "mean": statistics.fmean(v),
        "median": statistics.median(v),
        "p90": percentile(v, 90),
        "p99": percentile(v, 99),
    }


def load_metrics(
    streams: list[Stream], prompt_tokens: list[int], duration: float, n_gen: int
) -> dict[str, Any]:
    """The load test's metrics from the requests' streams (times in seconds; results in ms)."""
    ok = [s for s in streams if s.error is None]
    ttft = [s.ttft * 1e3 for s in ok]
    e2e = [s.e2e * 1e3 for s in ok]
    tpot = [(s.e2e - s.ttft) * 1e3 / (s.n_out - 1) for s in ok if s.n_out > 1]
    itl = [(b - a) * 1e3 for s in ok for a, b in zip(s.content_times, s.content_times[1:], strict=False)]
    out_tokens = sum(s.n_out for s in ok)
    in_tokens = sum(n for s, n in zip(streams, prompt_tokens, strict=False) if s.error is None)
    return {
        "requests": len(streams),
        "completed": len(ok),
        "errors": len(streams) - len(ok),
        "short": sum(1 for s in ok if s.n_out < n_gen),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": out_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else math.nan,
        "ttft_ms": summary(ttft),
        "tpot_ms": summary(tpot),
        "itl_ms": summary(itl),
        "e2el_ms": summary(e2e),
        "error_messages": sorted({s.error for s in streams if s.error})[:5],
    }


async def _load(
    params: BenchParams,
    api: str,
    model: str,
    prompts: list[tuple[str, int]],
    n_gen: int,
    headers: dict[str, str],
) -> tuple[list[Stream], float]:
    httpx = _httpx()
    sem = asyncio.Semaphore(params.concurrency)
    streams: list[Stream] = [Stream(t_start=math.nan) for _ in prompts]
    limits = httpx.Limits(max_connections=params.concurrency + 2)

    async def one(client: Any, i: int, prompt: str) -> None:
        async with sem:
            s = streams[i]
            s.t_start = time.perf_counter()
            try:
                async with client.stream(
                    "POST", f"{api}/completions", json=completion_body(model, prompt, n_gen)
                ) as r:
                    if r.status_code != 200:
                        s.error = (
                            f"HTTP {r.status_code}: {(await r.aread()).decode('utf-8', 'replace')[:200]}"
                        )
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == "[DONE]":
                                break
                            _absorb(s, payload, time.perf_counter())
            except Exception as e:
                s.error = f"{type(e).__name__}: {e}"
            s.t_end = time.perf_counter()
            if s.error is None and not s.content_times:
                s.error = "the stream carried no content"

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0, connect=10.0), headers=headers, limits=limits
    ) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i, p) for i, (p, _) in enumerate(prompts)))
        duration = time.perf_counter() - t0
    return streams, duration


def run_load_test(params: BenchParams) -> dict[str, Any]:
    httpx = _httpx()
    assert params.url
    root, api = api_base(params.url)
    headers = {"Authorization": f"Bearer {params.api_key}"} if params.api_key else {}
    n_prompt, n_gen = params.n_prompt[0], params.n_gen[0]
    if n_gen < 1:
        raise UsageError("the load test needs -n >= 1 output tokens per request")
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), headers=headers) as client:
        measure_latency(client, api, tries=1)
        model = served_model(client, api, params)
        maker = Prompts(client, root)
        prompts = []
        for _ in range(params.requests):
            text, n = maker.make(max(n_prompt, 1))
            prompts.append((text, n if n is not None else n_prompt))
        if not params.no_warmup:
            stream_completion(client, api, completion_body(model, maker.words(8), 2))
    streams, duration = asyncio.run(_load(params, api, model, prompts, n_gen, headers))
    metrics = load_metrics(streams, [n for _, n in prompts], duration, n_gen)
    return {
        "engine": params.engines[0] if params.engines else "openai",
        "url": params.url,
        "model": model,
        "cpu_info": cpu_info(),
        "test_time": utc_now(),
        "concurrency": params.concurrency,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        **metrics,
    }


LOAD_ROWS = (
    ("TTFT (ms)", "ttft_ms"),
    ("TPOT (ms)", "tpot_ms"),
    ("ITL (ms)", "itl_ms"),
    ("E2E latency (ms)", "e2el_ms"),
)


def render_load(result: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2) + "\n"
    if fmt == "jsonl":
        return json.dumps(result) + "\n"
    lines = [
        f"load test: {result['requests']} requests, concurrency {result['concurrency']}, "
        f"pp{result['n_prompt']} tg{result['n_gen']} each, {result['model']} at {result['url']} ({result['engine']})",
        "",
        "| metric           |       mean |     median |        p90 |        p99 |",
        "| ---------------- | ---------: | ---------: | ---------: | ---------: |",
    ]
    for label, key in LOAD_ROWS:
        s = result[key]
        lines.append(
            f"| {label:<16} | {s['mean']:10.2f} | {s['median']:10.2f} | {s['p90']:10.2f} | {s['p99']:10.2f} |"
        )
    lines += [
        "",
        f"completed {result['completed']} ({result['short']} with fewer than {result['n_gen']} tokens), "
        f"errors {result['errors']}, duration {result['duration_s']:.2f} s",
        f"request throughput {result['request_throughput']:.3f} req/s, output throughput "
        f"{result['output_throughput']:.2f} tok/s, total token throughput {result['total_token_throughput']:.2f} tok/s",
    ]
    return "\n".join(lines) + "\n"


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


def run_server_cli(params: BenchParams) -> int:
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
    status = run_tests(params, on_record, progress=progress)
    if printer:
        printer.footer()
    elif records:
        sys.stdout.write(server_md(records))
    return status
