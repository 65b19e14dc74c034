"""The C core's quantized kernels against gguf.quants and numpy, on every SIMD path this CPU has.

Expected values never come from the code under test: weights are dequantized by
gguf.quants.dequantize, activations by numpy from their raw bytes, and products are taken in
float64 by numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gg_dequantize  # noqa: E402
from gguf.quants import quantize as gg_quantize  # noqa: E402

try:
    from isa import refused, using_isa
    from stdengine.reference import kernels as K
except Exception as e:  # the C core is not built, or the package is not installed
    pytest.skip(f"reference engine C core unavailable: {e}", allow_module_level=True)

T = gguf.GGMLQuantizationType
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
WEIGHT_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, *K_QUANTS]
QUANT_TYPES = [t for t in WEIGHT_TYPES if t not in (T.F32, T.F16, T.BF16)]
GG_CAN_QUANTIZE = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}
# Byte offsets of each block's fp16 fields (d, and m/dmin), per ggml's layouts.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
ACT = {
    T.F32: T.F32,
    T.F16: T.F32,
    T.BF16: T.F32,
    T.Q4_0: T.Q8_0,
    T.Q4_1: T.Q8_1,
    T.Q5_0: T.Q8_0,
    T.Q5_1: T.Q8_1,
    T.Q8_0: T.Q8_0,
    T.Q2_K: T.Q8_K,
    T.Q3_K: T.Q8_K,
    T.Q4_K: T.Q8_K,
    T.Q5_K: T.Q8_K,
    T.Q6_K: T.Q8_K,
}


def _available_isas() -> list[str]:
    before = K.isa()
    ok = [name for name in K.ISAS if K.set_isa(name)]
    K.set_isa(before)
    return ok


ISAS = _available_isas()


@pytest.fixture(autouse=True)
def gemm_from_16_rows():
    """These tests are laid out around the GEMM from 16 rows on and the tiles below (the
    engine's default may be lower: kernels.h): pinned, so that both paths keep being tested."""
    was = K.set_gemm_min_tokens(16)
    yield
    K.set_gemm_min_tokens(was)


@pytest.fixture(params=K.ISAS)
def isa(request):
    if request.param not in ISAS:
        refused(request.param)
    with using_isa(request.param):
        yield request.param


def block(t) -> int:
    return gguf.GGML_QUANT_SIZES[t][0]


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def random_raw(t, rows: int, k: int, rng) -> np.ndarray:
    """Random blocks (every bit pattern of the quants) with valid, modest fp16 scales."""
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, k // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        vals = (
            rng.uniform(0.5, 2.0, size=raw.shape[:2])
            * rng.choice([-1, 1], size=raw.shape[:2])
            * (1 / 64 if t in K_QUANTS else 1 / 16)
        )
        raw[:, :, off : off + 2] = vals.astype(np.float16).view(np.uint8).reshape(rows, k // bs, 2)
    return raw.reshape(rows, -1)


def weights(t, rows: int, k: int, rng, source: str) -> np.ndarray:
    """Raw weight rows of type t: quantized by gguf from random floats, or random raw blocks."""
    if source == "quantized":
        x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 3, size=(rows, 1))
        x[:, : block(t)] *= 0  # an all-zero block (d = 0) in every row
        raw = gg_quantize(x.astype(np.float32), t)
        return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    return random_raw(t, rows, k, rng)


def sources(t) -> list[str]:
    return (
        ["quantized", "random"]
        if t in GG_CAN_QUANTIZE and t not in (T.F32, T.F16, T.BF16)
        else (["quantized"] if t in (T.F32, T.F16, T.BF16) else ["random"])
    )


def deq_act(t, raw: np.ndarray, k: int) -> np.ndarray:
    """Dequantize activation rows in numpy (gguf has no Q8_1 / Q8_K), straight from ggml's layouts."""
    raw = np.ascontiguousarray(raw).reshape(raw.shape[0], -1)
    n = raw.shape[0]
    if t == T.F32:
        return raw.view(np.float32).astype(np.float64)
    if t == T.Q8_0:
        return gg_dequantize(raw, T.Q8_0).astype(np.float64).reshape(n, k)
    if t == T.Q8_1:
        b = raw.reshape(n, k // 32, 36)
        d = b[:, :, 0:2].copy().view(np.float16).astype(np.float64)
        return (d * b[:, :, 4:].view(np.int8)).reshape(n, k)
    if t == T.Q8_K:
        b = raw.reshape(n, k // 256, 292)
        d = b[:, :, 0:4].copy().view(np.float32).astype(np.float64)
        return (d * b[:, :, 4:260].view(np.int8)).reshape(n, k)
    raise ValueError(t)


# ------------------------------------------------------------------ to_float


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_to_float_matches_gguf(t):
    rng = rng_for("deq", t)
    k = block(t) * 7 if block(t) > 1 else 37
    for source in sources(t):
        raw = weights(t, 5, k, rng, source)
        want = gg_dequantize(raw, t).astype(np.float32).reshape(5, k)
        got = np.stack([K.dequantize(t, r, k) for r in raw])
        np.testing.assert_array_equal(got, want, err_msg=f"{t.name} from {source} blocks")


def test_f16_every_value():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = K.dequantize(T.F16, h.view(np.uint8), 65536)
    want = h.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all()


# ------------------------------------------------------------------ from_float (activations)


def test_f16_bf16_from_float_round_like_numpy(isa):
    rng = np.random.default_rng(1)
    halfway = (np.arange(1, 200, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0**-10)  # f16 ties
    x = np.concatenate(
        [
            rng.standard_normal(4096) * 10.0 ** rng.integers(-9, 6, 4096),  # normals, subnormals, overflow
            np.array(
                [65504, 65519.99, 65520, 1e6, -1e6, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 0.0, -0.0, np.inf]
            ),
            halfway + 1,
            -(halfway * 2.0**-14),  # ties among the subnormal halves
        ]
    ).astype(np.float32)
    x = x[: len(x) // 2 * 2]
    with np.errstate(over="ignore"):
        f16 = x.astype(np.float16)
    np.testing.assert_array_equal(K.quantize(T.F16, x).view(np.uint16)[0], f16.view(np.uint16))
    np.testing.assert_array_equal(K.quantize(T.BF16, x)[0], gg_quantize(x, T.BF16).view(np.uint8))


def test_f16_from_float_nan_is_one_quiet_nan(isa):
    """Every NaN becomes sign | 0x7e00 whatever its payload (F16C would keep part of it), beside
    ordinary values in the same 8 and 16 lanes and in a row's tail."""
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA5A5A5, 0x7FB00000], dtype=np.uint32)
    x = np.linspace(-3, 3, 41).astype(np.float32)
    where = [0, 9, 17, 30, 38, 40]
    x.view(np.uint32)[where] = bits
    got = K.quantize(T.F16, x).view(np.uint16)[0]
    want = x.astype(np.float16).view(np.uint16).copy()
    want[where] = np.where(bits >> 31, 0xFE00, 0x7E00)
    np.testing.assert_array_equal(got, want)


def _ties(n: int) -> np.ndarray:
    """A block whose scale is exactly 1 (amax 127), with every value halfway between integers."""
    x = (np.arange(n, dtype=np.float32) % 200 - 100) + np.float32(0.5)
    x[0] = 127
    return x


def test_q8_0_from_float_matches_gguf(isa):
    rng = np.random.default_rng(2)
    # 21 blocks a row: the AVX-512 path quantizes 16 blocks at a time, then the rest
    x = (rng.standard_normal((3, 32 * 21)) * rng.uniform(0.01, 100, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0
    x[1, 32 * 17 : 32 * 18] = 0
    x[2, 64:96] = _ties(32)  # roundf: halfway cases go away from zero
    x[2, 32 * 19 : 32 * 20] = -_ties(32)
    np.testing.assert_array_equal(K.quantize(T.Q8_0, x), gg_quantize(x, T.Q8_0).view(np.uint8))


def test_q8_1_from_float(isa):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 32 * 21)) * 3).astype(np.float32)  # 16 blocks and 5 (see above)
    x[1, :32] = _ties(32)
    x[1, 32 * 18 : 32 * 19] = 0
    got = K.quantize(T.Q8_1, x).reshape(2, 21, 36)
    q8_0 = gg_quantize(x, T.Q8_0).view(np.uint8).reshape(2, 21, 34)
    np.testing.assert_array_equal(got[:, :, 0:2], q8_0[:, :, 0:2])  # same d and quants as Q8_0
    np.testing.assert_array_equal(got[:, :, 4:], q8_0[:, :, 2:])
    # s = d * sum(q) in fp16, with d = amax/127 before its fp16 rounding
    d = np.abs(x.reshape(2, 21, 32)).max(axis=2) / np.float32(127)
    s = (d * q8_0[:, :, 2:].view(np.int8).astype(np.int32).sum(axis=2).astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(got[:, :, 2:4].copy().view(np.float16)[..., 0], s)


def test_q8_K_from_float(isa):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 256 * 3)) * 2).astype(np.float32)
    x[2, 256:512] = 0
    x[1, :256] = -_ties(256)  # the largest |x| is -127, so iscale is exactly 1: halfway cases go to even
    x[0, 256 + 7] = x[0, 256:512].max() + 1
    x[0, 256 + 9] = -x[0, 256 + 7]  # equal |x| of both signs: the first one sets the sign
    got = K.quantize(T.Q8_K, x).reshape(3, 3, 292)
    blocks = x.reshape(3, 3, 256)
    for i in range(3):
        for b in range(3):
            v, g = blocks[i, b], got[i, b]
            if not np.abs(v).max():
                assert not g.any()
                continue
            mx = v[np.argmax(np.abs(v))]  # the first element of largest |x|, sign kept
            iscale = np.float32(-127) / mx
            q = np.minimum(127, np.rint(iscale * v)).astype(np.int8)
            np.testing.assert_array_equal(g[4:260].view(np.int8), q)
            np.testing.assert_array_equal(
                g[260:].view(np.int16), q.reshape(16, 16).astype(np.int16).sum(axis=1)
            )
            assert g[0:4].view(np.float32)[0] == np.float32(1) / iscale


# ------------------------------------------------------------------ dot and matmul


def act_error_bound(t_act, x: np.ndarray, w_deq: np.ndarray) -> np.ndarray:
    """Worst-case |dot(w, x) - dot(w, deq(quant(x)))| for each (token, row).

    Quantizing x to 8 bits moves each element by at most d/2 (d = amax/127 of its block), and
    storing d in fp16 moves it by at most 127*|d|*2^-11 more: 0.6*d covers both.
    Float activations are not quantized (bound 0).
    """
    if t_act == T.F32:
        return np.zeros((x.shape[0], w_deq.shape[0]))
    qb = 256 if t_act == T.Q8_K else 32
    amax = np.abs(x.reshape(x.shape[0], -1, qb)).max(axis=2).astype(np.float64)  # (tok, blocks)
    wabs = np.abs(w_deq.reshape(w_deq.shape[0], -1, qb)).sum(axis=2)  # (rows, blocks)
    return 0.6 / 127 * amax @ wabs.T


def float_error_bound(t_act, x, w_deq) -> np.ndarray:
    """Float32 accumulation and the fp16 scales products: a small multiple of eps * sum|w*a|."""
    mag = np.abs(x).astype(np.float64) @ np.abs(w_deq).T
    return 1e-5 * mag + 1e-30


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_dot_matches_numpy(t, isa):
    """dot(W row, act row) against float64 numpy on the dequantized operands."""
    rng = rng_for("dot", t)
    k = block(t) * 9 if block(t) > 1 else 300
    for source in sources(t):
        w = weights(t, 6, k, rng, source)
        wd = gg_dequantize(w, t).astype(np.float64).reshape(6, k)
        x = rng.standard_normal((2, k)).astype(np.float32)
        act = K.quantize(ACT[t], x)
        ad = deq_act(ACT[t], act, k)
        want = ad @ wd.T
        got = np.array([[K.dot(t, w[r], act[i], k) for r in range(6)] for i in range(2)])
        tol = 1e-5 * (np.abs(ad) @ np.abs(wd).T) + 1e-30
        if t in (T.Q4_1, T.Q5_1):
            # ggml's _1 dot takes sum(a) from Q8_1's s = d*sum(q), stored in fp16 (2^-11 relative).
            m = w.reshape(6, k // 32, 20 if t == T.Q4_1 else 24)[:, :, 2:4].copy().view(np.float16)[..., 0]
            s = np.abs(ad.reshape(2, k // 32, 32).sum(axis=2))
            tol += 2.0**-10 * (s @ np.abs(m.astype(np.float64)).T)
        assert (np.abs(got - want) <= tol).all(), f"{t.name} {source} {isa}: {np.abs(got - want).max()}"


@pytest.mark.parametrize("n_tok", [1, 3, 7, 64])
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_matmul_matches_numpy(t, n_tok, isa):
    """matmul(W, x) against float64 numpy on dequantized W and the original float x."""
    rng = rng_for("mm", t, n_tok)
    rows = 37
    k = block(t) * 5 if block(t) > 1 else 160
    for source in sources(t):
        w = weights(t, rows, k, rng, source)
        wd = gg_dequantize(w, t).astype(np.float64).reshape(rows, k)
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        x[0, :32] *= 100  # one block with a much larger range
        got = K.matmul(t, w, k, x)
        want = x.astype(np.float64) @ wd.T
        tol = act_error_bound(ACT[t], x, wd) + float_error_bound(ACT[t], x, wd)
        assert (np.abs(got - want) <= tol).all(), f"{t.name} {source} {isa}"


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 5, 40])
def test_matmul_row_ranges(t, n_tok, isa):
    """Threads each take a row range [r0, r1): the pieces are the whole, and nothing else is written."""
    rng = rng_for("ranges", t)
    rows, k = 45, (block(t) * 3 if block(t) > 1 else 96)
    w = weights(t, rows, k, rng, sources(t)[0])
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    full = K.matmul(t, w, k, x)
    assert not np.isnan(full).any()
    for r0, r1 in [(0, 1), (0, 17), (17, 45), (3, 4), (40, 45), (20, 20)]:
        part = K.matmul(t, w, k, x, r0, r1)
        np.testing.assert_array_equal(part[:, r0:r1], full[:, r0:r1])
        assert np.isnan(part[:, :r0]).all() and np.isnan(part[:, r1:]).all()


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_batch_equals_single_token(t, isa):
    """Below the GEMM's batch size, a token's outputs do not depend on the batch around it: bit
    for bit, on every path. Generation and short batches (drafted tokens) then agree exactly.
    """
    rng = rng_for("batch", t)
    rows, k = 23, (block(t) * 7 if block(t) > 1 else 224)
    w = weights(t, rows, k, rng, sources(t)[-1])
    n = min(9, K.gemm_min_tokens() - 1)
    x = rng.standard_normal((n, k)).astype(np.float32)
    batch = K.matmul(t, w, k, x)
    for i in range(n):
        np.testing.assert_array_equal(K.matmul(t, w, k, x[i : i + 1])[0], batch[i])


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [9, 37])
def test_gemm_batches_agree(t, blocks, isa):
    """Every batch size, the GEMM's included: a token's outputs are the same bit for bit whatever
    the other tokens, its place in the batch and the path (one token, tiles, GEMM), so that the
    engine's logits do not depend on how a prompt is split (spec/reference-engine.md). 9 and 37
    blocks: rows shorter than one group of 16 blocks, and several groups with a partial one."""
    rng = rng_for("gemm", t)
    rows, k = 37, (block(t) * blocks if block(t) > 1 else 32 * blocks)
    w = weights(t, rows, k, rng, sources(t)[-1])
    m = K.gemm_min_tokens()
    x = rng.standard_normal((2 * m + 3, k)).astype(np.float32)
    big = K.matmul(t, w, k, x)
    single = np.stack([K.matmul(t, w, k, x[i : i + 1])[0] for i in range(len(x))])
    np.testing.assert_array_equal(big, single)
    for lo, n in ((0, m), (5, m), (m + 3, m), (1, 5), (4, m + 1)):
        np.testing.assert_array_equal(K.matmul(t, w, k, x[lo : lo + n]), big[lo : lo + n])
    K.set_gemm_min_tokens(2)  # a few rows on the GEMM too (a step of batched decoding)
    for lo, n in ((0, 2), (3, 3), (6, 5), (1, 9)):
        np.testing.assert_array_equal(K.matmul(t, w, k, x[lo : lo + n]), big[lo : lo + n])
    for r0, r1 in ((0, 17), (17, 37), (3, 4)):  # threads' row ranges
        np.testing.assert_array_equal(K.matmul(t, w, k, x, r0, r1)[:, r0:r1], big[:, r0:r1])


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=lambda t: t.name)
def test_small_batches_equal_single_token(t, isa):
    """The steps of batched decoding (2 to 8 tokens, and a few more in passes of 8) take the
    small-batch path (kernels.h): each token's outputs are its one-token outputs bit for bit, for
    rows of whole groups of 16 blocks, of a short last group of at most 8 blocks (packed; SmolLM2's
    576 = 16 + 2 blocks, Gemma-3's 640 = 16 + 4; 1 to 4 blocks) or more, and odd K-quant super-block
    counts."""
    rng = rng_for("small", t)
    per = block(t) if block(t) > 1 else 32
    for blocks in (2, 5, 16, 17, 18, 19, 20, 29, 48) if per == 32 else (1, 2, 3, 4, 7):
        rows, k = 21, per * blocks
        w = weights(t, rows, k, rng, sources(t)[-1])
        x = rng.standard_normal((12, k)).astype(np.float32)
        x[1, :per] *= 100  # one block with a much larger range
        single = np.stack([K.matmul(t, w, k, x[i : i + 1])[0] for i in range(len(x))])
        for lo, n in ((0, 2), (2, 3), (3, 4), (1, 5), (4, 6), (5, 7), (0, 8), (3, 9), (0, 12)):
            got = K.matmul(t, w, k, x[lo : lo + n])
            np.testing.assert_array_equal(
                got, single[lo : lo + n], err_msg=f"{t.name} {blocks} blocks, {n} tokens"
            )
        for r0, r1 in ((0, 9), (9, 21), (20, 21)):  # threads' row ranges
            part = K.matmul(t, w, k, x[:6], r0, r1)
            np.testing.assert_array_equal(part[:, r0:r1], single[:6, r0:r1])


PANEL_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]  # the types AVX-512 packs (kernels_avx512_batch.c)


@pytest.mark.parametrize("t", PANEL_TYPES, ids=lambda t: t.name)
def test_packed_panels_equal_single_token(t, isa):
    """Batched decoding reads packed panels on AVX-512 and AMX (kernels.h): each token's outputs
    are its one-token outputs bit for bit, for partial last panels (37 rows), row ranges that
    start inside a panel (the rows before the next panel take se_matmul), batches of 2 to 17
    tokens, 24 and 31 (on AMX the panels take batches below SE_AMX_PANELS_MAX_TOKENS, 32), 32 and
    40 (AMX keeps its GEMM there) and row lengths with and without a short last group. Elsewhere
    there are no panels, and se_matmul_panels is se_matmul."""
    rng = rng_for("panels", t)
    for blocks in (2, 16, 18, 20, 48):
        rows, k = 37, 32 * blocks
        w = weights(t, rows, k, rng, sources(t)[-1])
        panels = K.pack_panels(t, w, k)
        assert (panels is None) == (isa in ("scalar", "avx2")), f"{isa} packs {t.name}"
        if panels is None:
            continue
        assert panels.size == 48 * K.row_size(t, k)  # rows rounded up to 16, the rows' own size
        x = rng.standard_normal((40, k)).astype(np.float32)
        x[1, :32] *= 100  # one block with a much larger range
        single = np.stack([K.matmul(t, w, k, x[i : i + 1])[0] for i in range(len(x))])
        for n in (*range(2, 18), 24, 31, 32, 40):
            got = K.matmul(t, w, k, x[:n], panels=panels)
            np.testing.assert_array_equal(got, single[:n], err_msg=f"{t.name} {blocks} blocks, {n} tokens")
        for r0, r1 in ((0, 16), (16, 37), (3, 37), (5, 9), (36, 37)):  # threads' row ranges
            part = K.matmul(t, w, k, x[:8], r0, r1, panels=panels)
            np.testing.assert_array_equal(part[:, r0:r1], single[:8, r0:r1])
            assert np.isnan(part[:, :r0]).all() and np.isnan(part[:, r1:]).all()


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [1, 9, 37])
def test_amx_gemm_equals_avx512(t, blocks):
    """The AMX path's GEMM (integer sums from int8 tiles, then AVX-512's float operations in the
    same order) gives AVX-512's output byte for byte: every batch size (full tiles of 16 tokens,
    a partial last one, fewer than 16 on the GEMM), row range and row length. (Q2_K, Q3_K and
    Q6_K keep AVX-512's GEMM on the AMX path: for them this checks the table's layering.)"""
    if "amx" not in ISAS:
        refused("amx")
    rng = rng_for("amx", t, blocks)
    rows, k = 37, block(t) * blocks
    w = weights(t, rows, k, rng, sources(t)[-1])
    x = rng.standard_normal((53, k)).astype(np.float32)
    x[7, : block(t)] *= 100  # one block with a much larger range
    cases = [
        (0, 16, 0, rows),
        (0, 53, 0, rows),
        (3, 17, 0, rows),
        (5, 31, 0, rows),
        (1, 32, 3, 4),
        (2, 50, 17, 37),
    ]
    cases += [(0, 16, 0, 16), (4, 33, 5, 21)]
    res = {}
    for name in ("avx512", "amx"):
        with using_isa(name):
            got = [K.matmul(t, w, k, x[lo : lo + n], r0, r1)[:, r0:r1] for lo, n, r0, r1 in cases]
            K.set_gemm_min_tokens(2)  # a few tokens on the GEMM: tiles of fewer rows
            got += [K.matmul(t, w, k, x[lo : lo + n]) for lo, n in ((0, 2), (3, 5), (9, 15))]
            K.set_gemm_min_tokens(16)
            res[name] = got
    for i, (a, b) in enumerate(zip(res["avx512"], res["amx"], strict=True)):
        assert a.tobytes() == b.tobytes(), f"{t.name} {blocks} blocks, case {i}"


TILE_CONFIG_C = r"""
#include <stdint.h>
#include <string.h>
/* ldtilecfg / sttilecfg of the calling thread, as another library in the process would use them */
void load_config(const uint8_t *cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(*(const uint8_t(*)[64])cfg)); }
void store_config(uint8_t *cfg) { __asm__ volatile("sttilecfg %0" : "=m"(*(uint8_t(*)[64])cfg)); }
"""


def test_amx_gemm_leaves_the_threads_tile_configuration_as_it_found_it(tmp_path):
    """Another library in the process may configure a thread's AMX tiles once and rely on them
    (llama.cpp's AMX matmul does: when the reference GEMM released the tiles, llama.cpp's next
    tileloadd on that thread raised SIGILL in `infer bench vs-llamacpp`). After an AMX GEMM the
    calling thread has the configuration it had before, or none if it had none."""
    import ctypes
    import threading

    if "amx" not in ISAS:
        refused("amx")
    src, lib_path = tmp_path / "tilecfg.c", tmp_path / "tilecfg.so"
    src.write_text(TILE_CONFIG_C)
    subprocess.run(
        ["gcc", "-O1", "-shared", "-fPIC", "-mamx-tile", str(src), "-o", str(lib_path)], check=True
    )
    lib = ctypes.CDLL(str(lib_path))
    rng = rng_for("amx-tilecfg")
    k = block(T.Q8_0) * 4
    w = weights(T.Q8_0, 16, k, rng, sources(T.Q8_0)[-1])
    x = rng.standard_normal((32, k)).astype(np.float32)
    theirs = bytearray(64)
    theirs[0] = 1  # palette 1; tile 0: 8 rows of 32 bytes, tile 5: 3 rows of 12
    theirs[16:18], theirs[48] = (32).to_bytes(2, "little"), 8
    theirs[26:28], theirs[53] = (12).to_bytes(2, "little"), 3
    seen: dict[str, bytes] = {}

    def run(name: str, before: bytearray | None) -> None:  # on a new thread: no configuration yet
        if before is not None:
            lib.load_config((ctypes.c_uint8 * 64).from_buffer(before))
        K.matmul(T.Q8_0, w, k, x)  # 32 tokens: the AMX GEMM, on this thread
        after = bytearray(64)
        lib.store_config((ctypes.c_uint8 * 64).from_buffer(after))
        seen[name] = bytes(after)

    with using_isa("amx"):
        for name, before in (("configured", theirs), ("none", None)):
            th = threading.Thread(target=run, args=(name, before))
            th.start()
            th.join()
    assert seen["configured"] == bytes(theirs)
    assert seen["none"] == bytes(64)  # released: no configuration, no tile data


@pytest.mark.parametrize("t", QUANT_TYPES + [T.F16, T.F32], ids=lambda t: t.name)
def test_isas_agree(t):
    """Every path gives the scalar path's dot up to float rounding (integer sums are exact)."""
    if len(ISAS) < 2:
        pytest.skip("only the scalar path runs here")
    rng = rng_for("agree", t)
    k = block(t) * 12 if block(t) > 1 else 1000
    w = weights(t, 8, k, rng, sources(t)[-1])
    x = rng.standard_normal((5, k)).astype(np.float32)
    res = {}
    for name in ISAS:
        with using_isa(name):
            res[name] = K.matmul(t, w, k, x)
    wd = gg_dequantize(w, t).astype(np.float64).reshape(8, k)
    ad = deq_act(ACT[t], K.quantize(ACT[t], x), k)
    tol = 1e-5 * (np.abs(ad) @ np.abs(wd).T) + 1e-30
    for name in ISAS[1:]:
        assert (np.abs(res[name] - res["scalar"]) <= tol).all(), name


def test_traits_table():
    for t in WEIGHT_TYPES + [T.Q8_1, T.Q8_K]:
        tr = K.traits(t)
        # gguf's table still gives Q8_1 its old 40-byte layout (f32 d, s); ggml's block_q8_1 is
        # 36 bytes (fp16 d, s), and Q8_1 never appears in files.
        assert (tr.blck, tr.size) == ((32, 36) if t == T.Q8_1 else gguf.GGML_QUANT_SIZES[t])
        assert tr.name.decode().lower() == t.name.lower()
        assert tr.to_float
    for t in WEIGHT_TYPES:
        assert K.traits(t).dot and K.traits(t).act_type == ACT[t]
        assert K.traits(ACT[t]).from_float
    with pytest.raises(ValueError):
        K.traits(4)  # a removed ggml id
    assert K.row_size(T.Q4_1, 576) == 18 * 20


@pytest.mark.parametrize("name", K.ISAS)
def test_env_forces_isa(name):
    """INFER_REF_ISA picks the path at start-up; an unsupported one falls back to the best here."""
    env = dict(os.environ, INFER_REF_ISA=name)
    out = subprocess.run(
        [sys.executable, "-c", "from stdengine.reference import kernels as K; print(K.isa())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == (name if name in ISAS else ISAS[-1])


# ------------------------------------------------------------------ real model weights


def _check_model_tensors(path, isa_names):
    """Rows of every tensor type in a real GGUF, read in place: to_float == gguf, matmul within bound."""
    reader = gguf.GGUFReader(str(path))
    seen = {}
    for t in reader.tensors:
        if t.tensor_type in WEIGHT_TYPES and t.tensor_type not in seen and len(t.shape) == 2:
            seen[t.tensor_type] = t
    assert seen, "no known tensor types"
    rng = np.random.default_rng(5)
    for qt, t in seen.items():
        k = int(t.shape[0])  # ggml's ne[0]: elements per row
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1, K.row_size(qt, k))[:64]
        wd = gg_dequantize(raw, qt).astype(np.float64).reshape(-1, k)
        np.testing.assert_array_equal(
            np.stack([K.dequantize(qt, r, k) for r in raw[:8]]), wd[:8].astype(np.float32)
        )
        x = rng.standard_normal((K.gemm_min_tokens() + 4, k)).astype(np.float32)
        want = x.astype(np.float64) @ wd.T
        tol = act_error_bound(ACT[qt], x, wd) + float_error_bound(ACT[qt], x, wd)
        for name in isa_names:
            with using_isa(name):
                for n_tok in (1, 3, len(x)):  # generation, tiles, GEMM
                    got = K.matmul(qt, raw, k, x[:n_tok])
                    assert (np.abs(got - want[:n_tok]) <= tol[:n_tok]).all(), f"{t.name} {qt.name} {name}"
    return sorted(q.name for q in seen)


@pytest.mark.models
def test_smollm2_tensors(smollm2_path):
    assert _check_model_tensors(smollm2_path, ISAS) == ["Q4_1", "Q8_0"]  # its f32 tensors are 1-D norms


@pytest.mark.models
def test_gemma3_tensors(gemma3_path):
    assert set(_check_model_tensors(gemma3_path, ISAS)) >= {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


@pytest.fixture(scope="module")
def kquant_models(smollm2_path, tmp_path_factory):
    """SmolLM2 requantized by llama.cpp's quantizer to Q3_K and Q2_K (bench/kquant_models.py: its
    ffn_down, the one matrix with rows of a multiple of 256, takes the type; the rest Q4_0)."""
    pytest.importorskip("llama_cpp")
    from stdengine.bench.kquant_models import make

    return make(smollm2_path, tmp_path_factory.mktemp("kquants"), ["q3_K", "q2_K"])


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["q3_K", "q2_K"])
def test_kquant_model_matches_llamacpp(kquant_models, kind):
    """On a llama.cpp-made Q3_K / Q2_K model the engine is as close to the exact float64 reference
    as llama.cpp is (the conformance suite's logits.kl bound, with the full KL), and its logits are
    bit-identical as one batch (the GEMM), in ubatches of 7 (tiles) and token by token."""
    import llama_cpp
    from stdengine.conformance.exact import ExactModel
    from stdengine.reference.core import Context
    from stdengine.reference.model import Model
    from test_reference_forward import DATA, kl_div

    path = kquant_models[kind]
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors} == {T.F32, T.Q4_0, T[kind.upper()]}
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=2, verbose=False)
    tokens = llm.tokenize((DATA / "forward_text.txt").read_text().encode(), add_bos=True, special=True)[:160]
    llm.eval(tokens)
    theirs = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    del llm
    m = Model.load(path)
    ours = []
    for n_ubatch, n_threads in ((256, 2), (7, 2), (1, 1)):
        ctx = Context(m, n_ctx=256, n_threads=n_threads, n_batch=256, n_ubatch=n_ubatch)
        ours.append(ctx.decode(tokens, all_logits=True).copy())
        ctx.close()
    m.close()
    for other in ours[1:]:
        np.testing.assert_array_equal(other, ours[0])
    exact = ExactModel(path).logits(tokens)
    kl_ours, kl_theirs = kl_div(exact, ours[0]).mean(), kl_div(exact, theirs).mean()
    print(f"{kind}: mean KL from the exact reference: reference {kl_ours:.5f}, llama.cpp {kl_theirs:.5f}")
    assert kl_ours <= max(1.5 * kl_theirs, kl_theirs + 0.002)


def test_tests_leave_the_forced_path():
    """After the per-ISA tests, the process is back on INFER_REF_ISA's path (the best one when unset)."""
    forced = os.environ.get("INFER_REF_ISA")
    assert K.isa() == (forced if forced in ISAS else ISAS[-1])


def _glu_reference(act: str, g: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """act(g) * u in float64, and the exponent z of x / (1 + e^z) (blocks.h's form of both)."""
    x = g.astype(np.float64)
    z = -x if act == "silu" else -1.59576912160573071176 * x * (1 + 0.044715 * x * x)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(z)) * u.astype(np.float64), z


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_matches_numpy_and_ignores_where_a_row_is_cut(act, isa):
    rng = np.random.default_rng(11)
    n = 1003  # not a multiple of any vector: every path has a tail
    g = (rng.standard_normal(n) * rng.choice([0.1, 1, 5, 30], n)).astype(np.float32)
    g[:12] = [0, -0.0, 1e-30, -1e-30, 87, -87, 88.5, -88.5, 89, -89, 1e4, -1e4]  # exp's edges, both signs
    u = rng.standard_normal(n).astype(np.float32)
    got = K.glu(act, g, u)
    want, z = _glu_reference(act, g, u)
    # z rounded to float (a few roundings: up to about 3 ulp of z) moves e^z, so the result, by up
    # to 3e-7 |z| relatively; then expf within 2 ulp, 1 + e, the quotient and the product: a few
    # ulp more. Where e^z passes float's range the quotient is below 1e-36 (libm's: -0).
    err = np.abs(got - want)
    bound = np.abs(want) * (6e-7 + 3e-7 * np.minimum(np.abs(z), 100)) + 1e-35
    assert not np.isnan(got).any()
    assert (err <= bound).all(), f"worst at g={g[np.argmax(err / bound)]}: {err.max()}"
    # a thread computes its share of a row: the same bits wherever the share starts and ends
    cuts = [0, 5, 21, 22, 500, 517, n]
    pieces = [K.glu(act, g[a:b], u[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    np.testing.assert_array_equal(np.concatenate(pieces), got)
