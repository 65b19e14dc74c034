"""infer-bench's server mode against llama-cpp-python's OpenAI-compatible server on loopback,
and the load-test metrics' formulas on hand-made streams."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from stdengine.bench.server import Stream, load_metrics, percentile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(smollm2_path, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    httpx = pytest.importorskip("httpx")
    for mod in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
        pytest.importorskip(mod, reason=f"llama-cpp-python[server] is not installed ({mod} missing)")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "llama_cpp_server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally; a pipe would fill and block the server
    # interrupt_requests False: let concurrent streams finish instead of cutting the older one short
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(smollm2_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "1024",
            "--interrupt_requests",
            "False",
            "--n_threads",
            "2",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail(f"llama_cpp.server did not start within 90 s: {log_path.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stdengine.cli.bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_llama_bench_tests_over_http(server_url):
    r = bench(
        "-e", "openai", "--url", server_url, "-p", "16", "-n", "4", "-d", "0,16", "-r", "2", "-o", "jsonl"
    )
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["n_prompt"], x["n_gen"], x["n_depth"]) for x in recs] == [
        (16, 0, 0),
        (0, 4, 0),
        (16, 0, 16),
        (0, 4, 16),
    ]
    for x in recs:
        assert x["engine"] == "openai" and x["url"] == server_url and x["backends"] == "HTTP"
        assert len(x["samples_ns"]) == 2 and x["avg_ts"] > 0
        assert 0 < x["est_ppt_ms"] <= x["ttfr_ms"] and x["e2e_ttft_ms"] >= x["ttfr_ms"]
    # the prompt was sized with the server's own tokenizer (/extras/tokenize)
    assert abs(recs[0]["n_prompt_sent"] - 16) <= 2
    md = bench("-e", "openai", "--url", server_url, "-p", "8", "-n", "0", "-r", "1")
    assert md.returncode == 0, md.stderr
    head = md.stdout.splitlines()[0]
    assert head.startswith("| model ") and "ttfr (ms) |" in head and "e2e_ttft (ms) |" in head


def test_load_test(server_url):
    r = bench(
        "-e",
        "openai",
        "--url",
        server_url + "/v1",
        "-p",
        "16",
        "-n",
        "4",
        "--concurrency",
        "2",
        "--requests",
        "4",
        "-o",
        "json",
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["requests"] == 4 and res["completed"] == 4 and res["errors"] == 0 and res["short"] == 0
    assert res["total_output_tokens"] == 16 and res["concurrency"] == 2
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(res[key]) == {"mean", "median", "p90", "p99"} and res[key]["mean"] > 0
    assert res["ttft_ms"]["mean"] <= res["e2el_ms"]["mean"]
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0
    md = bench(
        "-e", "openai", "--url", server_url, "-p", "8", "-n", "2", "--concurrency", "1", "--requests", "2"
    )
    assert md.returncode == 0, md.stderr
    assert "| TTFT (ms)        |" in md.stdout and "errors 0" in md.stdout
    assert re.search(r"client CPU \d+\.\d\d s \(\d+\.\d{3} ms a generated token\)", md.stdout)


def test_unreachable_server_is_a_clear_error():
    port = _free_port()
    r = bench("-e", "openai", "--url", f"http://127.0.0.1:{port}", "-p", "8", "-n", "2", "-r", "1")
    assert r.returncode == 6
    assert "cannot reach" in r.stderr and "hint:" in r.stderr and r.stdout == ""


def test_server_settings_are_refused_not_ignored():
    r = bench("-e", "openai", "--url", "http://127.0.0.1:9", "-t", "4", "-fa", "1", "-p", "8")
    assert r.returncode == 2
    assert "server mode cannot honour flash_attn, threads" in r.stderr and r.stdout == ""


def test_load_metrics_formulas():
    # request a: start 0, first content 0.5, tokens at 0.5, 0.7, 1.0, end 1.1 (3 tokens)
    # request b: start 0.2, first content 0.4, one token, end 0.5; request c failed
    a = Stream(t_start=0.0, t_first_chunk=0.45, t_end=1.1, content_times=[0.5, 0.7, 1.0])
    b = Stream(t_start=0.2, t_first_chunk=0.4, t_end=0.5, content_times=[0.4])
    c = Stream(t_start=0.3, t_end=0.31, error="HTTP 500: boom")
    m = load_metrics([a, b, c], [10, 20, 30], duration=2.0, n_gen=3)
    assert m["completed"] == 2 and m["errors"] == 1 and m["short"] == 1
    assert m["ttft_ms"]["mean"] == pytest.approx((500 + 200) / 2)  # first content token - start
    assert m["e2el_ms"]["median"] == pytest.approx((1100 + 300) / 2)
    assert m["tpot_ms"]["mean"] == pytest.approx((1100 - 500) / 2)  # (e2e - ttft) / (n - 1); b has n = 1
    assert m["itl_ms"]["mean"] == pytest.approx((200 + 300) / 2)  # gaps between content tokens, pooled
    assert m["request_throughput"] == pytest.approx(1.0)  # completed / duration
    assert m["output_throughput"] == pytest.approx(2.0)  # (3 + 1) / 2 s
    assert m["total_token_throughput"] == pytest.approx((10 + 20 + 4) / 2)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert math.isnan(load_metrics([c], [1], 1.0, 1)["ttft_ms"]["mean"])


# --- the load mode against infer serve ------------------------------------------------------------


@pytest.fixture(scope="module")
def infer_serve(smollm2_path, tmp_path_factory):
    """`infer serve` on SmolLM2 (reference engine), two sequences in flight."""
    from test_server_toy import Server

    s = Server(
        ["-e", "reference", "-m", str(smollm2_path), "-np", "2", "-c", "512", "-t", "2"],
        tmp_path_factory.mktemp("serve"),
    )
    yield s
    assert s.stop() == 0


def test_load_test_against_infer_serve(infer_serve):
    load = "-p 16 -n 8 --concurrency 2 --requests 4 -o json"
    r = bench("-e", "openai", "--url", infer_serve.url, *load.split())
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    # min_tokens / ignore_eos are honoured: every answer has exactly -n tokens
    assert res["completed"] == 4 and res["errors"] == 0 and res["short"] == 0 and res["extensions"]
    assert res["total_output_tokens"] == 32
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0 and res["ttft_ms"]["median"] > 0
    # the client's own CPU while the requests ran: some, and less than the run's wall time
    assert 0 < res["client_cpu_s"] < res["duration_s"]


def test_ignore_eos_and_min_tokens(infer_serve):
    import httpx

    def ask(**extra):
        body = {
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 60,
            "temperature": 0,
            **extra,
        }
        r = httpx.post(infer_serve.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]

    finish, n = ask()
    assert finish == "stop" and n < 40  # the model's own answer ends early (an end-of-turn token)
    assert ask(ignore_eos=True) == ("length", 60)
    assert ask(min_tokens=n + 10)[1] >= n + 10
    assert ask(min_tokens=0) == ("stop", n)
    r = httpx.post(infer_serve.url + "/v1/completions", json={"prompt": "a", "min_tokens": -1}, timeout=30)
    assert r.status_code == 400 and "min_tokens" in r.text


def test_load_test_says_which_extensions_a_server_refuses(tmp_path):
    from test_server_toy import toy_server

    s = toy_server(tmp_path)  # the toy engine cannot honour min_tokens / ignore_eos: a 400 naming them
    try:
        args = ("-e", "openai", "--url", s.url, "-p", "4", "-n", "2", "--concurrency", "1", "--requests", "2")
        r = bench(*args)
        assert r.returncode != 0 and r.stdout == ""
        assert "refused the benchmark's extension field(s) min_tokens, ignore_eos" in r.stderr
        assert "--no-extensions" in r.stderr
        r = bench(*args, "--no-extensions", "-o", "json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["errors"] == 0 and res["completed"] == 2 and not res["extensions"]
    finally:
        assert s.stop() == 0
