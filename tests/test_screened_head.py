"""The screened output head (issue 22; spec/reference-engine.md, "Screening the output head").

Two promises, checked on both catalogue models against the full head computed by the same engine:
- every row's exact logit lies inside the interval the screen gives it (from the 4-bit plane,
  narrowed by the fifth bits where stage 1 left the row), and the rows the screen computes
  exactly (its candidates) hold the true top k, with the full head's bits;
- generation with the screen gives exactly the tokens of generation without it, greedy and
  sampled (top-k, top-p, min-p, penalties), over a thousand steps per model.
"""

from __future__ import annotations

import ctypes
import io
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from stdengine.conformance.corpus import LOGIT_TEXTS

from stdengine.adapter import SamplingParams
from stdengine.events import Emitter
from stdengine.options import Options

ALWAYS = 2  # se_context_set_lazy_head: screen every sample, never fall back to the full head for speed

SAMPLERS = {
    "greedy": SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0),
    "top-k 40": SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=7),
    # min-p's route (the screen applies top-p and min-p) with wide and narrow cuts, and without it
    "top-k 100, top-p 0.99, min-p 0.01": SamplingParams(
        temp=1.5, top_k=100, top_p=0.99, min_p=0.01, repeat_penalty=1.0, seed=5
    ),
    "top-k 64, top-p 0.6, min-p 0.2": SamplingParams(
        temp=1.2, top_k=64, top_p=0.6, min_p=0.2, repeat_penalty=1.0, seed=3
    ),
    "top-k 40, no min-p": SamplingParams(
        temp=0.8, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.0, seed=7
    ),
    "top-k 10, penalties": SamplingParams(
        temp=1.0,
        top_k=10,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.3,
        repeat_last_n=64,
        frequency_penalty=0.2,
        presence_penalty=0.3,
        seed=11,
    ),
}


def load(path):
    from stdengine.reference.adapter import ReferenceEngine

    opts = Options(model=str(path), engine="reference", threads=2, ctx_size=1024)
    return ReferenceEngine.load(opts, Emitter(stream=io.StringIO()))


def head_outweighs_layers(e) -> bool:
    """Whether the model's head (tied to its token embeddings) has more bytes than its layers'
    weights: Gemma-3-270M's does, SmolLM2's does not"""
    tensors = e.model.tensors
    return tensors["token_embd.weight"].n_bytes > sum(
        t.n_bytes for n, t in tensors.items() if n.startswith("blk.")
    )


def lazy_head(ctx, mode: int) -> None:
    """se_context_set_lazy_head: 0 off, 1 on (the engine's default), ALWAYS"""
    from stdengine.reference.core import api

    api().se_context_set_lazy_head(ctx._h, mode)


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def engine(request):
    e = load(request.getfixturevalue(f"{request.param}_path"))
    yield e
    e.close()


def screen(ctx, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The candidates (ids, exact logits) of a top-k screen of the pending head, and every row's
    interval (lower, upper ends)."""
    from stdengine.reference.core import api

    c, cap = api(), ctx.n_vocab
    ids, vals = np.empty(cap, np.int32), np.empty(cap, np.float32)
    n = c.se_context_screen(ctx._h, k, ids.ctypes.data, vals.ctypes.data, cap)
    assert n >= k, f"the screen did not run (returned {n})"
    bounds = [
        np.ctypeslib.as_array(
            (ctypes.c_float * cap).from_address(c.se_context_screen_bounds(ctx._h, u))
        ).copy()
        for u in (0, 1)
    ]
    return ids[:n], vals[:n], bounds[0], bounds[1]


def assert_screen_holds(full, k: int, ids, vals, lower, upper) -> None:
    """A top-k screen's promise against the full head's logits: every row within its interval,
    the candidates in id order holding the true top k, with the full head's bits."""
    assert (lower <= full).all() and (full <= upper).all(), "a logit outside its interval"
    assert np.all(np.diff(ids) > 0), "candidates in id order, each once"
    kth = -np.partition(-full, k - 1)[k - 1]
    top = np.flatnonzero(full >= kth)  # the top k, and every row tied with the k-th
    assert np.isin(top, ids).all(), "a true top-k row was screened out"
    assert np.array_equal(vals.view(np.uint32), full[ids].view(np.uint32))


def test_every_logit_lies_in_its_interval_and_the_candidates_hold_the_top_k(engine):
    """Teacher-forced over the conformance suite's logits texts: at every position, for k = 1 and
    40, lower <= exact <= upper on every row, the true top k are candidates, and a candidate's
    logit has the full head's bits."""
    ctx = engine.ctx
    lazy_head(ctx, ALWAYS)
    positions = 0
    for text in LOGIT_TEXTS.values():
        tokens = engine.tokenize(text)[:160]
        ctx.reset()
        ctx.evaluate(tokens[:8])
        for tok in tokens[8:]:
            ctx.evaluate([tok])
            screens = {k: screen(ctx, k) for k in (1, 40)}
            full = ctx.logits  # the full head (the screens left it pending)
            for k, found in screens.items():
                assert_screen_holds(full, k, *found)
            positions += 1
    lazy_head(ctx, 1)
    assert positions >= 300


def generate(ctx, prompt: list[int], sampler: SamplingParams, n: int, mode: int) -> tuple[list[int], tuple]:
    lazy_head(ctx, mode)
    ctx.reset()
    before = ctx.screen_stats
    ctx.evaluate(prompt)
    out = [ctx.sample(sampler)]
    for _ in range(n - 1):
        ctx.evaluate([out[-1]])
        out.append(ctx.sample(sampler))
    after = ctx.screen_stats
    return out, tuple(b - a for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_screened_generation_gives_the_full_heads_tokens(engine, sampler):
    """200 tokens from each of two prompts, with every sample screened and with the full head:
    the same tokens (2400 steps per model over the six samplers). With min-p after top-k the
    screen also applies top-p and min-p (min-p's route): the few samples where it cannot tell
    their cut from the rows it computed take the top-k rule's screen where the head outweighs the
    layers, else the full head."""
    ctx, sp = engine.ctx, SAMPLERS[sampler]
    retried = head_outweighs_layers(engine)
    min_p_route = sp.temp > 0 and sp.top_k > 1 and sp.min_p > 0
    for text in ("The history of the printing press", "def fibonacci(n):"):
        prompt = engine.tokenize(text)
        screened, stats = generate(ctx, prompt, sp, 200, ALWAYS)
        full, none = generate(ctx, prompt, sp, 200, 0)
        assert screened == full
        # every sample screened, or (where the route's undecided samples are not screened again) fell back
        assert stats[0] + (0 if retried else stats[6]) == 200 and stats[2] == 0, stats
        assert stats[3] > 0, stats  # and stage 2 narrowed rows
        if min_p_route:  # the route decided most samples (so they test it)
            assert stats[5] >= 100, stats
        else:
            assert stats[5] == stats[6] == 0, stats
        assert not any(none)
    lazy_head(ctx, 1)  # the engine's own setting again


@pytest.mark.parametrize(
    "sp",
    [
        replace(SAMPLERS["top-k 10, penalties"], top_k=40, top_p=0.9, min_p=0.05, seed=4),
        SamplingParams(temp=0.7, top_k=2, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=5),
        SamplingParams(temp=0.7, top_k=128, top_p=0.0, min_p=1.0, repeat_penalty=1.0, seed=6),
        SamplingParams(temp=2.0, top_k=128, top_p=1.0, min_p=0.001, repeat_penalty=1.0, seed=8),
    ],
    ids=["penalties", "top-k 2", "min-p 1, top-p 0", "min-p 0.001"],
)
def test_min_ps_route_at_its_edges_gives_the_full_heads_tokens(engine, sp):
    """Min-p's route with penalized rows, with a top k tighter than min-p's cut (the top-k rule
    then), with the narrowest and the widest cuts: 150 tokens, the full head's, every sample
    screened or sent to the full head by the route (screened again by the top-k rule where the head
    outweighs the layers)."""
    prompt = engine.tokenize("Once upon a time in a small village")
    screened, stats = generate(engine.ctx, prompt, sp, 150, ALWAYS)
    full, _ = generate(engine.ctx, prompt, sp, 150, 0)
    lazy_head(engine.ctx, 1)
    assert screened == full
    assert stats[0] + (0 if head_outweighs_layers(engine) else stats[6]) == 150 and stats[2] == 0, stats


def test_the_speed_fallback_keeps_the_full_heads_tokens_and_tries_again(smollm2_path):
    """SmolLM2 at top-k 40 without min-p leaves most of its rows to stage 2 (spec: "Fallbacks for speed"). With
    the engine's own setting some samples then take the full head and later ones are screened
    again; the tokens are the full head's."""
    e = load(smollm2_path)
    try:
        prompt, sp = e.tokenize("The history of the printing press"), SAMPLERS["top-k 40, no min-p"]
        tokens, stats = generate(e.ctx, prompt, sp, 64, 1)
        full, _ = generate(e.ctx, prompt, sp, 64, 0)
        assert tokens == full
        assert 2 <= stats[0] < 64, stats
    finally:
        e.close()


def test_samplers_that_need_the_whole_distribution_are_not_screened(engine):
    """Top-p without top-k at temperature > 0, and penalties that raise logits, read the full head:
    no screen runs (the tokens are the full head's by construction)."""
    ctx = engine.ctx
    prompt = engine.tokenize("Once upon a time")
    for sp in (
        SamplingParams(temp=0.8, top_k=0, top_p=0.9, min_p=0.0, repeat_penalty=1.0, seed=3),
        SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=0.8, seed=3),
        SamplingParams(temp=0.8, top_k=500, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=3),
    ):
        _, stats = generate(ctx, prompt, sp, 8, ALWAYS)
        assert not any(stats), sp
    lazy_head(ctx, 1)


def test_head_pending_says_whether_the_next_sample_computes_head_rows(engine):
    """se_context_head_pending, which Context.sample reads to choose whether its C call releases
    the GIL: 1 after a decode that left the head to the sampler, 0 once the logits are computed."""
    from stdengine.reference.core import api

    ctx, c = engine.ctx, api()
    prompt = engine.tokenize("Once upon a time")
    for mode, pending in ((0, 0), (ALWAYS, 1)):
        lazy_head(ctx, mode)
        ctx.reset()
        ctx.evaluate(prompt)
        assert c.se_context_head_pending(ctx._h) == pending, mode
    c.se_context_head(ctx._h)
    assert c.se_context_head_pending(ctx._h) == 0
    lazy_head(ctx, 1)


def q8_rows(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q8_0 rows (ggml's layout: an f16 scale, then 32 int8) from scales [rows, nb], quants [rows, nb, 32]"""
    rows, nb = d.shape
    out = np.empty((rows, nb, 34), np.uint8)
    out[..., :2] = d.astype(np.float16).reshape(rows, nb, 1).view(np.uint8)
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out


def bounds(rows: np.ndarray, n: int, act: np.ndarray, stages: int) -> tuple[np.ndarray, np.ndarray]:
    """se_screen_bounds_test: every row's interval after stage 1, 2 or 3"""
    from stdengine.reference.core import api

    lo, hi = np.empty(len(rows), np.float32), np.empty(len(rows), np.float32)
    rc = api().se_screen_bounds_test(
        rows.ctypes.data, len(rows), n, act.ctypes.data, stages, lo.ctypes.data, hi.ctypes.data
    )
    assert rc == 0
    return lo, hi


@pytest.mark.parametrize("isa_name", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("n", [192, 576, 640])
def test_the_bound_holds_and_is_reached(isa_name, n):
    """The bound kernels of the three stages against float64 numpy, on rows made to reach them. A
    weight is u - 128 with u = 16h + 8f + l: stage 1 knows h, stage 2 also f, stage 3 also l. The
    low 4 bits (8f + l) at 15 where the activation is positive and 0 elsewhere give stage 1's upper
    end exactly, the low 3 bits (l) at 7 there give stage 2's (and the opposite the lower ends).
    Every exact logit, and the engine's own Q8_0 dot, lies inside every interval; the made rows
    sit at their end, within the rounding margin: a bound narrower than the derivation's fails.
    Stage 3 knows every bit, so what is left of its interval is the rounding margins (2% of stage
    2's by the derivation, most of it stage 1's widening): under 3%."""
    from isa import using_isa
    from stdengine.reference import kernels as K

    rng = np.random.default_rng(n)
    nb = n // 32
    act = K.quantize("q8_0", rng.standard_normal(n).astype(np.float32) * 3)[0]
    blocks = act.reshape(nb, 34)
    dx = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
    xq = blocks[:, 2:].copy().view(np.int8).astype(np.int64)
    pos, neg = np.where(xq > 0, 1, 0), np.where(xq < 0, 1, 0)
    fifth = rng.integers(0, 2, size=(128, nb, 32))
    low3 = rng.integers(0, 8, size=(128, nb, 32))
    low3[:32], low3[32:64] = 7 * pos, 7 * neg  # stage 2's upper, lower end
    fifth[64:80], low3[64:80] = pos, 7 * pos  # stage 1's upper end (and stage 2's)
    fifth[80:96], low3[80:96] = neg, 7 * neg  # stage 1's lower end (and stage 2's)
    q = 16 * rng.integers(0, 16, size=(128, nb, 32)) + 8 * fifth + low3 - 128
    d = rng.uniform(0.001, 0.02, size=(128, nb)).astype(np.float16).astype(np.float64)
    rows = q8_rows(d, q)
    exact = ((q * xq).sum(-1) * d * dx).sum(-1)
    with using_isa(isa_name):
        engine = np.array([K.dot("q8_0", rows[r].reshape(-1), act, n) for r in range(128)])
        stage = {s: bounds(rows, n, act, s) for s in (1, 2, 3)}
    for lo, hi in stage.values():
        assert (lo <= exact).all() and (exact <= hi).all()
        assert (lo <= engine).all() and (engine <= hi).all()
    for s, upper, lower in ((1, slice(64, 80), slice(80, 96)), (2, slice(0, 32), slice(32, 64))):
        lo, hi = stage[s]
        margin = (hi.astype(np.float64) - lo) * 2**-6
        assert (hi - exact <= margin)[upper].all(), f"stage {s}'s upper end is not reached"
        assert (exact - lo <= margin)[lower].all(), f"stage {s}'s lower end is not reached"
    assert (stage[2][1] - stage[2][0] < 0.5 * (stage[1][1] - stage[1][0])).all(), "stage 2 narrows"
    assert (stage[3][1] - stage[3][0] < 0.03 * (stage[2][1] - stage[2][0])).all(), "stage 3 settles"
    d[5, 1] = -d[5, 1]  # the bound assumes d >= 0: a negative scale is refused
    with pytest.raises(AssertionError):
        bounds(q8_rows(d, q), n, act, 1)


@pytest.mark.parametrize("isa_name", ["avx2", "avx512"])
@pytest.mark.parametrize("n", [64, 640])
def test_stage_1_gives_the_same_bits_on_every_path(isa_name, n):
    """Stage 1 adds a row's blocks in one order with the same operations on every path (screen.h),
    so a SIMD path's ends are the portable path's bits, also in a tile of 16 rows that the head
    only partly fills (37 rows here); and every exact logit lies inside."""
    from isa import using_isa
    from stdengine.reference import kernels as K

    rng = np.random.default_rng(n + 1)
    nb, n_rows = n // 32, 37
    act = K.quantize("q8_0", rng.standard_normal(n).astype(np.float32))[0]
    blocks = act.reshape(nb, 34)
    dx = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
    xq = blocks[:, 2:].copy().view(np.int8).astype(np.int64)
    q = rng.integers(-128, 128, size=(n_rows, nb, 32))
    d = rng.uniform(0.0, 0.05, size=(n_rows, nb)).astype(np.float16).astype(np.float64)
    rows = q8_rows(d, q)
    with using_isa("scalar"):
        portable = bounds(rows, n, act, 1)
    with using_isa(isa_name):
        simd = bounds(rows, n, act, 1)
    assert np.array_equal(portable[0], simd[0]) and np.array_equal(portable[1], simd[1])
    exact = ((q * xq).sum(-1) * d * dx).sum(-1)
    assert (simd[0] <= exact).all() and (exact <= simd[1]).all()


@pytest.mark.parametrize("isa_name", ["scalar", "avx2"])
@pytest.mark.parametrize("n", [64, 640])
def test_the_planes_give_back_the_head(isa_name, n):
    """Where the planes stand for the head (Gemma-3's), h, f and l rebuild every row's Q8_0 blocks
    byte for byte: every int8 value from -128 to 127, in a tile the rows only partly fill (37
    rows), with the scales as stored. A row with a negative scale is refused (the bound needs d >= 0)."""
    from isa import using_isa
    from stdengine.reference.core import api

    rng = np.random.default_rng(n + 2)
    nb, n_rows = n // 32, 37
    q = rng.integers(-128, 128, size=(n_rows, nb, 32))
    q[0] = np.arange(-128, 128).reshape(8, 32)[np.arange(nb) % 8]  # every value
    d = rng.uniform(0.0, 0.05, size=(n_rows, nb))
    rows = q8_rows(d, q)
    out = np.zeros_like(rows)
    with using_isa(isa_name):
        assert api().se_screen_rows_test(rows.ctypes.data, n_rows, n, out.ctypes.data) == 0
        assert np.array_equal(out, rows)
        d[5, 1] = -0.01
        assert api().se_screen_rows_test(q8_rows(d, q).ctypes.data, n_rows, n, out.ctypes.data) != 0


@pytest.mark.parametrize("isa_name", ["avx2", "avx512"])
@pytest.mark.parametrize("stand", [0, 1])
def test_the_planes_are_built_the_same_on_every_path(isa_name, stand):
    """The SIMD packers build the portable packer's planes byte for byte (tiles, records, low bits),
    for every int8 value, rows of 2 to 20 blocks and a last tile the rows only partly fill."""
    from isa import using_isa
    from stdengine.reference.core import api

    for n in (64, 576, 640):
        rng = np.random.default_rng(n + 4)
        nb, n_rows = n // 32, 37
        q = rng.integers(-128, 128, size=(n_rows, nb, 32))
        q[0] = np.arange(-128, 128).reshape(8, 32)[np.arange(nb) % 8]
        rows = q8_rows(rng.uniform(0.0, 0.05, size=(n_rows, nb)), q)
        built = {}
        for path in ("scalar", isa_name):
            out = np.zeros(64 * n * n_rows, np.uint8)
            with using_isa(path):
                size = api().se_screen_planes_test(
                    rows.ctypes.data, n_rows, n, stand, out.ctypes.data, out.size
                )
            assert size > 0
            built[path] = out[:size]
        assert np.array_equal(built["scalar"], built[isa_name])


@pytest.mark.parametrize("isa_name", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("n", [64, 576, 640])
def test_the_full_head_from_the_planes_has_the_heads_bits(isa_name, n):
    """A screened sampler's fallback where the planes stand for the head computes every logit from
    them (on the AVX-512 path without rebuilding the rows): the head's own kernel on its own rows
    gives the same bits, for every int8 value, rows of 2 to 20 blocks (SmolLM2's 18 and Gemma-3's
    20 end with a short group of the summation order) and a last tile the rows only partly fill."""
    from isa import using_isa
    from stdengine.reference import kernels as K
    from stdengine.reference.core import api

    rng = np.random.default_rng(n + 3)
    nb, n_rows = n // 32, 37
    q = rng.integers(-128, 128, size=(n_rows, nb, 32))
    q[0] = np.arange(-128, 128).reshape(8, 32)[np.arange(nb) % 8]
    d = rng.uniform(0.0, 0.05, size=(n_rows, nb))
    rows = q8_rows(d, q)
    x = rng.standard_normal(n).astype(np.float32)
    act = K.quantize("q8_0", x)
    planes = np.zeros(n_rows, np.float32)
    with using_isa(isa_name):
        assert (
            api().se_screen_head_test(rows.ctypes.data, n_rows, n, act.ctypes.data, planes.ctypes.data) == 0
        )
        head = K.matmul("q8_0", rows, n, x)[0]
    assert np.array_equal(planes.view(np.uint32), head.view(np.uint32))


def mapped_rss(model) -> int:
    """Bytes of this process's memory that the model's mapping of its file holds (/proc/self/smaps;
    another model of the same file has a mapping of its own)"""
    base = model.tensor_bytes("token_embd.weight").ctypes.data - model.tensors["token_embd.weight"].offset
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line: its address range
            lo, hi = (int(a, 16) for a in first.split("-"))
            inside = base <= lo and hi <= base + model.file_size + 4096
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def planes_stand_for_the_head(path, text: str, sampler: SamplingParams, n: int) -> tuple:
    """Once a screen has built the planes, the head's pages leave memory and stay out while
    generation screens (exact rows and the tied embeddings come from the planes); a screened
    sampler's fallback computes the full head from the planes with the full head's bits; reading
    the logits brings the head back. The generation's screen stats."""
    from stdengine.reference.core import api

    e = load(path)
    try:
        head = e.model.tensors["token_embd.weight"].n_bytes
        prompt = e.tokenize(text)
        tokens, stats = generate(e.ctx, prompt, sampler, n, 1)
        assert mapped_rss(e.model) < e.model.file_size - 0.9 * head
        e.ctx.evaluate([tokens[-1]])
        assert api().se_context_head_from_planes(e.ctx._h) == 0
        planes = e.ctx.logits.copy()
        assert mapped_rss(e.model) < e.model.file_size - 0.9 * head
        other = e.new_context()
        try:
            other.ctx.evaluate(prompt + tokens)
            full = other.ctx.logits  # the head's own rows
            assert np.array_equal(planes.view(np.uint32), full.view(np.uint32))
            assert mapped_rss(e.model) > e.model.file_size - 0.1 * head
        finally:
            other.close()
        return stats
    finally:
        e.close()


def test_the_planes_stand_for_the_head_and_its_pages_leave_memory(gemma3_path, smollm2_path):
    """Gemma-3's head outweighs its layers: its planes stand for it on every path. SmolLM2's stand
    for it on the AVX-512 paths, which compute the full head straight from the planes (its samples
    at top-k 40 without min-p mostly take that fallback); elsewhere its planes leave out the low
    bits, so it has no head from the planes."""
    from stdengine.reference import kernels as K
    from stdengine.reference.core import api

    stats = planes_stand_for_the_head(
        gemma3_path, "The history of the printing press", SAMPLERS["top-k 40"], 48
    )
    assert stats[0] == 48, stats  # every sample screened: the ones min-p's route could not decide
    assert stats[6] > 0, stats  # (here some) by the top-k rule's screen after it
    if K.isa() in ("avx512", "amx"):
        planes_stand_for_the_head(smollm2_path, "Once upon a time", SAMPLERS["top-k 40, no min-p"], 24)
        return
    e = load(smollm2_path)
    try:
        generate(e.ctx, e.tokenize("Once upon a time"), SAMPLERS["greedy"], 4, 1)
        e.ctx.evaluate([1])
        assert api().se_context_head_from_planes(e.ctx._h) != 0
    finally:
        e.close()


def test_ignore_eos_keeps_the_screen_and_the_tokens(engine):
    """ignore_eos and min_tokens ban the end-of-generation tokens in the C sampler (Context.ban),
    so the head stays screened: the same tokens as with the screen off, no end-of-generation token
    among them, and every sample but the first (the prompt's, whose logits generate() reads) was
    screened."""
    from stdengine.adapter import GenerateRequest, TokenEvent

    def run(screen: bool, **eog) -> tuple[list[int], tuple]:
        lazy_head(engine.ctx, ALWAYS if screen else 0)
        before = engine.ctx.screen_stats
        sp = SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0, n_predict=64)
        ids = [
            e.id
            for e in engine.generate(GenerateRequest(prompt="Hi.", sampling=sp, **eog))
            if isinstance(e, TokenEvent) and e.id >= 0
        ]
        after = engine.ctx.screen_stats
        return ids, tuple(b - a for a, b in zip(before, after, strict=True))

    for eog in ({"ignore_eos": True}, {"min_tokens": 48}):
        screened, stats = run(True, **eog)
        full, _ = run(False, **eog)
        assert screened == full
        assert not any(engine._is_eog(t) for t in screened[:48])
        assert stats[0] >= len(screened) - 1 and stats[2] == 0, stats
    engine.ctx.ban(None)
    lazy_head(engine.ctx, 1)


@contextmanager
def planned_contexts(engine, plans: list):
    """engine's context and len(plans) - 1 more of its family, emptied, each screening every sample
    it can (ALWAYS) with its plan (Context.plan_sample); the engine's own settings again after."""
    others = [engine.new_context() for _ in plans[1:]]
    ctxs = [engine.ctx] + [o.ctx for o in others]
    try:
        for ctx, sp in zip(ctxs, plans, strict=True):
            lazy_head(ctx, ALWAYS)
            ctx.reset()
            ctx.plan_sample(sp)
        yield ctxs
    finally:
        for o in others:
            o.close()
        lazy_head(engine.ctx, 1)
        engine.ctx.plan_sample(None)


def test_a_pass_of_several_contexts_screens_each_as_if_alone(engine):
    """Three contexts in shared passes (evaluate_batch), each with its own prompt and sampler, the
    screen's stage 1 done in the pass (Context.plan_sample): every logit within its interval and
    the true top k among the candidates at the first sample, then 100 tokens each, the tokens of
    each one generating alone with the full head; every sample screened from the pass's stage 1."""
    from stdengine.reference.core import evaluate_batch

    samplers = [SAMPLERS[name] for name in ("greedy", "top-k 40", "top-k 10, penalties")]
    prompts = [
        engine.tokenize(t) for t in ("The history of the printing press", "def fibonacci(n):", "Q: 2+2?")
    ]
    with planned_contexts(engine, samplers) as ctxs:
        before = [ctx.screen_stats for ctx in ctxs]
        evaluate_batch(ctxs, prompts)
        for ctx in ctxs:  # the pass's stage 1, checked against the full head (which then runs)
            found = screen(ctx, 40)
            assert_screen_holds(ctx.logits, 40, *found)
        assert all(ctx.screen_stats[4] - b[4] == 1 for ctx, b in zip(ctxs, before, strict=True))
        for ctx in ctxs:
            ctx.reset()
        before = [ctx.screen_stats for ctx in ctxs]
        evaluate_batch(ctxs, prompts)
        outs: list[list[int]] = [[] for _ in ctxs]
        for _ in range(100):
            for ctx, sp, out in zip(ctxs, samplers, outs, strict=True):
                out.append(ctx.sample(sp))
            evaluate_batch(ctxs, [[out[-1]] for out in outs])
        # a sample min-p's route cannot decide is screened again by the top-k rule, with a stage 1
        # of its own, where the head outweighs the layers (Gemma-3), else takes the full head
        retried = head_outweighs_layers(engine)
        for ctx, b in zip(ctxs, before, strict=True):
            stats = tuple(a - x for a, x in zip(ctx.screen_stats, b, strict=True))
            undecided = stats[6]
            if retried:
                assert stats[0] == 100 and stats[4] + undecided == 100 and stats[2] == 0, stats
            else:
                assert stats[0] + undecided == 100 and stats[4] == stats[0] and stats[2] == 0, stats
        for ctx, sp, prompt, out in zip(ctxs, samplers, prompts, outs, strict=True):
            ctx.plan_sample(None)
            alone, _ = generate(ctx, prompt, sp, 100, 0)
            assert out == alone


def test_a_pass_computes_the_logits_of_contexts_that_read_them(engine):
    """Without a planned sampler (logits read: log-probabilities, a constraint), or with more
    screenable contexts than a pass screens, the pass computes their logits: no screen runs."""
    from stdengine.reference.core import evaluate_batch

    greedy = SAMPLERS["greedy"]
    for plan in ([None, greedy], [greedy] * 6):  # unplanned; more than SE_SCREEN_BATCH (4)
        with planned_contexts(engine, plan) as ctxs:
            before = [ctx.screen_stats for ctx in ctxs]
            evaluate_batch(ctxs, [engine.tokenize("Once upon a time")] * len(ctxs))
            for ctx in ctxs:
                ctx.sample(greedy)
            passes = [ctx.screen_stats[4] - b[4] for ctx, b in zip(ctxs, before, strict=True)]
            assert passes == ([0, 1] if plan[0] is None else [0] * 6), passes


def test_a_generation_that_ends_leaves_no_plan(engine):
    """generate() plans its sampler for shared passes and takes the plan back when it ends, also
    when evaluating its prompt fails, so a later pass does not leave this context's head to a
    sample that never comes."""
    from stdengine.adapter import GenerateRequest, TokenEvent

    plans: list[object] = []
    original = engine._plan_sample
    engine._plan_sample = lambda s: (plans.append(s), original(s))[1]
    sp = SamplingParams(temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=0, n_predict=4)
    try:
        events = list(engine.generate(GenerateRequest(prompt="Hi.", sampling=sp)))
        assert any(isinstance(e, TokenEvent) for e in events)
        assert plans == [sp, None]
        plans.clear()

        def failing_prefill(*args, **kwargs):
            raise RuntimeError("the prompt's evaluation failed")

        engine._prefill = failing_prefill
        with pytest.raises(RuntimeError):
            list(engine.generate(GenerateRequest(prompt="Hi.", sampling=sp)))
        assert plans == [sp, None]
    finally:
        engine.__dict__.pop("_prefill", None)
        engine._plan_sample = original
