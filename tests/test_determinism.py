"""The reference engine's determinism contract (spec/reference-engine.md), on the real models.

For one model file and one ISA, decode() logits are bit-identical whatever the thread count, the
split of a sequence into decode() calls and ubatches, a reused prompt prefix, and from run to run.
Every comparison here is of bytes, never within a tolerance, under every ISA this CPU can run
(switched in-process exactly as INFER_REF_ISA would choose it at start-up).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from isa import using_isa
from stdengine.reference.core import Context
from stdengine.reference.model import Model

pytestmark = pytest.mark.models

ISAS = ["scalar", "avx2", "avx512", "amx"]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model(request, smollm2_path, gemma3_path):
    path = smollm2_path if request.param == "smollm2" else gemma3_path
    with Model.load(path) as m:
        yield m


def _tokens(model: Model, n: int) -> list[int]:
    rng = np.random.default_rng(1234)
    return [int(t) for t in rng.integers(100, min(model.n_vocab, 30000), n)]


def _logits(
    model, tokens, *, threads=2, ubatch=512, pieces=None, reuse_prefix=None, cache="f32"
) -> np.ndarray:
    """Every position's logits of one pass over tokens, done as the arguments say: decode() calls
    of the given sizes (pieces), or the whole sequence first, then truncated to reuse_prefix cached
    tokens and the rest decoded again (only the rest is returned then); the KV cache f32 or f16."""
    kw = dict(n_batch=max(ubatch, 64), n_ubatch=ubatch, cache_type_k=cache, cache_type_v=cache)
    with Context(model, n_ctx=1024, n_threads=threads, **kw) as ctx:
        start = 0
        if reuse_prefix is not None:
            ctx.decode(tokens)  # only the cache is kept: no logits rows (the output head is slow on scalar)
            ctx.truncate(reuse_prefix)
            start = reuse_prefix
        rows, i = [], start
        pieces = [*(pieces or []), len(tokens) - start - sum(pieces or [])]  # the rest in one last call
        for n in pieces:
            rows.append(ctx.decode(tokens[i : i + n], all_logits=True))
            i += n
        assert i == len(tokens)
        return np.concatenate(rows)


def _same_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape
    if got.tobytes() != want.tobytes():
        bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
        worst = float(np.abs(got.astype(np.float64) - want).max())
        raise AssertionError(
            f"{what}: {len(bad)} logits differ (first at {bad[0].tolist()}, max {worst:.3g})"
        )


# The matrix: thread counts, ubatch sizes that land below, at and above the GEMM's batch size
# (16) and a ubatch that holds the whole sequence, uneven decode() calls, a reused prefix.
LAYOUTS = {
    "threads=1": dict(threads=1),
    "threads=3": dict(threads=3),
    "threads=4": dict(threads=4),
    "ubatch=1": dict(ubatch=1),
    "ubatch=7": dict(ubatch=7),
    "ubatch=15": dict(ubatch=15, threads=3),
    "ubatch=16": dict(ubatch=16),
    "ubatch=17": dict(ubatch=17, threads=1),
    "ubatch=64": dict(ubatch=64, threads=4),
    "calls=5,4,20,1,rest": dict(pieces=[5, 4, 20, 1]),
    "run-again": dict(),
}
# The portable path is slow (and Gemma's 262k-row output head more so): a smaller matrix there. It
# has no GEMM and no small-batch kernel (one dot per output, kernels.c), so ubatch 15/16/64 take no
# path that 7, 17 and the uneven calls do not: what a ubatch's size changes there is whether the
# activations are private to each thread (up to 8 rows) and attention's work items (one token or
# four, attention.c). It also takes half the tokens: every layout still splits them unevenly.
SCALAR_LAYOUTS = ["threads=1", "threads=3", "ubatch=1", "ubatch=7", "ubatch=17", "calls=5,4,20,1,rest"]
N = 80


@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("isa", ISAS)
def test_logits_do_not_depend_on_threads_or_split(model, isa, cache):
    """The f16 cache (-ctk/-ctv f16) has its own attention kernels: the smaller matrix for it."""
    with using_isa(isa):
        tokens = _tokens(model, N // 2 if isa == "scalar" else N)
        want = _logits(model, tokens, cache=cache)  # 2 threads, one ubatch of all tokens (the GEMM)
        layouts = SCALAR_LAYOUTS if isa == "scalar" or cache == "f16" else list(LAYOUTS)
        for name in layouts:
            _same_bytes(_logits(model, tokens, cache=cache, **LAYOUTS[name]), want, f"{isa} {cache} {name}")
        for prefix in (16, len(tokens) - 9):  # the cached prefix is kept, the rest decoded again
            got = _logits(model, tokens, reuse_prefix=prefix, ubatch=7 if prefix > 16 else 512, cache=cache)
            _same_bytes(got, want[prefix:], f"{isa} {cache} prefix={prefix}")


@pytest.mark.parametrize("isa", ISAS)
def test_rows_taken_from_another_threads_share(model, isa, skewed_shares):
    """Every matmul row of the batched passes computed by a thread that took it from another's
    share (se_share_rows, forced by the test hook): the same bytes as one thread, through the GEMM
    (one ubatch) and the small-batch kernels (ubatch 7), on 2 and 3 threads."""
    with using_isa(isa):
        tokens = _tokens(model, N // 2 if isa == "scalar" else N)
        want = _logits(model, tokens, threads=1)  # one thread: no sharing
        for layout in (dict(threads=2), dict(threads=3, ubatch=7), dict(threads=2, ubatch=17)):
            taken = skewed_shares()
            _same_bytes(_logits(model, tokens, **layout), want, f"{isa} {layout}, rows taken")
            assert skewed_shares() > taken, f"{isa} {layout}: no thread took rows from another's share"


def test_long_sequences_and_window(model):
    """Past 512 positions (Gemma's sliding window, the default ubatch), on the fastest path: the
    last 48 positions of 560 tokens decoded after one ubatch of 512, after ubatches of 64 on one
    thread, and after a reused prefix of 540 (logits of the tail only: Gemma's rows are 1 MB)."""
    tokens = _tokens(model, 560)

    def tail(threads=2, ubatch=512, reuse_prefix=None):
        with Context(model, n_ctx=1024, n_threads=threads, n_batch=512, n_ubatch=ubatch) as ctx:
            if reuse_prefix is not None:
                ctx.decode(tokens)
                ctx.truncate(reuse_prefix)
                ctx.decode(tokens[reuse_prefix:512])
            else:
                ctx.decode(tokens[:512])
            return ctx.decode(tokens[512:], all_logits=True)

    want = tail()
    _same_bytes(tail(threads=1, ubatch=64), want, "ubatch=64 threads=1")
    _same_bytes(tail(ubatch=7, reuse_prefix=500), want, "prefix=500")


PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",  # the issue's own check
    "The old lighthouse keeper climbed the stairs every night, and",
]


def _infer_run(model_path: Path, prompt: str, *flags: str) -> str:
    cmd = [sys.executable, "-m", "stdengine.cli.main", "run", "-m", str(model_path), "--raw", "--temp", "0"]
    cmd += ["-n", "64", *flags, "-p", prompt]
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_greedy_text_is_the_same_at_any_threads_and_ubatch(which, smollm2_path, gemma3_path):
    """`infer run --raw --temp 0 -n 64` gives the same text with -t 1, -t 2, -ub 1 and -t 3 -ub 17,
    each in a fresh process, for each prompt."""
    path = smollm2_path if which == "smollm2" else gemma3_path
    for prompt in PROMPTS:
        texts = {f: _infer_run(path, prompt, *f.split()) for f in ("-t 1", "-t 2", "-ub 1", "-t 3 -ub 17")}
        assert len(set(texts.values())) == 1, texts
        assert len(texts["-t 2"].split()) >= 30  # a real continuation, not an empty one
