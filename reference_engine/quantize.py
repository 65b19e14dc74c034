"""ctypes binding of the C core's weight quantizers (csrc/quantize.h), used by `infer quantize`.

`quantize(type, x)` turns float rows into the raw bytes of a GGUF tensor of that type; with
`decoded=True` it also returns the values those bytes decode to (what the quantizer intended),
which the tests compare with gguf.quants' dequantization bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from stdengine.reference._lib import lib

from stdengine.errors import BadModelFile, UsageError
from stdengine.gguf_file import ggml_type, scan_gguf

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


# ---- whole models: the recipes (spec/quantize.md), imatrix files, and the GGUF writer ----------

# A file type: what `--type` accepts -> (the default tensor type, llama.cpp's llama_ftype id written
# as general.file_type). The mixes are llama.cpp's names; the plain K names are the one type for
# every tensor a recipe quantizes (Q5_K and Q3_K are then exactly llama.cpp's Q5_K_S and Q3_K_S).
FILE_TYPES: dict[str, tuple[str, int]] = {
    "F32": ("f32", 0),
    "F16": ("f16", 1),
    "Q8_0": ("q8_0", 7),
    "Q6_K": ("q6_K", 18),
    "Q5_K_M": ("q5_K", 17),
    "Q5_K_S": ("q5_K", 16),
    "Q5_K": ("q5_K", 16),
    "Q5_1": ("q5_1", 9),
    "Q5_0": ("q5_0", 8),
    "Q4_K_M": ("q4_K", 15),
    "Q4_K_S": ("q4_K", 14),
    "Q4_K": ("q4_K", 14),
    "Q4_1": ("q4_1", 3),
    "Q4_0": ("q4_0", 2),
    "Q3_K_M": ("q3_K", 12),
    "Q3_K_S": ("q3_K", 11),
    "Q3_K": ("q3_K", 11),
    "Q2_K": ("q2_K", 10),
}
# A row length a K type cannot hold falls back to a 32-element type (llama.cpp's choices).
FALLBACK = {"q2_K": "q4_0", "q3_K": "q4_0", "q4_K": "q5_0", "q5_K": "q5_1", "q6_K": "q8_0"}
# Names that are never quantized, as substrings (norms, routers, small special tensors).
_KEEP = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "attn_rel_b.weight",
    "position_embd",
    "token_types",
)


def quantizable(name: str, n_dims: int) -> bool:
    """Whether a recipe may change this tensor's type: 2-D (or more) weights except norms etc."""
    return n_dims >= 2 and name.endswith("weight") and not any(k in name for k in _KEEP)


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for cat in (
        "attn_qkv.weight",
        "attn_kv_b.weight",
        "attn_v.weight",
        "attn_k.weight",
        "attn_q.weight",
        "attn_output.weight",
        "ffn_up",
        "ffn_gate",
        "ffn_down",
    ):
        if cat in name:
            return {"attn_qkv.weight": "attn_v", "attn_kv_b.weight": "attn_v"}.get(cat, cat.split(".")[0])
    return "other"


def _more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp's _M mixes give more bits: the first and last eighth and every third."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else -1


def plan(
    tensors: list[tuple[str, tuple[int, ...], str]],
    file_type: str,
    metadata: dict[str, Any],
    pure: bool = False,
    has_imatrix: bool = False,
) -> dict[str, str]:
    """Each tensor's output type (ggml name), from (name, shape, current type) in the file's order.

    llama.cpp's per-tensor rules for the file type (spec/quantize.md); pure: the default type for
    every quantizable tensor. Counters walk the tensors by layer, as llama.cpp's loader sorts them.
    """
    ft = file_type.upper()
    base = FILE_TYPES[ft][0]
    arch = str(metadata.get("general.architecture", ""))
    n_layer = int(metadata.get(f"{arch}.block_count", 0) or 0)
    n_head = int(metadata.get(f"{arch}.attention.head_count", 1) or 1)
    n_kv = int(metadata.get(f"{arch}.attention.head_count_kv", n_head) or n_head)
    n_gqa = n_head // max(n_kv, 1)
    names = {t[0] for t in tensors}
    tied = "output.weight" not in names
    n_attn_v = sum(_category(n) == "attn_v" for n in names)
    i_v = i_down = 0
    out: dict[str, str] = {}
    for name, shape, cur in sorted(tensors, key=lambda t: (_layer(t[0]), t[0])):
        if not quantizable(name, len(shape)):
            out[name] = cur
            continue
        cat, t = _category(name), base
        if pure or base in ("f32", "f16"):
            pass
        elif cat == "output" or (tied and cat == "token_embd"):
            t = "q8_0" if shape[0] % ggml_type(base).block else base if base == "q8_0" else "q6_K"
        elif cat == "attn_v":
            if ft == "Q2_K":
                t = "q4_K" if n_gqa >= 4 else "q3_K"
            elif ft == "Q3_K_M":
                t = "q5_K" if i_v < 2 else "q4_K"
            elif ft in ("Q4_K_M", "Q5_K_M") and _more_bits(i_v, n_attn_v):
                t = "q6_K"
            elif ft == "Q4_K_S" and i_v < 4:
                t = "q5_K"
            i_v += 1
        elif cat == "ffn_down":
            i = i_down
            if ft == "Q2_K":
                t = "q3_K"
            elif ft == "Q3_K_M":
                t = "q5_K" if i < n_layer // 16 else "q4_K"
            elif ft in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n_layer):
                t = "q6_K"
            elif ft == "Q4_K_S" and i < n_layer // 8:
                t = "q5_K"
            elif ft in ("Q4_0", "Q5_0") and has_imatrix and i < n_layer // 8:
                t = "q4_1" if ft == "Q4_0" else "q5_1"
            i_down += 1
        elif cat == "attn_output":
            t = {"Q2_K": "q3_K", "Q3_K_M": "q4_K"}.get(ft, t)
        blk = ggml_type(t).block
        if shape[0] % blk:
            t = FALLBACK.get(t, t)
            if shape[0] % ggml_type(t).block:
                t = "f16"
        out[name] = t
    return out


def read_imatrix(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """An importance matrix: tensor name -> mean squared activation per input column.

    llama.cpp's GGUF imatrix (tensors NAME.in_sum2 and NAME.counts: sum / count, 1 where the count
    is 0) or its older .dat (int32 entries; per entry int32 name length, name, int32 ncall, int32
    nval, nval float32 sums to divide by ncall). BadModelFile for anything else.
    """
    import struct

    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise BadModelFile(f"{p}: cannot read the imatrix: {e.strerror or e}", path=str(p)) from e
    out: dict[str, np.ndarray] = {}
    if raw[:4] == b"GGUF":
        from gguf import GGUFReader

        try:
            r = GGUFReader(p)
            ts = {t.name: np.asarray(t.data, dtype=np.float32) for t in r.tensors}
        except Exception as e:  # gguf's reader fails with bare errors on damaged files
            raise BadModelFile(f"{p}: not a readable imatrix GGUF ({e})", path=str(p)) from e
        for name, sums in ts.items():
            if not name.endswith(".in_sum2"):
                continue
            base = name[: -len(".in_sum2")]
            counts = ts.get(base + ".counts")
            if counts is None:
                raise BadModelFile(f"{p}: {base} has sums but no counts", path=str(p))
            s = sums.reshape(counts.size, -1)
            c = counts.reshape(-1, 1)
            out[base] = np.where(c > 0, s / np.where(c > 0, c, 1), 1.0).astype(np.float32).reshape(-1)
    else:
        try:
            (n,), off = struct.unpack_from("<i", raw, 0), 4
            if n < 1:
                raise ValueError("no entries")
            for _ in range(n):
                (ln,) = struct.unpack_from("<i", raw, off)
                name = raw[off + 4 : off + 4 + ln].decode()
                off += 4 + ln
                ncall, nval = struct.unpack_from("<ii", raw, off)
                off += 8
                if nval < 1 or off + 4 * nval > len(raw):
                    raise ValueError(f"entry {name!r} is truncated")
                v = np.frombuffer(raw, dtype="<f4", count=nval, offset=off).astype(np.float32)
                off += 4 * nval
                out[name] = v / ncall if ncall > 0 else v
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise BadModelFile(
                f"{p}: not an imatrix file (llama.cpp's GGUF or .dat format): {e}", path=str(p)
            ) from e
    if not out:
        raise BadModelFile(f"{p}: the imatrix has no entries", path=str(p))
    for name, v in out.items():
        if not np.all(np.isfinite(v)):
            raise BadModelFile(f"{p}: the imatrix entry {name} has non-finite values", path=str(p))
    return out


def _kv_spans(buf: Any, n_kv: int) -> list[tuple[str, int, int]]:
    """(key, start, end) of each raw key/value of a little-endian GGUF v2/v3 file, to copy as is."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    off, spans = 24, []

    def skip(vt: int, off: int) -> int:
        if vt == 8:
            return off + 8 + struct.unpack_from("<Q", buf, off)[0]
        if vt == 9:
            it, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if it == 8:
                for _ in range(count):
                    off += 8 + struct.unpack_from("<Q", buf, off)[0]
                return off
            if it == 9:
                for _ in range(count):
                    off = skip(9, off)
                return off
            return off + sizes[it] * count
        return off + sizes[vt]

    for _ in range(n_kv):
        start = off
        (klen,) = struct.unpack_from("<Q", buf, off)
        key = bytes(buf[off + 8 : off + 8 + klen]).decode("utf-8", "replace")
        off += 8 + klen
        (vt,) = struct.unpack_from("<I", buf, off)
        off = skip(vt, off + 4)
        spans.append((key, start, off))
    return spans


def _gguf_str(s: str) -> bytes:
    import struct

    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value: int | str) -> bytes:
    import struct

    if isinstance(value, str):
        return _gguf_str(key) + struct.pack("<I", 8) + _gguf_str(value)
    return _gguf_str(key) + struct.pack("<II", 4, value)


def to_float(raw: np.ndarray, type_name: str, n: int) -> np.ndarray:
    """n elements of a tensor's raw bytes as float32: the engine's own dequantization (its C
    to_float) where it has the type, else gguf.quants'."""
    if type_name == "f32":
        return raw.view(np.float32)[:n]
    if type_name == "f16":
        return raw.view(np.float16)[:n].astype(np.float32)
    if type_name == "bf16":
        return (raw.view(np.uint16)[:n].astype(np.uint32) << 16).view(np.float32)
    from stdengine.reference import core, kernels

    if core.type_traits(ggml_type(type_name).id) is not None:
        return kernels.dequantize(type_name, raw, n)
    import gguf

    return (
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type(type_name).id))
        .reshape(-1)[:n]
        .astype(np.float32)
    )


def _encode(x: np.ndarray, t: str, im: np.ndarray | None, threads: int | None) -> np.ndarray:
    if t == "f32":
        return x.astype(np.float32).view(np.uint8).reshape(-1)
    if t == "f16":
        return x.astype(np.float16).view(np.uint8).reshape(-1)
    return np.asarray(quantize(t, x, imatrix=im, threads=threads)).reshape(-1)


def quantize_model(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    file_type: str,
    *,
    pure: bool = False,
    imatrix: dict[str, np.ndarray] | None = None,
    imatrix_name: str | None = None,
    threads: int | None = None,
    on_start: Callable[[dict[str, str], int, int], None] | None = None,
    on_progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Write src quantized to file_type as dst; returns a summary (types, sizes, warnings).

    The file is written as a temporary file next to dst and renamed at the end, so a failed or
    interrupted run leaves no dst. on_start(types, estimated output bytes, total elements) is
    called before any tensor is written; on_progress(tensor name, elements done) after each.
    """
    import mmap
    import struct
    import tempfile

    from stdengine import __version__

    src, dst = Path(src), Path(dst)
    ft = file_type.upper()
    if ft not in FILE_TYPES:
        raise UsageError(f"unknown quantization type {file_type!r}", hint="one of: " + ", ".join(FILE_TYPES))
    h = scan_gguf(src)
    if h.byte_order != "<":
        raise BadModelFile(f"{src}: big-endian GGUF files are not supported", path=str(src))
    shapes = [(t.name, t.shape, t.type_name) for t in h.tensors]
    types = plan(shapes, ft, h.metadata, pure=pure, has_imatrix=bool(imatrix))
    warnings: list[str] = []
    requant = sorted(
        {
            t.type_name
            for t in h.tensors
            if t.type_name not in ("f32", "f16", "bf16") and types[t.name] != t.type_name
        }
    )
    if requant:
        warnings.append(
            f"the source is already quantized ({', '.join(requant)}): requantizing adds the new "
            "error to the old one; quantize from an F32/F16/BF16 file where you have one"
        )
    for t in h.tensors:
        if types[t.name] not in ("f32", "f16", "bf16", t.type_name) and not supported(types[t.name]):
            raise UsageError(f"cannot write {types[t.name]} tensors")
        if types[t.name] != t.type_name and t.type_name not in ("f32", "f16", "bf16"):
            from stdengine.reference import core

            if core.type_traits(t.type_id) is None and t.type_name not in GGML_QUANTS_READABLE:
                raise BadModelFile(f"{src}: cannot dequantize {t.name} ({t.type_name})", path=str(src))
    if imatrix is not None:
        missing = [
            t.name
            for t in h.tensors
            if types[t.name] != t.type_name and types[t.name] not in ("f16", "f32") and t.name not in imatrix
        ]
        if missing:
            warnings.append(f"the imatrix has no entry for {len(missing)} tensors (e.g. {missing[0]})")

    align = h.alignment
    pad = lambda n: (n + align - 1) // align * align  # noqa: E731
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        (n_kv,) = struct.unpack_from("<Q", buf, 16)
        replaced = {
            "general.file_type",
            "general.quantization_version",
            "stdengine.quantize.tool",
            "stdengine.quantize.source",
            "quantize.imatrix.file",
            "quantize.imatrix.entries_count",
        }
        kvs = [bytes(buf[a:b]) for k, a, b in _kv_spans(buf, n_kv) if k not in replaced]
        kvs += [
            _kv("general.quantization_version", 2),
            _kv("general.file_type", FILE_TYPES[ft][1]),
            _kv(
                "stdengine.quantize.tool",
                f"stdengine {__version__} infer quantize --type {ft}" + (" --pure" if pure else ""),
            ),
            _kv(
                "stdengine.quantize.source",
                f"{src.name} (file type {h.metadata.get('general.file_type', '?')})",
            ),
        ]
        if imatrix is not None:
            kvs += [
                _kv("quantize.imatrix.file", imatrix_name or "?"),
                _kv("quantize.imatrix.entries_count", len(imatrix)),
            ]
        infos, off = [], 0
        for t in h.tensors:
            nb = ggml_type(types[t.name]).size * (t.n_elements // ggml_type(types[t.name]).block)
            infos.append(
                _gguf_str(t.name)
                + struct.pack("<I", len(t.shape))
                + struct.pack(f"<{len(t.shape)}Q", *t.shape)
                + struct.pack("<IQ", ggml_type(types[t.name]).id, off)
            )
            off = pad(off + nb)
        head = b"GGUF" + struct.pack("<IQQ", 3, len(h.tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
        total = pad(len(head)) + off
        if on_start:
            on_start(types, total, sum(t.n_elements for t in h.tensors))
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(head)
                out.write(b"\0" * (pad(len(head)) - len(head)))
                for t in h.tensors:
                    # a copy: a view would keep the mmap from closing
                    raw = np.frombuffer(buf[t.offset : t.offset + t.n_bytes], dtype=np.uint8)
                    new = types[t.name]
                    if new == t.type_name:
                        data = raw
                    else:
                        x = to_float(raw, t.type_name, t.n_elements).reshape(-1, t.shape[0])
                        im = imatrix.get(t.name) if imatrix is not None else None
                        if im is not None and im.size != t.shape[0]:
                            raise BadModelFile(
                                f"the imatrix entry {t.name} has {im.size} values for rows of {t.shape[0]}"
                            )
                        data = _encode(x, new, im, threads)
                    out.write(data.tobytes() if not data.flags.c_contiguous else data.data)
                    out.write(b"\0" * (pad(data.size) - data.size))
                    if on_progress:
                        on_progress(t.name, t.n_elements)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private; the output is an ordinary file
            os.replace(tmp, dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return {"types": types, "bytes": total, "source_bytes": h.file_size, "warnings": warnings}


# Quantized types the engine cannot dequantize in C but gguf.quants can (requantizing input only).
GGML_QUANTS_READABLE = frozenset({"q2_K", "q3_K", "iq4_nl", "iq4_xs", "q8_1"})
