"""Open and validate a GGUF container, with errors that say what is wrong instead of tracebacks.

`scan_gguf` walks the container with bounds checks (magic, version, key/values, tensor infos, the
data section) and returns what it read; `open_gguf` runs that scan and then hands back the `gguf`
package's memory-mapped GGUFReader. Any problem becomes a BadModelFile naming the file.

The scan is ours rather than GGUFReader's because GGUFReader, given a damaged file, fails with bare
IndexError/ValueError (or reads short views without noticing); it is also much faster on large
vocabularies, since it skips over token arrays instead of building one numpy array per string.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from stdengine.errors import BadModelFile

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# By default arrays longer than this are not materialised by the scan (token lists, scores,
# merges): only their item type and length are kept, which is all that `models info` needs.
MAX_ARRAY_ITEMS = 1024

# GGUF metadata value types (gguf.h): id -> (name, struct format or None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "B"),
    1: ("int8", "b"),
    2: ("uint16", "H"),
    3: ("int16", "h"),
    4: ("uint32", "I"),
    5: ("int32", "i"),
    6: ("float32", "f"),
    7: ("bool", "?"),
    8: ("string", None),
    9: ("array", None),
    10: ("uint64", "Q"),
    11: ("int64", "q"),
    12: ("float64", "d"),
}


def ggml_type_name(type_id: int) -> str:
    """ggml's name for a tensor type (ggml.c's type_traits: f32, q4_1, q4_K, iq2_xxs, bf16)."""
    try:
        name = GGMLQuantizationType(type_id).name.lower()
    except ValueError:
        return f"unknown type {type_id}"
    return name.replace("_k", "_K")  # ggml keeps the K of k-quants upper case


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array too long to keep in the scan: its item type and length."""

    item_type: str
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (the contiguous row length) first
    type_id: int
    type_name: str
    offset: int  # absolute byte offset of the data in the file
    n_elements: int
    n_bytes: int


@dataclass
class GGUFHeader:
    path: Path
    file_size: int
    version: int
    byte_order: str  # "<" little-endian (normal) or ">" big-endian
    alignment: int
    data_offset: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)


class _Truncated(Exception):
    pass


class _Cursor:
    """Reads little/big-endian values from a buffer, raising _Truncated past its end."""

    def __init__(self, buf: Any, size: int, order: str, errors: str = "replace") -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, 0
        self.errors = errors  # how invalid UTF-8 in strings is decoded

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors=self.errors)

    def skip_string(self) -> None:
        n = self.unpack("Q")
        self.need(n)
        self.pos += n


MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


def _bad(path: Path, what: str, hint: str | None = None) -> BadModelFile:
    return BadModelFile(
        f"{path}: {what}",
        hint=hint or "re-download the model (for a catalogue model: infer models pull NAME --verify)",
        path=str(path),
    )


def scan_gguf(
    path: str | os.PathLike[str], *, load_arrays: bool = False, errors: str = "replace"
) -> GGUFHeader:
    """Read and check a GGUF file's header, key/values and tensor table; BadModelFile if damaged.

    Metadata arrays of up to MAX_ARRAY_ITEMS items are lists. Longer ones are ArrayValue (type
    and length only) unless load_arrays=True: then string arrays are lists of str and numeric
    arrays numpy arrays (a fast way to read a vocabulary: ~0.2 s for 262k tokens). errors: how
    strings with invalid UTF-8 are decoded ("surrogateescape" keeps a token's bytes).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise _bad(path, "not a regular file", hint="pass the path of a .gguf file")
        if size == 0:
            raise _bad(path, "the file is empty, not a GGUF model")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(path, buf, size, load_arrays, errors)
    except OSError as e:
        raise BadModelFile(
            f"{path}: cannot read the file: {e.strerror or e}",
            hint="check the path and its permissions",
            path=str(path),
        ) from e


def _scan(path: Path, buf: Any, size: int, load_arrays: bool, errors: str) -> GGUFHeader:
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        got = bytes(buf[:4])
        raise _bad(
            path,
            f"not a GGUF file (bad magic {got!r}, expected b'GGUF')",
            hint="pass a .gguf model file (llama.cpp's format), or a catalogue alias",
        )
    if size < 8:
        raise _bad(path, "truncated: the file ends inside the GGUF header (version)")
    # A file written on a big-endian machine has its version byte-swapped; read it that way.
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise _bad(
            path,
            f"unsupported GGUF version {version} (supported: 2, 3)",
            hint="convert the model again with a current llama.cpp (convert_hf_to_gguf.py)",
        )

    cur = _Cursor(buf, size, order, errors)
    cur.pos = 8
    where = "the GGUF header (tensor and key/value counts)"
    try:
        n_tensors = cur.unpack("q")
        n_kv = cur.unpack("q")
        if n_tensors < 0 or n_kv < 0:
            raise _bad(path, f"corrupt header: negative counts (tensors {n_tensors}, key/values {n_kv})")
        # A key/value takes at least 13 bytes and a tensor info 24: counts that cannot fit in the
        # rest of the file are refused before any loop (a crafted 2^31 would walk to the end).
        if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > size - cur.pos:
            raise _bad(
                path,
                f"truncated or corrupt: {n_tensors} tensors and {n_kv} key/values cannot fit in a file of {size} bytes",
            )
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            where = f"key/value #{i}"
            key = cur.string()
            where = f"key/value #{i} ({key!r})"
            vtype = cur.unpack("i")
            if key in metadata:
                raise _bad(path, f"duplicate metadata key {key!r}")
            metadata[key] = _read_value(path, cur, vtype, key, load_arrays)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for i in range(n_tensors):
            where = f"tensor info #{i}"
            name = cur.string()
            where = f"tensor info #{i} ({name!r})"
            n_dims = cur.unpack("I")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise _bad(path, f"tensor {name!r} has {n_dims} dimensions (at most 4)")
            shape = tuple(cur.unpack("q") for _ in range(n_dims))
            type_id = cur.unpack("i")
            offset = cur.unpack("Q")
            infos.append((name, shape, type_id, offset))
        tensor_info_end = cur.pos
    except _Truncated:
        raise _bad(path, f"truncated: the file ends (at byte {size}) inside {where}") from None

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment <= 0
        or alignment & (alignment - 1)
        or alignment % 8
    ):
        # GGUF requires a multiple of 8: a smaller one misaligns every tensor's data
        raise _bad(path, f"general.alignment is {alignment!r}; it must be a power of two and a multiple of 8")
    data_offset = -(-tensor_info_end // alignment) * alignment

    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for name, shape, type_id, offset in infos:
        if name in seen:
            raise _bad(path, f"two tensors are named {name!r}")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _bad(
                path,
                f"tensor {name!r} has unknown tensor type id {type_id}",
                hint="the file needs a newer engine, or it is corrupt",
            ) from None
        if any(d < 0 for d in shape):
            raise _bad(path, f"tensor {name!r} has a negative dimension {list(shape)}")
        n_elements = 1
        for d in shape:
            n_elements *= d
        if shape and shape[0] % block:
            raise _bad(
                path,
                f"tensor {name!r} ({ggml_type_name(type_id)}) has a row of {shape[0]} "
                f"elements, not a multiple of its block size {block}",
            )
        if offset % alignment:
            raise _bad(path, f"tensor {name!r} data offset {offset} is not aligned to {alignment}")
        n_bytes = n_elements // block * type_size
        start = data_offset + offset
        if start + n_bytes > size:
            raise _bad(
                path,
                f"truncated: tensor {name!r} data (bytes {start}..{start + n_bytes}) "
                f"runs past the end of the file ({size} bytes)",
            )
        tensors.append(TensorInfo(name, shape, type_id, ggml_type_name(type_id), start, n_elements, n_bytes))

    # Each tensor's bytes are its own: data that overlaps another tensor's (an offset rewritten to
    # 0, or a type changed to a larger one that still fits in the file) is corrupt, not shared.
    by_start = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(by_start, by_start[1:], strict=False):
        if a.offset + a.n_bytes > b.offset:
            raise _bad(
                path,
                f"tensor {a.name!r} ({a.type_name}, bytes {a.offset}..{a.offset + a.n_bytes}) overlaps "
                f"tensor {b.name!r} (from byte {b.offset}): the tensor table is corrupt",
            )

    return GGUFHeader(
        path=path,
        file_size=size,
        version=version,
        byte_order=order,
        alignment=alignment,
        data_offset=data_offset,
        metadata=metadata,
        tensors=tensors,
    )


def _read_value(path: Path, cur: _Cursor, vtype: int, key: str, load_arrays: bool) -> Any:
    if vtype not in VALUE_TYPES:
        raise _bad(path, f"metadata key {key!r} has unknown value type id {vtype}")
    name, fmt = VALUE_TYPES[vtype]
    if fmt is not None:
        return cur.unpack(fmt)
    if name == "string":
        return cur.string()
    item_type = cur.unpack("i")
    count = cur.unpack("Q")
    if item_type not in VALUE_TYPES or item_type == 9:
        raise _bad(path, f"metadata array {key!r} has unsupported item type id {item_type}")
    item_name, item_fmt = VALUE_TYPES[item_type]
    if (
        count * (8 if item_fmt is None else struct.calcsize(item_fmt)) > cur.size - cur.pos
    ):  # a string: 8 or more
        raise _bad(path, f"metadata array {key!r} of {count} items cannot fit in the rest of the file")
    small = count <= MAX_ARRAY_ITEMS
    if item_fmt is None:  # strings: walk them (each has its own length)
        if small or load_arrays:
            return [cur.string() for _ in range(count)]
        for _ in range(count):
            cur.skip_string()
        return ArrayValue(item_name, count)
    n = struct.calcsize(item_fmt) * count
    cur.need(n)
    start = cur.pos
    cur.pos += n
    if small:
        return list(struct.unpack_from(f"{cur.order}{count}{item_fmt}", cur.buf, start))
    if load_arrays:
        dtype = np.dtype(cur.order + item_fmt)  # cur.order is "<" or ">"
        return np.frombuffer(cur.buf, dtype=dtype, count=count, offset=start).copy()
    return ArrayValue(item_name, count)


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Check the file (scan_gguf), then open it with gguf.GGUFReader (memory-mapped, read-only).

    Raises BadModelFile, naming the file, for anything wrong with the container.
    """
    scan_gguf(path)
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # the scan passed, so this is a case it does not know: still no traceback
        raise _bad(Path(path), f"the gguf package cannot read it: {type(e).__name__}: {e}") from e
