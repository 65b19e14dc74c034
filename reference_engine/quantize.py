"""ctypes binding of the C core's weight quantizers (csrc/quantize.h), used by `infer quantize`.

`quantize(type, x)` turns float rows into the raw bytes of a GGUF tensor of that type; with
`decoded=True` it also returns the values those bytes decode to (what the quantizer intended),
which the tests compare with gguf.quants' dequantization bit for bit.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import numpy as np

from stdengine.gguf_file import ggml_type
from stdengine.reference._lib import lib

# The types the quantizers write (ggml names), coarsest last.
TYPES = ("q8_0", "q6_K", "q5_K", "q5_1", "q5_0", "q4_K", "q4_1", "q4_0", "q3_K", "q2_K")

_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@cache
def _c() -> ctypes.CDLL:
    c = lib()
    c.se_quantize_supported.argtypes, c.se_quantize_supported.restype = [_int], _int
    c.se_quantize_weights.argtypes = [_int, _vp, _i64, _i64, _vp, _vp, _vp, _int]
    c.se_quantize_weights.restype = _int
    return c


def supported(t: int | str) -> bool:
    return bool(_c().se_quantize_supported(ggml_type(t).id))


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def quantize(
    t: int | str,
    x: np.ndarray,
    imatrix: np.ndarray | None = None,
    threads: int | None = None,
    decoded: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Rows of float32 (shape (n,) or (rows, n)) -> uint8 (rows, row bytes) of ggml type t.

    imatrix: one importance per column (n values, >= 0), or None. ValueError for a type the
    quantizers do not write or a row length that is not a whole number of blocks.
    """
    gt = ggml_type(t)
    x = np.ascontiguousarray(x, dtype=np.float32)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])
    rows, n = x2.shape
    if not supported(gt.id):
        raise ValueError(f"cannot quantize to {gt.name}")
    if n % gt.block:
        raise ValueError(f"{gt.name} rows need a multiple of {gt.block} elements, not {n}")
    im = None
    if imatrix is not None:
        im = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if im.size != n:
            raise ValueError(f"the importance vector has {im.size} values for rows of {n}")
    out = np.empty((rows, n // gt.block * gt.size), dtype=np.uint8)
    dec = np.empty_like(x2) if decoded else None
    rc = _c().se_quantize_weights(
        gt.id,
        x2.ctypes.data,
        rows,
        n,
        None if im is None else im.ctypes.data,
        out.ctypes.data,
        None if dec is None else dec.ctypes.data,
        threads or default_threads(),
    )
    if rc == -2:
        raise OSError("could not start the quantizer's threads")
    if rc != 0:
        raise ValueError(f"cannot quantize rows of {n} elements to {gt.name}")
    return (out, dec) if dec is not None else out
