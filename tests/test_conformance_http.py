"""The HTTP checks that compare a server with the golden data (conformance/http.py): the served
log-probability metric against numpy, `infer serve` passing every HTTP core check, and a
fault-injecting proxy in front of it, one realistic fault at a time, each caught by the check
meant for it (spec/conformance.md, "HTTP checks")."""

from __future__ import annotations

import fnmatch
import json
import math
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from served import ALIAS, KEY, InProcessServer
from stdengine.conformance import metrics
from stdengine.conformance.http import plan_http
from stdengine.conformance.runner import run_suite
from stdengine.conformance.suite import Context, Result, exit_status


# --- the served-logprobs metric ---------------------------------------------------------------
def _position(
    rng: np.random.Generator, n_vocab: int = 60, k: int = 8
) -> tuple[np.ndarray, list, list, float]:
    ref = metrics.log_softmax(rng.normal(size=(1, n_vocab)) * 3)
    ids, lps, tails = metrics.top_k_record(ref, k)
    return ref[0], ids[0], lps[0], tails[0]


def test_kl_by_text_equals_restricted_kl_for_unique_texts_and_complete_lists():
    rng = np.random.default_rng(0)
    pieces = {str(i): f"t{i}" for i in range(60)}
    for _ in range(20):
        _, ids, lps, tail = _position(rng)
        engine = rng.normal(size=(1, 60)) * 3
        lq = metrics.log_softmax(engine)[0]
        want = metrics.restricted_kl([ids], [lps], [tail], engine)[0]
        served = {pieces[str(i)]: float(lq[i]) for i in range(60)}  # every id, keyed by its text
        assert math.isclose(metrics.restricted_kl_by_text(ids, lps, tail, pieces, served), want, rel_tol=1e-9)
        # the reference served against itself: zero (up to the golden data's rounding)
        own = {pieces[str(i)]: lp for i, lp in zip(ids, lps, strict=True)}
        assert abs(metrics.restricted_kl_by_text(ids, lps, tail, pieces, own)) < 1e-5


def test_kl_by_text_buckets_shared_texts_and_floors_missing_ones():
    # ids 1 and 2 share a text: the reference's bucket is their sum, served once
    pieces = {"0": "a", "1": "b", "2": "b", "3": "c"}
    lps = [math.log(0.5), math.log(0.2), math.log(0.1), math.log(0.1)]
    tail = math.log(0.1)
    served = {"a": math.log(0.5), "b": math.log(0.3), "x": math.log(0.05)}  # "c" is missing
    p = {"a": 0.5, "b": 0.3, "c": 0.1}
    q = {"a": 0.5, "b": 0.3, "c": 0.05}  # c: at most the list's smallest, and given exactly that
    q_tail = 1 - sum(q.values())
    want = sum(p[b] * math.log(p[b] / q[b]) for b in p) + 0.1 * math.log(0.1 / q_tail)
    got = metrics.restricted_kl_by_text([0, 1, 2, 3], lps, tail, pieces, served)
    assert math.isclose(got, want, rel_tol=1e-12)
    # an extra entry beyond the top k (the chosen token some servers add) is not the floor
    extra = {**served, "y": math.log(1e-6)}
    assert math.isclose(metrics.restricted_kl_by_text([0, 1, 2, 3], lps, tail, pieces, extra, k=3), want)
    assert metrics.restricted_kl_by_text([0, 1, 2, 3], lps, tail, pieces, extra) > want


# --- `infer serve` in process, and a fault-injecting proxy in front of it ------------------------
def _noise(rng: random.Random, lp: Any) -> Any:
    return lp + rng.gauss(0.0, 0.3) if isinstance(lp, (int, float)) else lp


def fault_response(fault: str, obj: dict[str, Any], streamed: bool, rng: random.Random) -> None:
    """One realistic fault, applied in place to a response body or a stream chunk."""
    usage = obj.get("usage")
    if isinstance(usage, dict) and fault == "completion_tokens_zero":
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage["prompt_tokens"]  # consistent: only the count is wrong
    if isinstance(usage, dict) and fault == "prompt_tokens_off_by_one":
        usage["prompt_tokens"] += 1
        usage["total_tokens"] += 1
    for ch in obj.get("choices") or []:
        if fault == "finish_always_stop" and ch.get("finish_reason"):
            ch["finish_reason"] = "stop"
        holder, key = (ch["message"], "content") if "message" in ch else (ch, "text")
        text = holder.get(key)
        if isinstance(text, str) and not streamed:
            if fault == "eog_text_appended":
                holder[key] = text + "<|im_end|>"
            first = next((i for i, c in enumerate(text) if ord(c) > 127), None)
            if fault == "byte_token_fffd" and first is not None:
                # a multi-byte character whose token's bytes were decoded alone
                holder[key] = text[:first] + "\ufffd" + text[first + 1 :]
        lp = ch.get("logprobs")
        if fault == "logprobs_noise" and isinstance(lp, dict):
            for entry in lp.get("content") or []:  # chat
                entry["logprob"] = _noise(rng, entry["logprob"])
                for top in entry.get("top_logprobs") or []:
                    top["logprob"] = _noise(rng, top["logprob"])
            lp["token_logprobs"] = [_noise(rng, x) for x in lp.get("token_logprobs") or []]
            lp["top_logprobs"] = [
                {t: _noise(rng, v) for t, v in d.items()} if isinstance(d, dict) else d
                for d in lp.get("top_logprobs") or []
            ]


def fault_request(fault: str, body: dict[str, Any]) -> None:
    if fault == "temperature_one" and "temperature" in body:
        body["temperature"] = 1.0
        body["seed"] = 1
    if fault == "stop_dropped":
        body.pop("stop", None)
    if fault == "top_p_dropped":
        body.pop("top_p", None)
    if fault == "seed_dropped":
        body.pop("seed", None)
    if fault == "seed_fixed" and "seed" in body:
        body["seed"] = 42


class FaultProxy(ThreadingHTTPServer):
    """Forwards every request to the server, with `fault` (None: none) injected on the way."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream
        self.fault: str | None = None
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ProxyHandler(BaseHTTPRequestHandler):
    server: FaultProxy

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _forward(self, raw: bytes | None) -> None:
        fault = self.server.fault or ""
        rng = random.Random(0)
        if raw:
            try:
                body = json.loads(raw)
                fault_request(fault, body)
                raw = json.dumps(body).encode()
            except ValueError:
                pass  # malformed JSON goes through as it is
            else:
                if fault == "no_logprobs" and ("logprobs" in body or "echo" in body):
                    # a server without log-probabilities, refusing them as OpenAI refuses an
                    # unknown argument
                    err = {"error": {"message": "logprobs: not supported", "type": "invalid_request_error"}}
                    out = json.dumps(err).encode()
                    self.send_response(400)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
        req = urllib.request.Request(self.server.upstream + self.path, raw, headers, method=self.command)
        try:
            r = urllib.request.urlopen(req, timeout=120)
        except urllib.error.HTTPError as e:
            r = e
        with r:
            ctype = r.headers.get("Content-Type", "")
            self.send_response(r.status)
            self.send_header("Content-Type", ctype)
            if "text/event-stream" not in ctype:
                out = r.read()
                if ctype.startswith("application/json") and r.status == 200:
                    obj = json.loads(out)
                    fault_response(fault, obj, False, rng)
                    out = json.dumps(obj).encode()
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            held: list[bytes] = []
            for line in iter(r.readline, b""):
                if line.startswith(b"data: {"):
                    obj = json.loads(line[6:])
                    fault_response(fault, obj, True, rng)
                    line = b"data: " + json.dumps(obj).encode() + b"\n"
                if fault in ("buffered_stream", "merged_chunks"):
                    held.append(line)  # all sent at the end
                else:
                    self.wfile.write(line)
                    self.wfile.flush()
            if fault == "merged_chunks":
                held = _merge_content_chunks(held)
            self.wfile.write(b"".join(held))


def _merge_content_chunks(lines: list[bytes]) -> list[bytes]:
    """A stream whose content chunks are merged into the first (the rest kept as they were)."""
    out: list[bytes] = []
    first: dict[str, Any] | None = None
    for line in lines:
        if line.startswith(b"data: {"):
            obj = json.loads(line[6:])
            ch = (obj.get("choices") or [{}])[0]
            holder, key = (ch.get("delta") or {}, "content") if "delta" in ch else (ch, "text")
            if holder.get(key) and not ch.get("finish_reason"):
                if first is None:
                    first = obj
                    out.append(b"")  # its place
                    at = len(out) - 1
                else:
                    fch = first["choices"][0]
                    fholder = fch["delta"] if "delta" in fch else fch
                    fholder[key] += holder[key]
                continue
        out.append(line)
    if first is not None:
        out[at] = b"data: " + json.dumps(first).encode() + b"\n\n"
    return out


@pytest.fixture(scope="module")
def golden(smollm2_golden: dict[str, Any]) -> dict[str, Any]:
    return smollm2_golden


@pytest.fixture(scope="module")
def reference_server(smollm2_path: Path) -> Iterator[InProcessServer]:
    server = InProcessServer("reference", smollm2_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(reference_server: InProcessServer) -> Iterator[FaultProxy]:
    p = FaultProxy(reference_server.url)
    yield p
    p.shutdown()


def http_suite(url: str, golden: dict[str, Any], only: str | None = None) -> list[Result]:
    ctx = Context(url=url, api_key=KEY, golden=golden, golden_note="test", model=ALIAS)
    return run_suite(ctx, level="core", only=only or "http.*")


def assert_all_pass(results: list[Result], golden: dict[str, Any]) -> None:
    planned = [c.id for c in plan_http(Context(url="x", golden=golden)) if c.level == "core"]
    assert [r.id for r in results] == planned
    bad = [f"{r.id}: {r.status}: {r.message}" for r in results if r.status != "pass"]
    assert not bad, "\n".join(bad)
    assert exit_status(results) == 0


def test_infer_serve_passes_every_http_core_check(reference_server: InProcessServer, golden: dict[str, Any]):
    assert_all_pass(http_suite(reference_server.url, golden), golden)


def test_a_proxy_without_a_fault_passes(proxy: FaultProxy, golden: dict[str, Any]):
    """The proxy itself is transparent: the checks the faults are meant for all pass through it."""
    proxy.fault = None
    results = [
        r
        for pattern in ("http.stream.*", "http.stop", "http.max_tokens*")
        for r in http_suite(proxy.url, golden, pattern)
    ]
    assert all(r.status == "pass" for r in results), [
        (r.id, r.message) for r in results if r.status != "pass"
    ]


def _cases(golden: dict[str, Any]) -> dict[str, str]:
    """Check IDs of the golden cases the faults are judged on: the first raw case (the completion
    checks' prompt), the first chat case, and the raw case whose text has multi-byte characters."""
    cases = golden["generation"]["cases"]
    raw = next(c["name"] for c in cases if c["kind"] == "raw")
    chat = next(c["name"] for c in cases if c["kind"] == "chat")
    wide = next(c["name"] for c in cases if c["kind"] == "raw" and any(ord(ch) > 127 for ch in c["text"]))
    return {k: f"http.generation.golden:case={v}" for k, v in (("raw", raw), ("chat", chat), ("wide", wide))}


# fault -> the checks that must fail (keys of _cases, or check IDs), and words of their messages
FAULT_CHECKS: dict[str, tuple[list[str], str]] = {
    "completion_tokens_zero": (["raw", "chat", "http.max_tokens:n=5"], "completion_tokens"),
    "prompt_tokens_off_by_one": (["raw", "chat"], "prompt_tokens"),
    "finish_always_stop": (["raw", "chat", "http.max_tokens:n=5"], "finish_reason 'stop'"),
    # at temperature 1 (with a fixed seed, so that the outcome is the same every run) a golden
    # continuation may still come out greedy: every step wins by >= 1 nat. Not all of them.
    "temperature_one": (["http.generation.golden:*", "http.temperature0.repeat"], "differs at character"),
    "stop_dropped": (["http.stop"], "the text before the stop string"),
    "buffered_stream": (["http.stream.incremental"], "a buffered stream?"),
    "merged_chunks": (["http.stream.incremental"], "content chunks"),
    "eog_text_appended": (["raw", "chat"], "no end-of-generation token text"),
    "byte_token_fffd": (["wide"], "differs at character"),
    "logprobs_noise": (["http.logprobs.kl:text=all", "http.logprobs.chat"], "NOT MET"),
    "top_p_dropped": (["http.sampler:top_p=0.01"], "differs at character"),
    "seed_dropped": (["http.seed"], "seed 1234 gave"),
    "seed_fixed": (["http.seed"], "do not all give"),
}


@pytest.mark.parametrize("fault", list(FAULT_CHECKS))
def test_each_fault_fails_its_checks(fault: str, proxy: FaultProxy, golden: dict[str, Any]):
    keys, words = FAULT_CHECKS[fault]
    ids = [_cases(golden).get(k, k) for k in keys]
    proxy.fault = fault
    try:
        runs = [http_suite(proxy.url, golden, i) for i in ids]
    finally:
        proxy.fault = None
    assert all(
        run and all(fnmatch.fnmatchcase(r.id, i) for r in run) for run, i in zip(runs, ids, strict=True)
    )
    results = [r for run in runs for r in run]
    wrong = [
        f"{r.id}: {r.status}: {r.message}" for r in results if r.status != "fail" or words not in r.message
    ]
    if fault == "temperature_one":
        assert len(wrong) < len(results), "\n".join(wrong)
    else:
        assert not wrong, "\n".join(wrong)
    assert exit_status(results) == 1


def test_a_server_without_logprobs_is_not_supported_there(proxy: FaultProxy, golden: dict[str, Any]):
    proxy.fault = "no_logprobs"
    try:
        results = http_suite(proxy.url, golden, "http.logprobs.*")
    finally:
        proxy.fault = None
    assert {r.id for r in results} == {"http.logprobs.chat"} | {
        f"http.logprobs.kl:text={t}" for t in [t["name"] for t in golden["logits"]["texts"]] + ["all"]
    }
    assert all(r.status == "not_supported" and "HTTP 400" in r.message for r in results), results
    assert exit_status(results) == 0


@pytest.mark.llamacpp
def test_infer_serve_with_llamacpp_passes_every_http_core_check(smollm2_path: Path, golden: dict[str, Any]):
    server = InProcessServer("llamacpp", smollm2_path)
    try:
        assert_all_pass(http_suite(server.url, golden), golden)
    finally:
        server.stop()
