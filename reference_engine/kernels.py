"""ctypes bindings of the C core's quantized kernels (csrc/kernels.h), for tests and debugging.

Not on the hot path: the forward pass calls the kernels from C. Types are ggml type ids, names
("q4_1") or gguf.GGMLQuantizationType members. Raw data is a numpy uint8 array (or bytes) laid
out exactly as in a GGUF file.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
from stdengine.reference import core
from stdengine.reference.core import ISAS, isa_name  # noqa: F401  (re-exported: the tests walk the paths by ISAS)

from stdengine.gguf_file import ggml_type

_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@cache
def _core() -> ctypes.CDLL:
    """core.api() with the kernel entry points only tests and tools call declared too."""
    c = core.api()
    c.se_set_isa.argtypes, c.se_set_isa.restype = [ctypes.c_char_p], _int
    c.se_kernels_init.argtypes, c.se_kernels_init.restype = [], None
    c.se_quantize_rows.argtypes, c.se_quantize_rows.restype = [_int, _vp, _i64, _int, _vp], None
    c.se_matmul.argtypes = [_int, _vp, _i64, _vp, _int, _vp, _i64, _i64, _i64]
    c.se_matmul.restype = None
    c.se_gemm_min_tokens.argtypes, c.se_gemm_min_tokens.restype = [], _int
    c.se_set_gemm_min_tokens.argtypes, c.se_set_gemm_min_tokens.restype = [_int], _int
    c.se_glu.argtypes, c.se_glu.restype = [_int, _vp, _vp, _i64], None
    c.se_panels_size.argtypes, c.se_panels_size.restype = [_int, _i64, _i64], ctypes.c_size_t
    c.se_pack_panels.argtypes, c.se_pack_panels.restype = [_int, _vp, _i64, _i64, _vp], None
    c.se_matmul_panels.argtypes = [_int, _vp, _vp, _i64, _vp, _int, _vp, _i64, _i64, _i64]
    c.se_matmul_panels.restype = None
    return c


def type_id(t: int | str) -> int:
    """A ggml type's id from its id, its name ("q4_1", any case) or a gguf.GGMLQuantizationType."""
    return ggml_type(t).id if isinstance(t, str) else int(t)


def traits(t: int | str) -> core.Traits:
    tr = core.type_traits(type_id(t))
    if tr is None:
        raise ValueError(f"unknown tensor type {t!r}")
    return tr


def row_size(t: int | str, n: int) -> int:
    tr = traits(t)
    if n % tr.blck:
        raise ValueError(f"{tr.name.decode()} rows need a multiple of {tr.blck} elements, not {n}")
    return core.row_size(type_id(t), n)


isa = isa_name  # the SIMD path in use


def gemm_min_tokens() -> int:
    """Batches of at least this many tokens may take the GEMM path (kernels.h)."""
    return _core().se_gemm_min_tokens()


def set_gemm_min_tokens(n: int | None) -> int:
    """Batches of n or more tokens take the GEMM from now on (None: the default); returns the
    previous value. For tests and benchmarks: call it between matmuls, as set_isa."""
    return _core().se_set_gemm_min_tokens(n or 0)


def set_isa(name: str | None) -> bool:
    """Use the named SIMD path (None: the best here); False when this CPU cannot run it."""
    return _core().se_set_isa(name.encode() if name else None) == 0


def _raw(data) -> np.ndarray:
    return np.ascontiguousarray(
        np.frombuffer(data, dtype=np.uint8)
        if isinstance(data, bytes | bytearray)
        else np.asarray(data).view(np.uint8).reshape(-1)
    )


def dequantize(t: int | str, raw, n: int) -> np.ndarray:
    """The first n elements of raw as float32, through the type's C to_float."""
    tr, src = traits(t), _raw(raw)
    if src.size < row_size(t, n):
        raise ValueError("raw data is shorter than n elements")
    out = np.empty(n, dtype=np.float32)
    ctypes.CFUNCTYPE(None, _vp, _vp, _i64)(tr.to_float)(src.ctypes.data, out.ctypes.data, n)
    return out


def quantize(t: int | str, x: np.ndarray) -> np.ndarray:
    """Rows of float32 (shape (k,) or (n_tok, k)) -> uint8 (n_tok, row_size), through se_quantize_rows."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    n_tok, k = x2.shape
    if not traits(t).from_float:
        raise ValueError(f"{traits(t).name.decode()} has no from_float")
    out = np.empty((n_tok, row_size(t, k)), dtype=np.uint8)
    _core().se_quantize_rows(type_id(t), x2.ctypes.data, k, n_tok, out.ctypes.data)
    return out


def dot(t: int | str, w, act, n: int) -> float:
    """One weight row (type t) with one activation row already in t's act_type."""
    tr, w, act = traits(t), _raw(w), _raw(act)
    if not tr.dot:
        raise ValueError(f"{tr.name.decode()} is not a weight type")
    fn = ctypes.CFUNCTYPE(ctypes.c_float, _i64, _vp, _vp)(tr.dot)
    return float(fn(n, w.ctypes.data, act.ctypes.data))


def matmul(
    t: int | str,
    w,
    k: int,
    x: np.ndarray,
    r0: int = 0,
    r1: int | None = None,
    panels: np.ndarray | None = None,
) -> np.ndarray:
    """y (n_tok, rows) = x (n_tok, k) @ W.T, W given raw as rows of k elements of type t.

    Activations are quantized to t's act_type first, as the forward pass does. Only rows
    [r0, r1) are computed (the others stay NaN), to test the thread pool's row splits. With
    panels (pack_panels'), through se_matmul_panels: the panels where they serve the batch.
    """
    w = _raw(w)
    rows = w.size // row_size(t, k)
    r1 = rows if r1 is None else r1
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, k)
    act = quantize(traits(t).act_type, x)
    y = np.full((x.shape[0], rows), np.nan, dtype=np.float32)
    args = (k, act.ctypes.data, x.shape[0], y.ctypes.data, rows, r0, r1)
    if panels is None:
        _core().se_matmul(type_id(t), w.ctypes.data, *args)
    else:
        _core().se_matmul_panels(type_id(t), w.ctypes.data, panels.ctypes.data, *args)
    return y


def pack_panels(t: int | str, w, k: int) -> np.ndarray | None:
    """W's packed panels (kernels.h) for the ISA in use, or None where it has none for type t."""
    w = _raw(w)
    rows = w.size // row_size(t, k)
    size = _core().se_panels_size(type_id(t), k, rows)
    if not size:
        return None
    panels = np.empty(size, np.uint8)
    _core().se_pack_panels(type_id(t), w.ctypes.data, k, rows, panels.ctypes.data)
    return panels


GLU_ACTS = {"silu": 0, "gelu_tanh": 1}  # se_ffn_act (csrc/blocks.h)


def glu(act: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """act(g) * u elementwise (the feed-forward's gated activation, csrc/activation.c), float32."""
    out = np.ascontiguousarray(g, dtype=np.float32).copy()
    u = np.ascontiguousarray(u, dtype=np.float32)
    if u.shape != out.shape:
        raise ValueError("g and u must have the same shape")
    _core().se_glu(GLU_ACTS[act], out.ctypes.data, u.ctypes.data, out.size)
    return out


def random_weights(t: int | str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """rows x k weights of type t as raw bytes, for timing: random quants with modest fp16 scales
    (d, and dmin or m, where a block has them: at its start, or its end for q2_K, q3_K and q6_K);
    float types all 0.01."""
    tr = traits(t)
    if tr.blck == 1:
        return (
            np.full((rows, k), 0.01, dtype={4: np.float32, 2: np.float16}[tr.size]).view(np.uint8).reshape(-1)
        )
    raw = rng.integers(0, 256, size=(rows, k // tr.blck, tr.size), dtype=np.uint8)
    at_end = {ggml_type("q2_K").id: [-4, -2], ggml_type("q3_K").id: [-2], ggml_type("q6_K").id: [-2]}
    for off in [tr.size + o for o in at_end[type_id(t)]] if type_id(t) in at_end else [0, 2]:
        raw[:, :, off : off + 2] = (
            np.full(raw.shape[:2], 0.01, np.float16).view(np.uint8).reshape(rows, -1, 2)
        )
    return np.ascontiguousarray(raw).reshape(-1)


def throughput(
    t: int | str, rows: int, k: int, n_tok: int = 1, seconds: float = 0.5, copies: int = 1
) -> dict:
    """Rough single-thread speed of se_matmul on random weights: GB/s of weights and GMAC/s.

    For debugging only (a ctypes call costs a few microseconds; benchmarks belong to bench/).
    copies > 1 cycles through that many distinct matrices, to read them from DRAM, not cache.
    """
    import time

    tr, c = traits(t), _core()
    rng = np.random.default_rng(0)
    mats = [random_weights(t, rows, k, rng) for _ in range(copies)]
    act = quantize(tr.act_type, rng.standard_normal((n_tok, k)).astype(np.float32))
    y = np.empty((n_tok, rows), dtype=np.float32)
    args = [
        (type_id(t), m.ctypes.data, k, act.ctypes.data, n_tok, y.ctypes.data, rows, 0, rows) for m in mats
    ]
    calls, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        for a in args:
            c.se_matmul(*a)
        calls += len(args)
    per_call = dt / calls
    return {
        "isa": isa(),
        "us_per_call": per_call * 1e6,
        "GB/s": rows * row_size(t, k) / per_call / 1e9,
        "GMAC/s": rows * k * n_tok / per_call / 1e9,
    }
