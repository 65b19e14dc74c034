"""The HTTP load test (`-e openai --url URL --concurrency N --requests M`): M streamed completions
of -p prompt tokens and -n output tokens, at most N in flight, reporting TTFT, TPOT, ITL and
end-to-end latency (mean, median, p90, p99), request and token throughput and the error count.
spec/bench-record.md defines every metric by a formula.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Iterable
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
from stdengine.bench.http_stream import LeanClient
from stdengine.bench.params import BenchParams
from stdengine.bench.record import cpu_info, utc_now

from stdengine.errors import UsageError


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
    params: BenchParams, target: Target, model: str, prompts: list[tuple[str, int]], n_gen: int
) -> tuple[list[Stream], float]:
    sem = asyncio.Semaphore(params.concurrency)
    streams: list[Stream] = [Stream(t_start=math.nan) for _ in prompts]

    async def one(client: LeanClient, i: int, prompt: str) -> None:
        async with sem:
            s = streams[i]
            s.t_start = time.perf_counter()
            body = completion_body(model, prompt, n_gen, not params.no_extensions)
            try:
                async with client.post("/completions", body) as r:
                    if r.status != 200:
                        s.refused(r.status, await r.read())
                    else:
                        async for text in r.text():
                            if s.feed(text, time.perf_counter()):
                                break
            except Exception as e:
                s.error = f"{type(e).__name__}: {e}"
            s.finish(time.perf_counter())

    client = LeanClient(target.api, target.headers)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(client, i, p) for i, (p, _) in enumerate(prompts)))
    return streams, time.perf_counter() - t0


def run_load_test(params: BenchParams) -> dict[str, Any]:
    target = Target.of(params)
    n_prompt, n_gen = params.n_prompt[0], params.n_gen[0]
    if n_gen < 1:
        raise UsageError("the load test needs -n >= 1 output tokens per request")
    with target.client() as client:
        measure_latency(client, target.api, tries=1)
        model = served_model(client, target.api, params)
        maker = Prompts(client, target.root, model)
        prompts = []
        for _ in range(params.requests):
            text, n = maker.make(max(n_prompt, 1))
            prompts.append((text, n if n is not None else n_prompt))
        # the warm-up (a one-token probe with --no-warmup) also finds a server that refuses the
        # extension fields, before the load runs every request into the same 400
        probe = completion_body(model, maker.words(8), 1 if params.no_warmup else 2, not params.no_extensions)
        check_extensions(stream_completion(client, target.api, probe))
    cpu0 = time.process_time()
    streams, duration = asyncio.run(_load(params, target, model, prompts, n_gen))
    client_cpu_s = time.process_time() - cpu0  # what the client took from the machine it measures
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
        "extensions": not params.no_extensions,
        **metrics,
        "client_cpu_s": client_cpu_s,
    }


def client_ms_per_token(result: dict[str, Any]) -> float:
    """The load client's CPU per generated token (ms); 0 for results from before it was recorded."""
    n = result.get("total_output_tokens", 0)
    return 1000 * result.get("client_cpu_s", 0.0) / n if n else 0.0


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
        f"pp{result['n_prompt']} tg{result['n_gen']} each, {result['model']} at {result['url']} ({result['engine']})"
        + ("" if result.get("extensions", True) else ", plain requests (--no-extensions)"),
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
        f"client CPU {result['client_cpu_s']:.2f} s ({client_ms_per_token(result):.3f} ms a generated token)",
    ]
    return "\n".join(lines) + "\n"
